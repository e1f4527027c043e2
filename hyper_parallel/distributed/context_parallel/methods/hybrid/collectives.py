"""Hybrid collectives: K/V all-to-all inside the Ulysses group chained into the AllGather across
the Colossal group (backward: ReduceScatter, then the inverse all-to-all)."""
from __future__ import annotations

import torch

from ..... import platform as P
from ...comm import check_dim, check_divisible, regather_saved_kv, resolve_group
from ..colossal.collectives import flex_cp_allgather, regather_allgather
from ..ulysses.collectives import check_exchange_heads, ulysses_seq_to_head

__all__ = ["hybrid_kv_allgather"]


def hybrid_kv_allgather(k: torch.Tensor, v: torch.Tensor, colossal_group, ulysses_group, *,
                        seq_dim: int = 2, head_dim: int = 1, heads=None, regather: bool = False):
    """Hybrid K/V layout transform: Ulysses A2A inside ``ulysses_group`` (size u), then AllGather
    across ``colossal_group`` (size C/u).

    ``[B, Hk, S/C, D]`` -> ``[B, Hk/u, S*u/C, D]`` (chunk colossal_idx of C/u, head slice
    ulysses_idx) -> ``[B, Hk/u, S, D]``. Backward (by composition): ReduceScatter over the
    colossal group, then the inverse A2A over the ulysses group. Requires Hk % u == 0, unless
    ``heads`` (the KV split of a :class:`~..ulysses.layout.UlyssesHeadLayout`, see
    :func:`ulysses_seq_to_head`) gives ulysses rank i the KV heads ``heads[i]`` (replicated where
    several ranks need one; backward sums the copies' gradients).
    ``regather=True``: returns ``(k_all, v_all, ctx)`` with ``ctx`` the :func:`regather_saved_kv`
    context for the attention that consumes ``k_all`` / ``v_all`` as they are (it then keeps the
    head-exchanged shards and gathers them again over the colossal group in backward).
    """
    ug = resolve_group(ulysses_group)
    if heads is None:
        for name, t in (("k", k), ("v", v)):       # check both before the first collective
            hd = check_dim(t, head_dim, name, "hybrid_kv_allgather")
            check_divisible(t, hd, P.group_size(ug), name, "head", ug, "hybrid_kv_allgather")
    else:
        for name, t in (("k", k), ("v", v)):
            hd = check_dim(t, head_dim, name, "hybrid_kv_allgather")
            check_exchange_heads(heads, P.group_size(ug), t.shape[hd], "hybrid_kv_allgather", ug, cover=False)
    k_h = ulysses_seq_to_head(k, ulysses_group, seq_dim=seq_dim, head_dim=head_dim, tag="cp.ulysses_s2h_k",
                              heads=heads)
    v_h = ulysses_seq_to_head(v, ulysses_group, seq_dim=seq_dim, head_dim=head_dim, tag="cp.ulysses_s2h_v",
                              heads=heads)
    k_all, v_all = flex_cp_allgather(k_h, v_h, seq_dim, colossal_group)
    if not regather:
        return k_all, v_all
    return k_all, v_all, regather_saved_kv((k_h, v_h), (k_all, v_all), regather_allgather(seq_dim, colossal_group))
