"""Head-Tail async comm plans: ``(forward_comm, backward_comm)`` pairs for
:class:`~...async_collectives.AsyncCollective`, run on the comm thread (docs/async_cp.md)."""
from __future__ import annotations

import torch

from ...async_collectives import comm_chain


def head_tail_q_plan(group) -> tuple:
    """Q ``[B, Hq, L, D]`` (sub-chunks 2r, 2r+1) -> Head-Tail dispatch -> ``cat(q_head, q_tail)``
    along the sequence (sub-chunks r and 2C-1-r, ``[B, Hq, L, D]``); bwd: the combine exchange
    (the inverse permutation) of ``(dq_head, dq_tail)``."""
    from .collectives import head_tail_combine, head_tail_dispatch

    return (comm_chain([lambda y: torch.cat(head_tail_dispatch(y, group), dim=2)], "async_head_tail_dispatch"),
            comm_chain([lambda g: head_tail_combine(*g.chunk(2, dim=2), group)], "async_head_tail_dispatch_bwd"))


def head_tail_out_plan(group) -> tuple:
    """Head-Tail output ``cat(o_head, o_tail)`` along the sequence (rows of sub-chunks r and
    2C-1-r, ``[B, Hq, 2m, D]``) -> the combine exchange -> ``cat(o_lo, o_hi)`` (the same rows of
    this rank's sub-chunks 2r, 2r+1); bwd: the dispatch exchange of the gradient. The inverse of
    :func:`head_tail_q_plan` (forward and backward swapped), used per pipelined query chunk."""
    from .collectives import head_tail_combine, head_tail_dispatch

    return (comm_chain([lambda y: head_tail_combine(*y.chunk(2, dim=2), group)], "async_head_tail_combine"),
            comm_chain([lambda g: torch.cat(head_tail_dispatch(g, group), dim=2)], "async_head_tail_combine_bwd"))


def async_plan(method: str, strategy_cls, mesh, cp_mesh, ulysses_degree=None):
    """Head-Tail: the K/V AllGather plus the query dispatch and the output combine."""
    from ...async_plan import AsyncPlan, group_of
    from ..colossal.async_ import colossal_kv_plan

    group = group_of(cp_mesh)
    kv = colossal_kv_plan(group)
    return AsyncPlan(method, {"k": kv, "v": kv, "q": head_tail_q_plan(group), "out": head_tail_out_plan(group)},
                     strategy_cls(group), group=group)
