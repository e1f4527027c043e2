"""Async CP wrappers for Qwen3-MoE attention through the handoff protocol (docs/async_cp.md).

Public ``_target_`` paths (unchanged):
  hyper_parallel.models.qwen3_moe.adapter.distributed.context_parallel_async.qwen3_moe_async_colossal_cp_wrapper
  ...qwen3_moe_async_ulysses_cp_wrapper
  ...qwen3_moe_async_hybrid_cp_wrapper  (named parameter ``ulysses_degree``)
  ...qwen3_moe_async_load_balance_cp_wrapper  (Head-Tail, batch policy 'load_balance')

The attention keeps HF's math (q/k/v/o projections, per-head RMSNorm, RoPE, the layer's
``sliding_window``); :func:`hyper_parallel.models.handoff_attention.handoff_forward` orders it so
each collective is launched at its last safe handoff and waited only at the attention consumer::

    k = rope(k_norm(k_proj(h)))   -> cp_k_handoff: launch K  (Colossal: AllGather; Ulysses: seq->head A2A;
    v = v_proj(h)                 -> cp_v_handoff: launch V   Hybrid: A2A chained into AllGather)
    q = rope(q_norm(q_proj(h)))   -> cp_q_handoff (overlaps K/V) [Ulysses/Hybrid: launch Q]
    cp_attn_wait(q, k, v): wait -> engine attention with global positions -> [head->seq A2A] -> o_proj

Backward mirrors it: the inverse collectives of dK/dV (dQ) are launched when the consumer's
gradient arrives and waited right before the K/V projection backward, so they overlap the Q
branch (RoPE/norm backward and the q_proj grad GEMM). Launch, wait, preflight (probe forward,
head rules, pseudo-async refusal) and the runtime checks before the first launch are the
generic ones (:mod:`hyper_parallel.distributed.context_parallel.wrappers.async_handoff`).
"""
from __future__ import annotations

from ....handoff_attention import HFAttentionSpec, adapter_wrappers, target_names

ADAPTER = "qwen3_moe"
SPEC = HFAttentionSpec(ADAPTER, "Qwen3-MoE", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeAttention",
                       qk_norm=True, window=lambda attn: attn.sliding_window)
# qwen3_moe_async_{colossal,ulysses,hybrid,load_balance}_cp_wrapper
globals().update(adapter_wrappers(SPEC, __name__))
__all__ = ["SPEC", *target_names(ADAPTER)]
