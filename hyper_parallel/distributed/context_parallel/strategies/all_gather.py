"""Colossal CP (AllGather): Q stays local, K/V are gathered over the whole CP group.

Layout (C ranks, rank r):
  q   [B, Hq, S/C, D]  chunk r (global indices r*S/C + arange(S/C))  -- never moves
  k/v [B, Hk, S/C, D]  --AllGather(cp group)-->  [B, Hk, S, D]
  out = engine(q, K, V, q_pos=meta.q_index, k_pos=0..S-1, docs from meta)  [B, Hq, S/C, D]
Backward: dQ local; dK/dV ReduceScatter(sum) back to chunk r. Any Hq/Hk with Hq % Hk == 0
(GQA/MQA) works; no head needs to be divisible by C.
"""
from __future__ import annotations

import torch

from ..collectives import flex_cp_allgather
from ..meta import CPBatchMeta
from .base import CPGroupStrategy, check_sinks, engine_attention


class AllGatherStrategy(CPGroupStrategy):
    """Sync Colossal CP on ``cp_group`` (1-D DeviceMesh, ProcessGroup, or None = cp 1)."""

    name = "all_gather"
    method = "colossal"

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: CPBatchMeta,
                  scale: float | None = None, window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B,Hq,S/C,D], k/v [B,Hk,S/C,D] local chunk -> out [B,Hq,S/C,D] local chunk."""
        self.check_inputs(q, k, v, meta, cp_size=self.cp_size, cp_rank=self.cp_rank)
        check_sinks(type(self).__name__, sinks, q.shape[1])
        k_all, v_all = flex_cp_allgather(k, v, 2, self.group)
        return engine_attention(q, k_all, v_all, q_pos=meta.q_index, k_pos=meta.k_index, meta=meta,
                                scale=scale, window=window, softcap=softcap, sinks=sinks)
