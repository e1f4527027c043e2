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
    return AsyncPlan(method, {"k": kv, "v": kv}, strategy_cls(group), group=group)
