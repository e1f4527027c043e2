"""Async CP wrappers for Qwen3 attention (Qwen3Attention) through the handoff protocol (design 4.4).

Public ``_target_`` paths (``hyper_parallel.models.qwen3.adapter.distributed.context_parallel_async.``):
``qwen3_async_colossal_cp_wrapper``, ``qwen3_async_ulysses_cp_wrapper``,
``qwen3_async_hybrid_cp_wrapper`` (named parameter ``ulysses_degree``) and
``qwen3_async_load_balance_cp_wrapper`` (Head-Tail, batch policy 'load_balance').

The attention keeps its math (projections, per-head q/k RMSNorm, RoPE, o_proj);
:func:`hyper_parallel.models.handoff_attention.handoff_forward` runs it K, V first with the
handoff modules, ``sliding_window`` = the layer's ``sliding_window`` (set on sliding-attention layers), as HF passes it. The launch/wait/backward contract is the generic one
(:mod:`hyper_parallel.distributed.context_parallel.wrappers.async_handoff`).
"""
from __future__ import annotations

from ....handoff_attention import HFAttentionSpec, adapter_wrappers

ADAPTER = "qwen3"
SPEC = HFAttentionSpec(ADAPTER, "Qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3Attention", qk_norm=True,
                       window=lambda attn: attn.sliding_window)
_TARGETS = adapter_wrappers(SPEC, __name__)

qwen3_async_colossal_cp_wrapper = _TARGETS["colossal"]
qwen3_async_ulysses_cp_wrapper = _TARGETS["ulysses"]
qwen3_async_hybrid_cp_wrapper = _TARGETS["hybrid"]
qwen3_async_load_balance_cp_wrapper = _TARGETS["load_balance"]

__all__ = ["qwen3_async_colossal_cp_wrapper", "qwen3_async_ulysses_cp_wrapper", "qwen3_async_hybrid_cp_wrapper",
           "qwen3_async_load_balance_cp_wrapper", "SPEC"]
