"""Async CP Targets for Qwen2 (Qwen2Attention), handoff protocol (docs/async_cp.md).

``hyper_parallel.models.qwen2.adapter.distributed.context_parallel_async.qwen2_async_<method>_cp_wrapper``
for ``<method>`` in colossal, ulysses, hybrid (``ulysses_degree``), load_balance. Sliding window: the layer's ``sliding_window`` (set on sliding-attention layers).
"""
from __future__ import annotations

from ....handoff_attention import HFAttentionSpec, adapter_wrappers, target_names

SPEC = HFAttentionSpec("qwen2", "Qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2Attention",
                       qk_norm=False, window=lambda attn: attn.sliding_window)
globals().update(adapter_wrappers(SPEC, __name__))
__all__ = ["SPEC", *target_names(SPEC.arch)]
