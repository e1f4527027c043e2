"""Pure Ulysses CP: sequence shard <-> head shard all-to-all on the whole CP group.

Layout (C ranks, rank r, ulysses_degree == C):
  q/k/v [B, H, S/C, D] chunk r  --A2A(cp group)-->  [B, H/C, S, D] heads [r*H/C, (r+1)*H/C)
  out_h = engine(q_h, k_h, v_h, q_pos = k_pos = 0..S-1, docs from meta)  [B, Hq/C, S, D]
  out_h --A2A(cp group)-->  out [B, Hq, S/C, D] chunk r
Backward: the inverse A2A of every transform (dO seq->head, dQ/dK/dV head->seq).
Constraints: Hq % C == 0 and Hk % C == 0; GQA with Hk < C is rejected (KV heads are never
silently repeated — use Colossal or Hybrid with a smaller degree).
"""
from __future__ import annotations

import torch

from ..collectives import ulysses_head_to_seq, ulysses_seq_to_head
from ..meta import CPBatchMeta
from .base import CPGroupStrategy, check_gqa, check_sinks, engine_attention, head_slice_sinks


def check_head_split(who: str, num_q_heads: int, num_kv_heads: int, degree: int, what: str) -> None:
    """Heads must split evenly over the Ulysses degree; fewer KV heads than the degree is rejected."""
    check_gqa(who, num_q_heads, num_kv_heads)
    if num_kv_heads < degree:
        raise ValueError(
            f"{who}: num_kv_heads={num_kv_heads} < {what}={degree} (num_q_heads={num_q_heads}): GQA/MQA "
            "KV heads are not repeated across Ulysses ranks; use the colossal (AllGather) method or a "
            "smaller ulysses_degree"
        )
    bad = [f"{n}={h}" for n, h in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)) if h % degree]
    if bad:
        raise ValueError(f"{who}: {' and '.join(bad)} not divisible by {what}={degree} "
                         f"(num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads})")


class UlyssesStrategy(CPGroupStrategy):
    """Sync Pure Ulysses CP on ``cp_group``: ulysses_degree is the CP size."""

    name = "ulysses"
    method = "ulysses"

    @property
    def ulysses_degree(self) -> int:
        return self.cp_size

    def validate(self, *, num_q_heads: int, num_kv_heads: int, cp_size: int) -> None:
        """Raise ValueError unless pure Ulysses fits these heads on this group.

        ``num_q_heads`` / ``num_kv_heads`` are the heads this rank computes (TP-local);
        ``cp_size`` must equal the strategy's CP group size (the Ulysses degree). Needs
        ``Hq % Hk == 0``, ``Hk >= cp_size`` and both divisible by ``cp_size`` (KV heads are never
        repeated). Local check only: no collective.
        """
        who = type(self).__name__
        self.check_cp_size(cp_size, num_q_heads, num_kv_heads)
        check_head_split(who, num_q_heads, num_kv_heads, cp_size, "cp_size (ulysses_degree)")

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: CPBatchMeta,
                  scale: float | None = None, window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [B,Hq,S/C,D], k/v [B,Hk,S/C,D] local chunk -> out [B,Hq,S/C,D] local chunk."""
        self.check_inputs(q, k, v, meta, cp_size=self.cp_size, cp_rank=self.cp_rank)
        check_sinks(type(self).__name__, sinks, q.shape[1])
        sinks_h = head_slice_sinks(sinks, q.shape[1], self.cp_size, self.cp_rank)   # this rank's heads
        g = self.group
        q_h = ulysses_seq_to_head(q, g, tag="cp.ulysses_s2h_q")
        k_h = ulysses_seq_to_head(k, g, tag="cp.ulysses_s2h_k")
        v_h = ulysses_seq_to_head(v, g, tag="cp.ulysses_s2h_v")
        idx = meta.k_index
        out_h = engine_attention(q_h, k_h, v_h, q_pos=idx, k_pos=idx, meta=meta, scale=scale, window=window,
                                 softcap=softcap, sinks=sinks_h)
        return ulysses_head_to_seq(out_h, g, tag="cp.ulysses_h2s_out")
