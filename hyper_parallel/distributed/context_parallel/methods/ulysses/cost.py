"""Pure Ulysses' cost per layer (cost_model.py): the Q/K/V/O All-to-All both ways."""
from __future__ import annotations

from ...cost_model import CostModel, LayerShape


class UlyssesCost(CostModel):
    def comm(self, x: LayerShape) -> dict:
        per = (2 * x.hq + 2 * x.hk) * x.d * x.elem * x.S / x.cp * ((x.cp - 1) / x.cp)
        return {"fwd Q/K/V/O All-to-All": per, "bwd dO/dQ/dK/dV All-to-All": per}


COST = UlyssesCost()
