"""Colossal CP on the balanced split of a packed row (sync; docs/strategies/load_balance_packed.md).

The batch (policy ``balanced``) is the row permuted at block granularity so every rank's attention
work, summed over the model's layers, is the same (:mod:`..balance`); rank r holds slots
``[r*L, (r+1)*L)`` of the permuted row, i.e. global tokens ``meta.q_index = perm[r*L:(r+1)*L]``.

  q   [B, Hq, L, D]  this rank's permuted slots, never moves
  k/v [B, Hk, L, D]  --AllGather(cp)-->  [B, Hk, S, D] in permuted (rank) order
  out = engine(q, K, V, q_pos=perm[r*L:(r+1)*L], k_pos=perm, docs of those global indices)

The engine takes positions in any order and skips tiles by position and document, so a
permuted set of global positions is exact (causal, window, chunk and documents on global
indices); RoPE runs on the global positions of the local tokens. Backward: dQ local, dK/dV
ReduceScatter(sum) to their owners; like Colossal, the gathered K/V are regathered for backward
unless ``keep_gathered_kv``. Any GQA ratio; no head divisibility.
"""
from __future__ import annotations

import contextlib

import torch

from ...comm import regather_saved_kv
from ..colossal.collectives import flex_cp_allgather, regather_allgather
from ...meta import CPBatchMeta
from ..base import CPGroupStrategy, check_sinks, engine_attention
from ..hybrid.strategy import HybridStrategy


class BalancedStrategy(CPGroupStrategy):
    """Sync Colossal CP over the balanced permutation ``meta.perm`` on ``cp_group``."""

    name = "balanced"
    method = "balanced"
    accepts_permuted = True
    #: True: the attention keeps the gathered K/V for backward (no regather, more memory per rank)
    keep_gathered_kv = False

    def padding_multiple(self, cp_size: int) -> int:
        from ...balance.split import DEFAULT_BLOCK

        return DEFAULT_BLOCK * cp_size

    def check_permuted(self, meta: CPBatchMeta) -> None:
        """Raise ValueError unless the batch carries the balanced permutation (local check only)."""
        if meta.perm is None and meta.cp_size > 1:
            raise ValueError(
                f"{type(self).__name__}: the CP batch carries no balanced permutation (meta.perm is None, batch "
                f"policy {meta.policy!r}); shard the batch with policy='balanced' (the plan's batch_policy)")

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: CPBatchMeta,
                  scale: float | None = None, window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B,Hq,L,D], k/v [B,Hk,L,D] (permuted slots of rank r) -> out [B,Hq,L,D], same slots."""
        self.check_permuted(meta)
        self.check_inputs(q, k, v, meta, cp_size=self.cp_size, cp_rank=self.cp_rank)
        check_sinks(type(self).__name__, sinks, q.shape[1])
        k_all, v_all = flex_cp_allgather(k, v, 2, self.group)
        run = regather_allgather(2, self.group)
        with contextlib.nullcontext() if self.keep_gathered_kv else regather_saved_kv((k, v), (k_all, v_all), run):
            return engine_attention(q, k_all, v_all, q_pos=meta.q_index, k_pos=meta.k_index, meta=meta,
                                    scale=scale, window=window, softcap=softcap, sinks=sinks)


class BalancedHybridStrategy(HybridStrategy):
    """Sync Hybrid CP (Ulysses inside each u-group, Colossal across them) on the balanced split.

    Rank r = c*u + i holds slots ``[r*L, (r+1)*L)`` of the permuted row; the seq->head A2A gives its
    head slice the u-group's slots ``[c*u*L, (c+1)*u*L)`` (queries at ``perm`` of those slots) and the
    colossal AllGather every slot in rank order (keys at ``perm``), so any permutation is exact. The
    permutation balances the C ranks' work, hence each u-group's sum (what its u ranks split by head).
    Constraints and backward: :class:`..hybrid.strategy.HybridStrategy`.
    """

    name = "balanced"               # the batch policy
    method = "hybrid_balanced"
    accepts_permuted = True

    padding_multiple = BalancedStrategy.padding_multiple
    check_permuted = BalancedStrategy.check_permuted

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: CPBatchMeta,
                  scale: float | None = None, window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B,Hq,L,D], k/v [B,Hk,L,D] (permuted slots of rank r) -> out [B,Hq,L,D], same slots."""
        self.check_permuted(meta)
        return super().attention(q, k, v, meta=meta, scale=scale, window=window, softcap=softcap, sinks=sinks)
