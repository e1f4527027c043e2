"""Context parallelism: collectives with autograd, strategies, batch contract, wrappers."""
from .batch import gather_from_cp, shard_batch_for_cp
from .collectives import flex_cp_allgather, ulysses_head_to_seq, ulysses_seq_to_head
from .meta import CPBatchMeta, cp_batch_context, current_cp_batch_meta
from .model_spec import find_attention_boundaries, register_cp_model_spec
from .model_proof import ProofReport, prove_cp_model
from .registry import inner_wrapper, register_inner_wrapper
from .strategies import (AllGatherStrategy, ContextParallelStrategy, HeadTailStrategy, HybridStrategy,
                         UlyssesStrategy, build_strategy)
