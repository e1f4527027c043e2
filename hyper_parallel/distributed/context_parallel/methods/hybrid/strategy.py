"""Hybrid CP: Ulysses A2A inside the ulysses subgroup, K/V AllGather across the colossal subgroup.

Groups come from ``MeshContext.hybrid_groups(u)`` (cached at set-up): cp rank
r = colossal_idx * u + ulysses_idx, the ulysses subgroup is {c*u + i : i < u} and the
colossal subgroup is {c'*u + ulysses_idx : c' < C/u}.

Layout (C ranks, degree u, rank r = c*u + i):
  q/k/v [B, H, S/C, D] chunk r  --A2A(ulysses)-->  [B, H/u, S*u/C, D]
        = chunk c of the C/u-way split, head slice i
  k/v --AllGather(colossal)--> [B, Hk/u, S, D]
  out_h = engine(q_h, K, V, q_pos = c*S*u/C + arange(S*u/C), k_pos = 0..S-1)  [B, Hq/u, S*u/C, D]
        (positions are ``meta.k_index`` of those slots: on the balanced split, ``meta.perm``)
  out_h --A2A(ulysses)--> out [B, Hq, S/C, D] chunk r
Backward: the K/V AllGather(colossal) again (the attention keeps the head-exchanged shards
``[B, Hk/u, S*u/C, D]``, not the gathered K/V: :func:`~...comm.regather_saved_kv`; uneven
splits too, since the CPU engine reads the gathered KV heads in place through its head map — on
CUDA / NPU a rank with a head map saves its per-query-head copy instead, the same on every rank of
its colossal group), then
ReduceScatter(colossal) of dK/dV, then the inverse A2A(ulysses) of dQ/dK/dV; dO takes the seq->head
A2A. Heads over the ulysses sub-group follow
:func:`..ulysses.layout.ulysses_head_layout` (the layout of Pure Ulysses with degree u): H/u above
is the even case; otherwise query counts differ by at most one and KV heads are replicated to
each ulysses rank whose query heads use them (gradients of the copies summed in backward).
Constraints: 1 < u < C, C % u == 0, Hq % Hk == 0, Hq >= u.
"""
from __future__ import annotations

import torch

from .....platform import group_rank, group_size
from ...comm import group_desc, resolve_group
from ...meta import CPBatchMeta
from ..base import ContextParallelStrategy, check_sinks
from ..ulysses.layout import UlyssesHeadLayout
from ..ulysses.strategy import check_head_split, ulysses_group_attention
from .collectives import hybrid_kv_allgather


class HybridStrategy(ContextParallelStrategy):
    """Sync Hybrid CP on ``(colossal_group, ulysses_group)`` (1-D meshes or cached groups)."""

    name = "hybrid"
    method = "hybrid"

    def __init__(self, colossal_group, ulysses_group):
        self.colossal_group = resolve_group(colossal_group)
        self.ulysses_group = resolve_group(ulysses_group)
        u, c = group_size(self.ulysses_group), group_size(self.colossal_group)
        if u < 2 or c < 2:
            raise ValueError(
                f"HybridStrategy needs 1 < ulysses_degree < cp_size: ulysses {group_desc(self.ulysses_group)}, "
                f"colossal {group_desc(self.colossal_group)} give ulysses_degree={u}, cp_size={u * c} "
                "(use UlyssesStrategy for ulysses_degree == cp_size, AllGatherStrategy for 1)"
            )

    @property
    def ulysses_degree(self) -> int:
        return group_size(self.ulysses_group)

    @property
    def colossal_degree(self) -> int:
        return group_size(self.colossal_group)

    @property
    def cp_size(self) -> int:
        return self.ulysses_degree * self.colossal_degree

    @property
    def cp_rank(self) -> int:
        return group_rank(self.colossal_group) * self.ulysses_degree + group_rank(self.ulysses_group)

    def validate(self, *, num_q_heads: int, num_kv_heads: int, cp_size: int) -> None:
        """Raise ValueError unless Hybrid fits these heads on its (colossal, ulysses) groups.

        ``num_q_heads`` / ``num_kv_heads`` are the heads this rank computes (TP-local);
        ``cp_size`` must equal colossal size x ulysses size, with ``1 < u < cp_size`` and
        ``cp_size % u == 0`` for ``u`` = the ulysses group size. Heads split over ``u`` by
        :func:`..ulysses.layout.ulysses_head_layout`: ``Hq % Hk == 0`` and ``Hq >= u`` (uneven
        counts and replicated KV heads are accepted). Local check only: no collective.
        """
        who, u = type(self).__name__, self.ulysses_degree
        if not 1 < u < cp_size or cp_size % u:
            raise ValueError(f"{who}: need 1 < ulysses_degree < cp_size and cp_size % ulysses_degree == 0, "
                             f"got ulysses_degree={u}, cp_size={cp_size}")
        if cp_size != self.cp_size:
            raise ValueError(f"{who}: cp_size={cp_size} but colossal({self.colossal_degree}) x "
                             f"ulysses({u}) = {self.cp_size}")
        self.head_layout(num_q_heads, num_kv_heads)

    def head_layout(self, num_q_heads: int, num_kv_heads: int) -> UlyssesHeadLayout:
        """Per-ulysses-rank query / KV heads for these (TP-local) heads (raises like :meth:`validate`)."""
        return check_head_split(type(self).__name__, num_q_heads, num_kv_heads, self.ulysses_degree,
                                "ulysses_degree", cp_size=self.cp_size)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: CPBatchMeta,
                  scale: float | None = None, window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B,Hq,S/C,D], k/v [B,Hk,S/C,D] local chunk -> out [B,Hq,S/C,D] local chunk."""
        self.check_inputs(q, k, v, meta, cp_size=self.cp_size, cp_rank=self.cp_rank)
        check_sinks(type(self).__name__, sinks, q.shape[1])
        u = self.ulysses_degree
        cg, ug = self.colossal_group, self.ulysses_group
        n = meta.local_seq_len * u
        start = group_rank(cg) * n
        q_pos = meta.k_index[start:start + n]       # the u-group's slots (their global indices under a permutation)
        return ulysses_group_attention(
            q, k, v, ug, group_rank(ug),
            kv_fn=lambda k, v, heads: hybrid_kv_allgather(k, v, cg, ug, heads=heads, regather=True),
            q_pos=q_pos, k_pos=meta.k_index, meta=meta, sinks=sinks, scale=scale, window=window, softcap=softcap)
