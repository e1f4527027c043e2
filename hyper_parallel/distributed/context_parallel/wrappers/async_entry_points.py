"""Generic async CP Targets for any attention implementing the handoff protocol (design 3.1.1 / 4.4).

Public paths: ``hyper_parallel.distributed.context_parallel.wrappers.<name>``:

=====================================  =====================================================
``async_colossal_cp_wrapper``          K/V AllGather launched at the K/V handoffs in ``kv_chunks`` sequence chunks,
                                       pipelined through the attention (LSE merge); ReduceScatter per chunk
                                       in backward
``async_ulysses_cp_wrapper``           K/V seq->head A2A launched at their handoffs, Q in ``q_chunks`` pipelined
                                       sequence chunks; each chunk's output head->seq A2A launched after its
                                       attention; inverse A2As in backward
``async_hybrid_cp_wrapper``            (``ulysses_degree``) K/V: ulysses A2A chained into colossal AllGather
                                       on the comm thread; Q / output: ulysses A2A per pipelined chunk;
                                       backward mirrors every stage
``async_load_balance_cp_wrapper``      Head-Tail load balance, see its docstring for the launch/wait order
=====================================  =====================================================

``q_chunks`` (optional YAML parameter of the Ulysses, Hybrid and Head-Tail Targets, default
:data:`.async_handoff.DEFAULT_Q_CHUNKS` = 4; the model adapters' Targets use the default): the query
side is pipelined in G sequence chunks of the local query, G the largest divisor of the local
length (Head-Tail: of half of it) not above ``q_chunks``; 1 = no pipelining. The method and the
result do not change, only when the Q / output collectives run (docs/async_cp.md).

``kv_chunks`` (optional YAML parameter of the Colossal Target, default
:data:`.async_handoff.DEFAULT_KV_CHUNKS` = 4): the K/V AllGathers are split in G sequence chunks
of the local K/V (G the largest divisor of the local length not above ``kv_chunks``; 1 = one
gather per tensor, no pipelining); the consumer attends chunk by chunk as they arrive and merges
the partial results by their log-sum-exp (exact up to fp rounding). The model adapters' Targets
take the same parameters (``q_chunks`` on Ulysses / Hybrid / Head-Tail, ``kv_chunks`` on Colossal).

Each works on an attention whose ``get_async_cp_handoffs()`` returns its four handoff modules
(:mod:`.async_handoff`); an attention without it is refused by name at preflight. The model
adapters (``hyper_parallel.models.<model_type>.adapter.distributed.context_parallel_async``) give
the HF attentions of Llama, Qwen2, Qwen3, Mistral and Qwen3-MoE the protocol and register their
own named Targets; ``model_adapter`` below lists those architectures (the planner requires an
async wrapper to name the models it is written for). A new model: implement the protocol and
register a thin ``@inner_wrapper(is_async=True, model_adapter=...)`` that calls
:func:`.async_handoff.install_async` (docs/async_cp.md, worked example).
"""
from __future__ import annotations

from ..registry import inner_wrapper
from .async_handoff import check_kv_chunks, check_q_chunks, install_async, validate_async

__all__ = ["async_colossal_cp_wrapper", "async_ulysses_cp_wrapper", "async_hybrid_cp_wrapper",
           "async_load_balance_cp_wrapper", "HANDOFF_ADAPTERS"]

# architectures whose model adapter implements the handoff protocol (hyper_parallel/models/*/adapter)
HANDOFF_ADAPTERS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")
_PKG = "hyper_parallel.distributed.context_parallel.wrappers"


