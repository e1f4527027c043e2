"""Colossal async comm plans: ``(forward_comm, backward_comm)`` pairs for
:class:`~...async_collectives.AsyncCollective`, run on the comm thread (docs/async_cp.md)."""
from __future__ import annotations

from ...async_collectives import comm_chain


def colossal_kv_plan(group, seq_dim: int = 2) -> tuple:
    """K or V ``[B, Hk, L, D]`` -> AllGather on ``group`` -> ``[B, Hk, S, D]``; bwd: ReduceScatter(sum)."""
    from .....platform import reduce_scatter
    from ...comm import all_gather_seq

    return (comm_chain([lambda y: all_gather_seq(y, group, dim=seq_dim, tag="async_kv_gather")], "async_kv_gather"),
            comm_chain([lambda g: reduce_scatter(g, group, dim=seq_dim, tag="async_kv_reduce_scatter")],
                   "async_kv_reduce_scatter"))


def async_plan(method: str, strategy_cls, mesh, cp_mesh, ulysses_degree=None):
    """Colossal (and the balanced split, the same gathers of the permuted row's slots): K/V AllGather."""
    from ...async_plan import AsyncPlan, group_of

    group = group_of(cp_mesh)
    kv = colossal_kv_plan(group)
    return AsyncPlan(method, {"k": kv, "v": kv}, strategy_cls(group), group=group, attend=colossal_attend,
                     kv_chunked=True)


def colossal_attend(plan, c, q, k, v, meta, sinks, kw: dict, keep: bool):
    """The attention after the wait: K/V waited whole at ``cp_attn_wait`` (G = 1), or the G gathered
    chunks pipelined through the attention (:func:`colossal_pipelined`). Local queries at
    ``meta.q_index``, keys at ``meta.k_index`` (the balanced split: its permutation)."""
    from ..base import engine_attention

    if not c.kv_parts:         # G = 1: K/V waited whole at cp_attn_wait
        with c.regather("k", "v", (k, v), keep):
            return engine_attention(q, k, v, q_pos=meta.q_index, k_pos=meta.k_index, sinks=sinks, **kw)
    return colossal_pipelined(c, plan, q, meta, sinks, kw, keep)


def colossal_pipelined(c, plan, q, meta, sinks, kw: dict, keep: bool):
    """Colossal consumer over the G gathered K/V chunks: per chunk c, wait K_c and V_c, the engine
    with ``return_lse`` (local queries at ``meta.q_index``; keys at chunk c's global positions
    ``k_index[j*L + c*L/G + t]``, i.e. ``j*L + c*L/G + t`` or, balanced split, ``perm`` of those
    slots; sinks in chunk 0 only, so they count once) and the LSE merge into the running result
    (kept in fp32 or wider; rows seeing no key of a chunk: out 0, lse -inf). Returns
    ``[B, Hq, L, Dv]`` in q's dtype. Differentiable: backward runs the chunks' attention backwards
    last chunk first, each chunk's wait nodes launching its dK/dV ReduceScatter."""
    import torch

    from .....ops.merge import merge_partial_attention
    from ...async_plan import chunk_name, trace_kv_chunk
    from ..base import engine_attention

    ks, vs = c.kv_parts["k"], c.kv_parts["v"]
    g, C = len(ks), plan.checker.cp_size
    k_pos = meta.k_index.view(C, g, -1)          # rank-major: rank j's rows of chunk ci
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    out = lse = None
    for ci, ((ck, tk), (cv, tv)) in enumerate(zip(ks, vs)):
        k_c, v_c = ck.wait(tk), cv.wait(tv)      # [B, Hk, C*L/G, D]
        trace_kv_chunk(k_c, v_c, ci)
        # backward reads the chunks last first; reading chunk ci's pair starts chunk ci-1's regather
        with c.regather(chunk_name("k", ci), chunk_name("v", ci), (k_c, v_c), keep):
            o, l = engine_attention(q, k_c, v_c, q_pos=meta.q_index, k_pos=k_pos[:, ci].reshape(-1),
                                    sinks=sinks if ci == 0 else None, return_lse=True, **kw)
        if out is None:
            out, lse = o.to(acc_dtype), l
        else:
            out, lse = merge_partial_attention(out, lse, o, l)
    return out.to(q.dtype)
