"""Qwen2 attention's async CP Targets (handoff protocol: :mod:`..handoff_attention`,
docs/async_cp.md), importable at the design's public path
``hyper_parallel.models.qwen2.adapter.distributed.context_parallel_async``."""
from __future__ import annotations

from ..handoff_attention import HFAttentionSpec, publish_adapter

SPEC = HFAttentionSpec("qwen2", "Qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2Attention",
                       qk_norm=False, window=lambda attn: attn.sliding_window)
# qwen2_async_{colossal,ulysses,hybrid,load_balance}_cp_wrapper
__all__ = publish_adapter(SPEC, globals())
