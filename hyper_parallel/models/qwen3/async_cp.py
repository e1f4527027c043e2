"""Qwen3 attention's async CP Targets (handoff protocol: :mod:`..handoff_attention`,
docs/async_cp.md), importable at the design's public path
``hyper_parallel.models.qwen3.adapter.distributed.context_parallel_async``."""
from __future__ import annotations

from ..handoff_attention import HFAttentionSpec, publish_adapter

SPEC = HFAttentionSpec("qwen3", "Qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3Attention",
                       qk_norm=True, window=lambda attn: attn.sliding_window)
# qwen3_async_{colossal,ulysses,hybrid,load_balance}_cp_wrapper
__all__ = publish_adapter(SPEC, globals())