def _validator(method: str, who: str, degree: bool):
    if degree:
        def validate(target_module, *, cp_size, ulysses_degree, tp_size=1, probe=True, q_chunks=None):
            check_q_chunks(q_chunks, who)
            validate_async(target_module, method, who, cp_size=cp_size, tp_size=tp_size,
                           ulysses_degree=ulysses_degree, probe=probe)
    elif method == "colossal":
        def validate(target_module, *, cp_size, tp_size=1, probe=True, kv_chunks=None):
            check_kv_chunks(kv_chunks, who)
            validate_async(target_module, method, who, cp_size=cp_size, tp_size=tp_size, probe=probe)
    else:
        def validate(target_module, *, cp_size, tp_size=1, probe=True, q_chunks=None):
            check_q_chunks(q_chunks, who)
            validate_async(target_module, method, who, cp_size=cp_size, tp_size=tp_size, probe=probe)
    validate.__qualname__ = f"validate[{who}]"
    return validate


def _public(fn):
    fn.__module__ = _PKG
    return fn


@inner_wrapper(method="colossal", style="model", is_async=True, model_adapter=HANDOFF_ADAPTERS,
               validate=_validator("colossal", "async_colossal_cp_wrapper", False))
@_public
def async_colossal_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, kv_chunks=None):
    """Async Colossal: K and V AllGather launched at ``cp_k_handoff`` / ``cp_v_handoff`` (on the comm
    thread); Q stays local. The local K/V ``[B, Hk, L, D]`` travel in G = ``kv_chunks`` (default 4,
    reduced to a divisor of L; 1 = one gather per tensor, waited at ``cp_attn_wait``) sequence
    chunks of L/G rows, one AllGather each, launched ``K_0`` (K handoff), ``V_0, K_1, V_1, ...``
    (V handoff).

    Forward, in this order::

        launch K_0                      (cp_k_handoff)    \\ overlap v_proj and the whole
        launch V_0, K_1, V_1, ...       (cp_v_handoff)    / Q branch (q_proj, norm, RoPE)
        for c in 0..G-1:  wait K_c, V_c  (gathered [B, Hk, C*L/G, D], global rows j*L + c*L/G + t)
                          (out_c, lse_c) = engine(q local, K_c, V_c; sinks in chunk 0 only)
                          merge into the running (out, lse)       (overlaps chunks c+1.. in flight)

    Backward (autograd, reverse creation order): merge / attention backward of chunk G-1 (its
    K/V chunk re-gathered first: the gathered K/V are not kept between forward and backward; that
    read launches chunk G-2's regather, docs/async_cp.md), its
    wait nodes launch the dK/dV ReduceScatter of chunk G-1, then chunk G-2's attention backward
    (overlapping it), ... chunk 0; the Q branch backward (RoPE, norm, q_proj grad GEMM) while
    the last ReduceScatters travel; the launch nodes wait them at the V/K projection backward.
    (``tests/async_cp/test_async_colossal_pipelined.py`` checks this order on the trace.)"""
    return install_async("colossal", target_module, mesh, cp_mesh, "async_colossal_cp_wrapper",
                         kv_chunks=kv_chunks)


@inner_wrapper(method="ulysses", style="model", is_async=True, model_adapter=HANDOFF_ADAPTERS,
               validate=_validator("ulysses", "async_ulysses_cp_wrapper", False))
@_public
def async_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, q_chunks=None):
    """Async Pure Ulysses: K/V seq->head A2A launched at their handoffs; Q in G = ``q_chunks``
    (default 4, reduced to a divisor of the local length) sequence chunks, all launched at the Q
    handoff; per chunk: wait, attention on this rank's heads, launch its output head->seq A2A
    (overlapping the next chunks), outputs waited last. Backward: every wait node launches the
    inverse A2A (dO seq->head first, then dQ per chunk as its attention backward finishes, dK/dV),
    the launch nodes wait them (dQ before the Q branch's backward, dK/dV at the K/V projections).
    Every head layout the sync wrapper accepts (``Hq % Hk == 0``, ``Hq >= cp_size``): uneven
    query blocks and KV heads replicated when fewer than cp_size (the backward sums the copies'
    gradients), per :func:`..strategies.ulysses_layout.ulysses_head_layout`."""
    return install_async("ulysses", target_module, mesh, cp_mesh, "async_ulysses_cp_wrapper", q_chunks=q_chunks)


