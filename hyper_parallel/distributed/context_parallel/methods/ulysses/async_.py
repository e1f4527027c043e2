"""Ulysses async comm plans: ``(forward_comm, backward_comm)`` pairs for
:class:`~...async_collectives.AsyncCollective`, run on the comm thread (docs/async_cp.md)."""
from __future__ import annotations

from ...async_collectives import comm_chain


def exchange_heads(lay, kind: str) -> tuple:
    """(``heads=`` of the forward seq->head exchange, ``num_heads=`` of its adjoint) for a tensor of
    ``kind`` ("q" or "kv") under the Ulysses head layout ``lay``: ``(None, None)`` for the even
    split (plain all_to_all); else ``lay.q_heads`` / ``lay.kv_heads``, the KV adjoint summing the
    copies of a replicated KV head into it (``num_heads=Hk``)."""
    if lay is None or lay.even:
        return None, None
    if kind == "q":
        return lay.q_heads, None
    return lay.kv_heads, lay.num_kv_heads


def ulysses_plan(group, lay=None, kind: str = "q") -> tuple:
    """``[B, H, L, D]`` -> seq->head A2A on ``group`` -> ``[B, n_i, u*L, D]``; bwd: the adjoint A2A.

    ``lay`` (:class:`.layout.UlyssesHeadLayout` of this group, None: even
    split) and ``kind`` ("q": query heads ``lay.q_heads``; "kv": KV heads ``lay.kv_heads``,
    replicated where several ranks' query heads use one) choose the heads rank ``i`` receives
    (``n_i``), exactly as the sync :func:`.strategy.ulysses_group_attention`. Backward:
    ``ulysses_head_to_seq`` with the same heads; for K/V with ``num_heads=Hk``, so the gradients of
    a replicated KV head's copies are summed into it on the rank owning the sequence chunk."""
    from .collectives import ulysses_head_to_seq, ulysses_seq_to_head

    heads, num = exchange_heads(lay, kind)
    return (comm_chain([lambda y: ulysses_seq_to_head(y, group, tag="async_seq_to_head", heads=heads)],
                   "async_seq_to_head"),
            comm_chain([lambda g: ulysses_head_to_seq(g, group, tag="async_head_to_seq", heads=heads, num_heads=num)],
                   "async_head_to_seq"))


def ulysses_out_plan(group, lay=None) -> tuple:
    """Attention output ``[B, n_i, u*L', D]`` (this rank's query heads ``lay.q_heads[i]``, the
    group's rows) -> head->seq A2A on ``group`` -> ``[B, Hq, L', D]`` (all query heads, this
    rank's rows); bwd: the seq->head A2A of dO with the same heads (the inverse permutation: the
    query split is disjoint). ``lay`` None / even: the plain all_to_all. The inverse of
    :func:`ulysses_plan` ``(group, lay, "q")`` — used per pipelined query chunk (``L' = L/G``)."""
    from .collectives import ulysses_head_to_seq, ulysses_seq_to_head

    heads, _num = exchange_heads(lay, "q")
    return (comm_chain([lambda y: ulysses_head_to_seq(y, group, tag="async_out_head_to_seq", heads=heads)],
                   "async_out_head_to_seq"),
            comm_chain([lambda g: ulysses_seq_to_head(g, group, tag="async_out_seq_to_head", heads=heads)],
                   "async_out_seq_to_head"))


def async_plan(method: str, strategy_cls, mesh, cp_mesh, ulysses_degree=None):
    """Ulysses: Q/K/V seq->head and the output head->seq All-to-All, per head layout."""
    from ...async_plan import AsyncPlan, group_of

    group = group_of(cp_mesh)

    def build(lay):
        kv = ulysses_plan(group, lay, "kv")
        return {"q": ulysses_plan(group, lay, "q"), "k": kv, "v": kv, "out": ulysses_out_plan(group, lay)}
    return AsyncPlan(method, None, strategy_cls(group), group, build=build, attend=head_split_attend)


def head_split_attend(plan, c, q, k, v, meta, sinks, kw: dict, keep: bool):
    """Ulysses and Hybrid after the wait: this rank's head slice over its (Ulysses group's) whole
    sequence, per query chunk (waited one by one), each chunk's output head->seq A2A launched after
    its attention, all waited last. Hybrid regathers its colossal-gathered K/V in backward."""
    import contextlib

    import torch

    from .....ops.attention import kv_map_in_place
    from .....platform import group_rank
    from ...async_plan import chunk_name, trace_chunk
    from ..base import engine_attention

    u = plan.ulysses_degree or plan.checker.cp_size
    i = group_rank(plan.out_group)
    lay = c.layout
    # this rank's query heads lay.q_ranges[i] and the KV heads they use (replicas, read in place
    # through the engine's head map) and the sinks of these query heads, as the sync
    # ulysses_group_attention
    kv_map = lay.kv_map_args(i)
    sinks_h = lay.q_slice(sinks, i)
    span = meta.local_seq_len * u
    start = (meta.cp_rank // u) * span
    q_pos = meta.k_index[start:start + span]     # the u-group's slots (Ulysses: all; balanced split: their perm)
    # chunk ci of the group: rows [ci*L/G, (ci+1)*L/G) of every group rank's chunk, rank-major
    q_pos = q_pos.view(u, len(c.q_parts), -1)
    # Hybrid: the colossal-gathered K/V are regathered in backward (Ulysses' head-exchanged K/V are
    # the size of the local ones: nothing to save); one exchange serves every query chunk. The
    # regather re-runs the ulysses A2A too, so every rank of the group must take part: the choice
    # depends only on values every rank shares. A backend that copies K/V per query head for a
    # head map (CUDA, NPU: kv_map_in_place False) saves that copy on the mapped ranks, which then
    # would not regather: there only layouts without a head map on any rank regather
    regather = u < plan.checker.cp_size and (
        kv_map_in_place(k.device) or not any(lay.kv_map_args(j) for j in range(u)))
    outs = []
    with c.regather("k", "v", (k, v), keep) if regather else contextlib.nullcontext():
        for ci, (coll, tok) in enumerate(c.q_parts):
            q_c = coll.wait(tok)                 # [B, n_i, u*L/G, D]
            trace_chunk(q_c, ci)
            out = engine_attention(q_c, k, v, q_pos=q_pos[:, ci].reshape(-1), k_pos=meta.k_index,
                                   sinks=sinks_h, **kv_map, **kw)
            outs.append(c.launch(chunk_name("out", ci), c.plans["out"], out))
    return torch.cat([oc.wait(t) for oc, t in outs], dim=2)    # [B, Hq, L, D]
