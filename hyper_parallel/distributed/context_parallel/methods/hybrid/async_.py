"""Hybrid async comm plans: ``(forward_comm, backward_comm)`` pairs for
:class:`~...async_collectives.AsyncCollective`, run on the comm thread (docs/async_cp.md)."""
from __future__ import annotations

from ...async_collectives import comm_chain
from ..ulysses.async_ import exchange_heads


def hybrid_kv_plan(colossal_group, ulysses_group, lay=None) -> tuple:
    """K or V: seq->head A2A on the ulysses group chained into AllGather on the colossal group
    (``[B, Hk, S/C, D]`` -> ``[B, nk_i, S, D]``, ``nk_i`` the KV heads of ``lay.kv_heads[i]``,
    replicated when fewer than the ulysses degree; ``Hk/u`` for the even split / ``lay`` None);
    bwd: ReduceScatter(colossal) on that ``nk_i``-head shard chained into the adjoint A2A(ulysses)
    (``num_heads=Hk``: copies of a replicated KV head summed). Both stages run on the comm thread."""
    from .....platform import reduce_scatter
    from ...comm import all_gather_seq
    from ..ulysses.collectives import ulysses_head_to_seq, ulysses_seq_to_head

    heads, num = exchange_heads(lay, "kv")
    fwd = comm_chain([lambda y: ulysses_seq_to_head(y, ulysses_group, tag="async_seq_to_head", heads=heads),
                  lambda y: all_gather_seq(y, colossal_group, dim=2, tag="async_kv_gather")], "hybrid_kv_chain")
    bwd = comm_chain([lambda g: reduce_scatter(g, colossal_group, dim=2, tag="async_kv_reduce_scatter"),
                  lambda g: ulysses_head_to_seq(g, ulysses_group, tag="async_head_to_seq", heads=heads,
                                                num_heads=num)], "hybrid_kv_chain_bwd")
    return fwd, bwd


def async_plan(method: str, strategy_cls, mesh, cp_mesh, ulysses_degree=None):
    """Hybrid (on the balanced split too: the same exchanges, permuted row): the K/V ulysses A2A
    chained into the colossal AllGather, Q / output ulysses A2A, per head layout."""
    from ...async_plan import AsyncPlan
    from ..ulysses.async_ import head_split_attend, ulysses_out_plan, ulysses_plan

    if mesh is None or not hasattr(mesh, "hybrid_groups"):
        raise ValueError("the async Hybrid wrapper needs the MeshContext (mesh) to find its cached sub-groups")
    cg, ug = mesh.hybrid_groups(ulysses_degree)

    def build(lay):
        kv = hybrid_kv_plan(cg, ug, lay)
        return {"k": kv, "v": kv, "q": ulysses_plan(ug, lay, "q"), "out": ulysses_out_plan(ug, lay)}
    return AsyncPlan(method, None, strategy_cls(cg, ug), ug, ulysses_degree, build=build, attend=head_split_attend)
