"""Qwen3-MoE attention's async CP Targets (handoff protocol: :mod:`..handoff_attention`,
docs/async_cp.md), importable at the design's public path
``hyper_parallel.models.qwen3_moe.adapter.distributed.context_parallel_async``."""
from __future__ import annotations

from ..handoff_attention import HFAttentionSpec, publish_adapter

SPEC = HFAttentionSpec("qwen3_moe", "Qwen3-MoE", "transformers.models.qwen3_moe.modeling_qwen3_moe",
                       "Qwen3MoeAttention", qk_norm=True, window=lambda attn: attn.sliding_window)
# qwen3_moe_async_{colossal,ulysses,hybrid,load_balance}_cp_wrapper
__all__ = publish_adapter(SPEC, globals())
