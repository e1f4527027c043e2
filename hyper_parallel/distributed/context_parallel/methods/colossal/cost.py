"""Colossal's cost per layer (cost_model.py): K/V AllGather in forward, dK/dV ReduceScatter in
backward, and the K/V regather in backward unless activation checkpointing re-runs the forward."""
from __future__ import annotations

from ...cost_model import CostModel, LayerShape


class ColossalCost(CostModel):
    def comm(self, x: LayerShape) -> dict:
        kv = 2 * (x.local * x.hk * x.d * x.elem) * (x.cp - 1)
        out = {"fwd K/V AllGather": kv, "bwd dK/dV ReduceScatter": kv}
        out.update(self.query_exchange(x))
        if not x.recomputed:      # only the local K/V are kept for backward, gathered again there
            out["bwd K/V regather"] = kv
        return out

    def query_exchange(self, x: LayerShape) -> dict:
        """Exchanges of the queries besides the K/V gather (none: they stay on their rank)."""
        return {}

    def kept_for_backward(self, x: LayerShape) -> float:
        return 2 * (x.S - x.S // x.cp) * x.hk * x.d * x.elem * x.B


COST = ColossalCost()
