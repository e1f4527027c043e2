"""Async CP Targets for Qwen3 (Qwen3Attention), handoff protocol (docs/async_cp.md).

``hyper_parallel.models.qwen3.adapter.distributed.context_parallel_async.qwen3_async_<method>_cp_wrapper``
for ``<method>`` in colossal, ulysses, hybrid (``ulysses_degree``), load_balance. Per-head q/k RMSNorm before RoPE; per-layer ``sliding_window`` as in Qwen2.
"""
from __future__ import annotations

from ....handoff_attention import HFAttentionSpec, adapter_wrappers, target_names

SPEC = HFAttentionSpec("qwen3", "Qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3Attention",
                       qk_norm=True, window=lambda attn: attn.sliding_window)
globals().update(adapter_wrappers(SPEC, __name__))
__all__ = ["SPEC", *target_names(SPEC.arch)]
