"""Async CP wrappers for Mistral attention (MistralAttention) through the handoff protocol (design 4.4).

Public ``_target_`` paths (``hyper_parallel.models.mistral.adapter.distributed.context_parallel_async.``):
``mistral_async_colossal_cp_wrapper``, ``mistral_async_ulysses_cp_wrapper``,
``mistral_async_hybrid_cp_wrapper`` (named parameter ``ulysses_degree``) and
``mistral_async_load_balance_cp_wrapper`` (Head-Tail, batch policy 'load_balance').

The attention keeps its math (projections, RoPE, o_proj);
:func:`hyper_parallel.models.handoff_attention.handoff_forward` runs it K, V first with the
handoff modules, ``sliding_window`` = ``config.sliding_window``, as HF passes it (carried to the engine: exact). The launch/wait/backward contract is the generic one
(:mod:`hyper_parallel.distributed.context_parallel.wrappers.async_handoff`).
"""
from __future__ import annotations

from ....handoff_attention import HFAttentionSpec, adapter_wrappers

ADAPTER = "mistral"
SPEC = HFAttentionSpec(ADAPTER, "Mistral", "transformers.models.mistral.modeling_mistral", "MistralAttention", qk_norm=False,
                       window=lambda attn: getattr(attn.config, "sliding_window", None))
_TARGETS = adapter_wrappers(SPEC, __name__)

mistral_async_colossal_cp_wrapper = _TARGETS["colossal"]
mistral_async_ulysses_cp_wrapper = _TARGETS["ulysses"]
mistral_async_hybrid_cp_wrapper = _TARGETS["hybrid"]
mistral_async_load_balance_cp_wrapper = _TARGETS["load_balance"]

__all__ = ["mistral_async_colossal_cp_wrapper", "mistral_async_ulysses_cp_wrapper", "mistral_async_hybrid_cp_wrapper",
           "mistral_async_load_balance_cp_wrapper", "SPEC"]
