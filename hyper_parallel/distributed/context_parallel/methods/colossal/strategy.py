"""Colossal CP (AllGather): Q stays local, K/V are gathered over the CP group.

Layout (C ranks, rank r, L = S/C):
  q   [B, Hq, L, D]  chunk r (global indices r*L + arange(L))  -- never moves
  k/v [B, Hk, L, D]  --AllGather(cp group)-->  [B, Hk, S, D]
  out = engine(q, K, V, q_pos=meta.q_index, k_pos=0..S-1, docs from meta)  [B, Hq, L, D]
Backward: dQ local; dK/dV ReduceScatter(sum) back to chunk r. Any Hq/Hk with Hq % Hk == 0
(GQA/MQA) works; no head needs to be divisible by C.

Memory: the attention does not keep the gathered K/V for backward; it keeps the local shards
and backward gathers them again (:func:`~...comm.regather_saved_kv`, one more exchange
per layer), so what a rank holds between forward and backward falls as 1/C like everything
else (``2 * Hk * D * S/C`` elements per layer per rank instead of ``2 * Hk * D * S``).
Under activation checkpointing the checkpoint already drops them and this is not applied.
``AllGatherStrategy.keep_gathered_kv = True`` keeps them instead (no second exchange).

Sliding window ``w``: a query of chunk r sees keys no earlier than ``r*L - w + 1``, i.e. at
most ``n = ceil((w-1)/L)`` previous chunks. When ``n < C-1`` (the same on every rank: it
depends only on L and w) rank r receives only chunks ``max(0, r-n) .. r`` (``.. C-1`` when
not causal) through :func:`~.collectives.flex_cp_window_gather` (one uneven all_to_all per
tensor; backward returns each chunk's dK/dV to its owner, summed), and the engine gets those
keys with their global positions ``k_pos`` and doc ids — the same visible set, so the same
math as the full gather. ``w = 1`` moves nothing. ``n >= C-1`` or no window: the AllGather.
"""
from __future__ import annotations

import contextlib
from numbers import Integral

import torch

from ...comm import regather_saved_kv
from ...meta import CPBatchMeta
from ..base import CPGroupStrategy, check_sinks, engine_attention
from .collectives import (flex_cp_allgather, flex_cp_window_gather, regather_allgather, regather_window_gather,
                          window_chunk_ranges)


def window_kv_ranges(cp_size: int, local_seq_len: int, window: int | None,
                     causal: bool) -> list[tuple[int, int]] | None:
    """Per-rank inclusive chunk ranges for the trimmed K/V exchange, or None for the AllGather.

    None when there is no window or the window reaches back ``C-1`` chunks or more (the last
    rank needs every chunk: the AllGather moves no more than the trimmed exchange).
    Depends only on values every rank shares, so all ranks pick the same collective.
    """
    if window is None or cp_size == 1:
        return None
    if isinstance(window, bool) or not isinstance(window, Integral) or window < 1:
        raise ValueError(f"AllGatherStrategy: window must be an int >= 1 or None (the model's "
                         f"sliding_window), got {window!r}")
    ranges = window_chunk_ranges(cp_size, local_seq_len, int(window), causal)
    if ranges[-1][0] == 0:
        return None
    return ranges


class AllGatherStrategy(CPGroupStrategy):
    """Sync Colossal CP on ``cp_group`` (1-D DeviceMesh, ProcessGroup, or None = cp 1)."""

    name = "all_gather"
    method = "colossal"
    #: True: the attention keeps the gathered K/V for backward (no regather, more memory per rank)
    keep_gathered_kv = False

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: CPBatchMeta,
                  scale: float | None = None, window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B,Hq,L,D], k/v [B,Hk,L,D] local chunk -> out [B,Hq,L,D] local chunk.

        With a window that reaches back fewer than C-1 chunks, only the visible chunks move
        (see the module docstring); otherwise K/V are all-gathered.
        """
        self.check_inputs(q, k, v, meta, cp_size=self.cp_size, cp_rank=self.cp_rank)
        check_sinks(type(self).__name__, sinks, q.shape[1])
        ranges = window_kv_ranges(self.cp_size, meta.local_seq_len, window, meta.causal)
        if ranges is not None and meta.causal and meta.key_block is not None:
            # a block (image) of this rank's queries continuing on later ranks: those chunks are visible
            L = meta.local_seq_len
            ranges = [(lo, max(hi, (meta.block_reach(r * L, (r + 1) * L) - 1) // L)) for r, (lo, hi) in enumerate(ranges)]
        if ranges is None:
            k_all, v_all = flex_cp_allgather(k, v, 2, self.group)
            k_pos = meta.k_index
            run = regather_allgather(2, self.group)
        else:
            lo, hi = ranges[self.cp_rank]
            k_all, v_all = flex_cp_window_gather(k, v, 2, self.group, ranges)
            k_pos = meta.k_index[lo * meta.local_seq_len:(hi + 1) * meta.local_seq_len]
            run = regather_window_gather(2, self.group, ranges)
        with contextlib.nullcontext() if self.keep_gathered_kv else regather_saved_kv((k, v), (k_all, v_all), run):
            return engine_attention(q, k_all, v_all, q_pos=meta.q_index, k_pos=k_pos, meta=meta,
                                    scale=scale, window=window, softcap=softcap, sinks=sinks)
