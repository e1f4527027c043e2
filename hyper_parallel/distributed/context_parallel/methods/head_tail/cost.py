"""Head-Tail's cost per layer (cost_model.py): Colossal's K/V exchanges plus the query dispatch
(Q/O All-to-All in forward, dO/dQ in backward)."""
from __future__ import annotations

from ...cost_model import LayerShape
from ..colossal.cost import ColossalCost


class HeadTailCost(ColossalCost):
    def query_exchange(self, x: LayerShape) -> dict:
        q = 2 * (x.local * x.hq * x.d * x.elem) * ((x.cp - 1) / x.cp)
        return {"fwd Q/O All-to-All": q, "bwd dO/dQ All-to-All": q}

    def kept_for_backward(self, x: LayerShape) -> float:
        return 0.0


COST = HeadTailCost()