@inner_wrapper(method="hybrid", style="model", is_async=True, model_adapter=HANDOFF_ADAPTERS,
               validate=_validator("hybrid", "async_hybrid_cp_wrapper", True))
@_public
def async_hybrid_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, ulysses_degree, q_chunks=None):
    """Async Hybrid (full async, not half-async): K/V ulysses-group A2A chained into the
    colossal-group AllGather on the comm thread, Q ulysses A2A in ``q_chunks`` pipelined chunks
    with each chunk's output head->seq A2A launched after its attention (as async Ulysses, on the
    ulysses group); backward ReduceScatter(colossal) chained into the inverse A2A(ulysses), dO /
    dQ per chunk, and, before the first attention backward, the K/V chain once more (the gathered
    K/V are not kept between forward and backward, docs/async_cp.md). Head layouts as the sync
    Hybrid (``Hq >= ulysses_degree``; uneven / replicated KV on the ulysses sub-group, the
    colossal AllGather acting on each rank's KV-head shard unchanged)."""
    return install_async("hybrid", target_module, mesh, cp_mesh, "async_hybrid_cp_wrapper",
                         ulysses_degree=ulysses_degree, q_chunks=q_chunks)


@inner_wrapper(method="load_balance", style="model", is_async=True, model_adapter=HANDOFF_ADAPTERS,
               validate=_validator("load_balance", "async_load_balance_cp_wrapper", False))
@_public
def async_load_balance_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, q_chunks=None):
    """Async Colossal Head-Tail (batch policy 'load_balance'; rank r computes sub-chunks
    head = r and tail = 2C-1-r of the 2C-way split), the query side pipelined in G chunks
    (``q_chunks``, default 4, reduced to a divisor of S/2C): chunk c = rows ``[c*m, (c+1)*m)``
    (``m = S/(2C*G)``) of both branches.

    Forward, in this order::

        launch K AllGather  (cp_k_handoff)          \\ overlap the V projection and the
        launch V AllGather  (cp_v_handoff)          / whole Q branch (q_proj, norm, RoPE)
        launch Q dispatch of chunks 0..G-1 (cp_q_handoff: one sparse A2A per chunk, carrying the
                            chunk's rows of both branches, head then tail)
        wait K, V           (cp_attn_wait)
        for c in 0..G-1:    wait Q chunk c
                            head branch rows: engine(q_head_c, K[:r*S/2C + (c+1)m])    (first)
                            tail branch rows: engine(q_tail_c, K[:(2C-1-r)*S/2C + (c+1)m]) (second)
                            launch the combine of (o_head_c, o_tail_c)   (overlaps chunks c+1..)
        wait the G combines -> contiguous chunk r (feeds o_proj)

    (keys past a part's last query are dropped when causal.) Backward (autograd, reverse
    creation order): the combine wait nodes launch the dispatch of dO for every chunk (last
    chunk first) -> per chunk c = G-1..0: wait its dO, tail then head attention backward (the
    first one re-gathers K/V on the comm thread: the gathered K/V are not kept between forward and
    backward, docs/async_cp.md), launch
    the dQ combine of chunk c (overlapping chunk c-1's backward) -> after chunk 0: dK/dV
    ReduceScatter launched -> the Q launch nodes wait the dQ chunks -> Q branch backward (RoPE,
    norm, q_proj grad GEMM) while dK/dV are in flight -> V, then K launch nodes wait -> V/K
    projection backward. (``tests/async_cp/test_async_protocol.py`` and
    ``tests/async_cp/test_async_pipelined.py`` check this order on the trace.)
    """
    return install_async("load_balance", target_module, mesh, cp_mesh, "async_load_balance_cp_wrapper",
                         q_chunks=q_chunks)
