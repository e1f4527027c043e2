"""Hybrid's cost per layer (cost_model.py): Ulysses All-to-All inside the degree ``u``, the
head-exchanged K/V AllGather across ``cp / u`` (regathered in backward unless activation
checkpointing re-runs the forward, dK/dV ReduceScatter), and
while the layer runs its gathered K/V ``[B, Hk/u, S, D]`` x 2."""
from __future__ import annotations

from ...cost_model import CostModel, LayerShape


def _degree(x: LayerShape) -> int:
    return int(x.params.get("ulysses_degree", 1))


class HybridCost(CostModel):
    def comm(self, x: LayerShape) -> dict:
        u = _degree(x)
        a2a = (u - 1) / u * x.local * x.d * x.elem
        kv = 2 * x.hk * x.d * x.local * x.elem * (x.cp // u - 1)   # the head-exchanged K/V shard to each ring peer
        out = {"fwd Q/K/V/O All-to-All": (2 * x.hq + 2 * x.hk) * a2a, "fwd K/V AllGather": kv,
               "bwd K/V regather": kv, "bwd dK/dV ReduceScatter": kv,
               "bwd dO/dQ/dK/dV All-to-All": (2 * x.hq + 2 * x.hk) * a2a}
        if x.recomputed:          # activation checkpointing: the recomputed forward gathers instead
            del out["bwd K/V regather"]
        return out

    def in_flight(self, x: LayerShape) -> float:
        return 2 * x.S * max(1, x.hk // _degree(x)) * x.d * x.elem * x.B


COST = HybridCost()
