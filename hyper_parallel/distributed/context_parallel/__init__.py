"""Context parallelism: collectives with autograd, strategies, batch contract, wrappers."""
from .model_spec import find_attention_boundaries, register_cp_model_spec
from .registry import inner_wrapper, register_inner_wrapper
