"""Pure Ulysses CP: sequence shard <-> head shard all-to-all on the whole CP group.

Layout (C ranks, rank r, ulysses_degree == C; heads from :func:`.layout.ulysses_head_layout`):
  q [B, Hq, S/C, D] chunk r  --A2A(cp group)-->  [B, nq_r, S, D]  query heads q_ranges[r]
  k/v [B, Hk, S/C, D] chunk r --A2A(cp group)--> [B, nk_r, S, D]  the KV heads those query heads use
  out_h = engine(q_h, k_h, v_h, q_pos = k_pos = 0..S-1, docs from meta)  [B, nq_r, S, D]
  out_h --A2A(cp group)-->  out [B, Hq, S/C, D] chunk r
Even heads (Hk % C == 0) give nq_r = Hq/C, nk_r = Hk/C (plain all_to_all). Otherwise the split is
uneven (counts differ by at most one) and/or KV heads are replicated to every rank whose query
heads use them (Hk < C, MQA): one uneven all_to_all per tensor. Backward: the inverse A2A of every
transform; the gradients of a replicated KV head's copies are summed into it.
Constraints: Hq % Hk == 0 and Hq >= C (each rank computes at least one query head).
"""
from __future__ import annotations

import contextlib

import torch

from .....platform import group_size
from ...meta import CPBatchMeta
from ..base import CPGroupStrategy, check_sinks, engine_attention
from .collectives import ulysses_head_to_seq, ulysses_seq_to_head
from .layout import UlyssesHeadLayout, ulysses_head_layout


def check_head_split(who: str, num_q_heads: int, num_kv_heads: int, degree: int, what: str,
                     cp_size: int | None = None) -> UlyssesHeadLayout:
    """The head layout of a Ulysses degree (see :func:`.layout.ulysses_head_layout`).

    Raises ValueError naming the numbers and the degrees that work when no exact split exists
    (``Hq % Hk != 0``, or fewer query heads than ``degree``). Every other layout — uneven counts,
    KV heads fewer than the degree (replicated), MQA — is accepted and returned.
    """
    return ulysses_head_layout(num_q_heads, num_kv_heads, degree, who=who, what=what, cp_size=cp_size)


def ulysses_group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, rank: int, *,
                            kv_fn, q_pos: torch.Tensor, k_pos: torch.Tensor, meta: CPBatchMeta,
                            sinks=None, **engine_kw) -> torch.Tensor:
    """The Ulysses part every sync Ulysses path shares (Pure Ulysses, Hybrid's sub-group).

    q ``[B, Hq, L, D]`` / k, v ``[B, Hk, L, D]`` local chunk; ``group`` the Ulysses group (rank
    ``rank`` in it). ``kv_fn(k, v, heads)`` moves K/V to the head layout (``heads`` =
    ``layout.kv_heads`` or None for the even split) and returns ``(k, v)`` or ``(k, v, ctx)``, ``ctx``
    a context manager entered around the engine call (Hybrid: the regather of its gathered K/V). Query heads go seq->head with the layout,
    the engine runs at ``q_pos``/``k_pos`` with this rank's sinks, and the output goes head->seq.
    """
    lay = ulysses_head_layout(q.shape[1], k.shape[1], group_size(group))
    heads_q = None if lay.even else lay.q_heads
    q_h = ulysses_seq_to_head(q, group, tag="cp.ulysses_s2h_q", heads=heads_q)
    kv = kv_fn(k, v, None if lay.even else lay.kv_heads)
    # the engine reads the received KV heads in place with this rank's query-head -> KV-head map
    # (kv_map_args: non-empty when the query heads start or end inside a KV group)
    with kv[2] if len(kv) > 2 else contextlib.nullcontext():
        out_h = engine_attention(q_h, kv[0], kv[1], q_pos=q_pos, k_pos=k_pos, meta=meta,
                                 sinks=lay.q_slice(sinks, rank), **lay.kv_map_args(rank), **engine_kw)
    return ulysses_head_to_seq(out_h, group, tag="cp.ulysses_h2s_out", heads=heads_q)


class UlyssesStrategy(CPGroupStrategy):
    """Sync Pure Ulysses CP on ``cp_group``: ulysses_degree is the CP size."""

    name = "ulysses"
    method = "ulysses"

    @property
    def ulysses_degree(self) -> int:
        return self.cp_size

    def head_layout(self, num_q_heads: int, num_kv_heads: int) -> UlyssesHeadLayout:
        """Per-rank query / KV heads of this group for these (TP-local) heads (raises like :meth:`validate`)."""
        return check_head_split(type(self).__name__, num_q_heads, num_kv_heads, self.cp_size,
                                "cp_size (ulysses_degree)")

    def validate(self, *, num_q_heads: int, num_kv_heads: int, cp_size: int) -> None:
        """Raise ValueError unless pure Ulysses fits these heads on this group.

        ``num_q_heads`` / ``num_kv_heads`` are the heads this rank computes (TP-local);
        ``cp_size`` must equal the strategy's CP group size (the Ulysses degree). Needs
        ``Hq % Hk == 0`` and ``Hq >= cp_size``; uneven counts and KV heads fewer than
        ``cp_size`` are split by :func:`.layout.ulysses_head_layout`. Local check only.
        """
        self.check_cp_size(cp_size, num_q_heads, num_kv_heads)
        self.head_layout(num_q_heads, num_kv_heads)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: CPBatchMeta,
                  scale: float | None = None, window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B,Hq,S/C,D], k/v [B,Hk,S/C,D] local chunk -> out [B,Hq,S/C,D] local chunk."""
        self.check_inputs(q, k, v, meta, cp_size=self.cp_size, cp_rank=self.cp_rank)
        check_sinks(type(self).__name__, sinks, q.shape[1])
        g = self.group

        def kv_fn(k, v, heads):
            return (ulysses_seq_to_head(k, g, tag="cp.ulysses_s2h_k", heads=heads),
                    ulysses_seq_to_head(v, g, tag="cp.ulysses_s2h_v", heads=heads))

        idx = meta.k_index
        return ulysses_group_attention(q, k, v, g, self.cp_rank, kv_fn=kv_fn, q_pos=idx, k_pos=idx, meta=meta,
                                       sinks=sinks, scale=scale, window=window, softcap=softcap)
