"""Async CP wrappers for Qwen2 attention (Qwen2Attention) through the handoff protocol (design 4.4).

Public ``_target_`` paths (``hyper_parallel.models.qwen2.adapter.distributed.context_parallel_async.``):
``qwen2_async_colossal_cp_wrapper``, ``qwen2_async_ulysses_cp_wrapper``,
``qwen2_async_hybrid_cp_wrapper`` (named parameter ``ulysses_degree``) and
``qwen2_async_load_balance_cp_wrapper`` (Head-Tail, batch policy 'load_balance').

The attention keeps its math (projections, RoPE, o_proj);
:func:`hyper_parallel.models.handoff_attention.handoff_forward` runs it K, V first with the
handoff modules, ``sliding_window`` = the layer's ``sliding_window`` (set on sliding-attention layers), as HF passes it. The launch/wait/backward contract is the generic one
(:mod:`hyper_parallel.distributed.context_parallel.wrappers.async_handoff`).
"""
from __future__ import annotations

from ....handoff_attention import HFAttentionSpec, adapter_wrappers

ADAPTER = "qwen2"
SPEC = HFAttentionSpec(ADAPTER, "Qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2Attention", qk_norm=False,
                       window=lambda attn: attn.sliding_window)
_TARGETS = adapter_wrappers(SPEC, __name__)

qwen2_async_colossal_cp_wrapper = _TARGETS["colossal"]
qwen2_async_ulysses_cp_wrapper = _TARGETS["ulysses"]
qwen2_async_hybrid_cp_wrapper = _TARGETS["hybrid"]
qwen2_async_load_balance_cp_wrapper = _TARGETS["load_balance"]

__all__ = ["qwen2_async_colossal_cp_wrapper", "qwen2_async_ulysses_cp_wrapper", "qwen2_async_hybrid_cp_wrapper",
           "qwen2_async_load_balance_cp_wrapper", "SPEC"]
