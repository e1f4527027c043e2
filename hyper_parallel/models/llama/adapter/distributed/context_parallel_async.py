"""Async CP wrappers for Llama attention (LlamaAttention) through the handoff protocol (design 4.4).

Public ``_target_`` paths (``hyper_parallel.models.llama.adapter.distributed.context_parallel_async.``):
``llama_async_colossal_cp_wrapper``, ``llama_async_ulysses_cp_wrapper``,
``llama_async_hybrid_cp_wrapper`` (named parameter ``ulysses_degree``) and
``llama_async_load_balance_cp_wrapper`` (Head-Tail, batch policy 'load_balance').

The attention keeps its math (projections, RoPE, o_proj);
:func:`hyper_parallel.models.handoff_attention.handoff_forward` runs it K, V first with the
handoff modules, no sliding window (HF passes none). The launch/wait/backward contract is the generic one
(:mod:`hyper_parallel.distributed.context_parallel.wrappers.async_handoff`).
"""
from __future__ import annotations

from ....handoff_attention import HFAttentionSpec, adapter_wrappers

ADAPTER = "llama"
SPEC = HFAttentionSpec(ADAPTER, "Llama", "transformers.models.llama.modeling_llama", "LlamaAttention", qk_norm=False,
                       window=None)
_TARGETS = adapter_wrappers(SPEC, __name__)

llama_async_colossal_cp_wrapper = _TARGETS["colossal"]
llama_async_ulysses_cp_wrapper = _TARGETS["ulysses"]
llama_async_hybrid_cp_wrapper = _TARGETS["hybrid"]
llama_async_load_balance_cp_wrapper = _TARGETS["load_balance"]

__all__ = ["llama_async_colossal_cp_wrapper", "llama_async_ulysses_cp_wrapper", "llama_async_hybrid_cp_wrapper",
           "llama_async_load_balance_cp_wrapper", "SPEC"]
