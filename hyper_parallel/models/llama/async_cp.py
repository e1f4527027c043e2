"""Llama attention's async CP Targets (handoff protocol: :mod:`..handoff_attention`,
docs/async_cp.md), importable at the design's public path
``hyper_parallel.models.llama.adapter.distributed.context_parallel_async``."""
from __future__ import annotations

from ..handoff_attention import HFAttentionSpec, publish_adapter

SPEC = HFAttentionSpec("llama", "Llama", "transformers.models.llama.modeling_llama", "LlamaAttention",
                       qk_norm=False, window=None)
# llama_async_{colossal,ulysses,hybrid,load_balance}_cp_wrapper
__all__ = publish_adapter(SPEC, globals())
