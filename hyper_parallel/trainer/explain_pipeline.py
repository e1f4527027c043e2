"""``--explain`` with ``accelerator.pp_size > 1``: the stages, and what one rank holds.

:func:`pipeline_figures` cuts the meta model's parameter bytes the way :func:`~hyper_parallel.distributed.
pipeline_parallel.rank_stages` cuts the layers into ``pp x v`` stages (``v`` per rank, interleaved when
``v > 1``: rank ``r`` holds stages ``r, r + pp, ...``; the embedding on stage 0, the final norm and LM head
on the last), and gives the schedule's bubble fraction ``(pp - 1) / (v m + pp - 1)`` for ``m``
microbatches, the (stage, microbatch) activations a rank holds at once (GPipe: ``m``; 1F1B:
``min(pp - r, m)``; interleaved: ``min((v - 1) pp + 2 (pp - 1 - r) + 1, v m)``, torch's warm-up), and
the activation bytes a rank sends per step (one ``[B, S_local, H]`` tensor per stage and microbatch
forward, its gradient backward). docs/pipeline_parallel.md.
"""
from __future__ import annotations

import dataclasses

import torch.nn as nn

from ..distributed.pipeline_parallel import rank_stages

__all__ = ["PipelineFigures", "pipeline_figures"]


@dataclasses.dataclass
class PipelineFigures:
    ranks: list             # per pp rank: {"stages", "layers", "param_bytes", "in_flight", "chunk_layers"}
    bubble: float           # idle fraction of the schedule
    largest: int            # the pp rank with the most parameter bytes
    p2p_bytes: float        # activation + gradient bytes a rank sends per step

    def lines(self, schedule: str, microbatches: int) -> list:
        n = sum(len(r["stages"]) for r in self.ranks)
        out = [f"schedule {schedule}, {microbatches} microbatches, {n} stages on {len(self.ranks)} pp ranks; bubble "
               f"fraction {self.bubble:.3f} ((pp - 1) / (stages per rank x microbatches + pp - 1))"]
        for i, r in enumerate(self.ranks):
            out.append(f"  pp rank {i}: stage(s) {r['stages']}, layers {r['layers']}, parameters "
                       f"{r['param_bytes'] / 1e9:.3f} GB, {r['in_flight']} stage-microbatch activation(s) held at once")
        out.append(f"  point-to-point: {self.p2p_bytes / 1e6:.2f} MB per step per rank (activations forward, their "
                   f"gradients backward); per-rank figures below: pp rank {self.largest}'s parameters and layers, "
                   "pp rank 0's activations in flight (an upper bound)")
        return out


def pipeline_figures(model: nn.Module, layer_names: list, pp: int, schedule: str, microbatches: int,
                     act_bytes: float, virtual: int = 1) -> PipelineFigures:
    """Figures of ``model`` (meta) cut in ``pp x virtual`` stages; ``layer_names``: its decoder-layer
    FQNs in order; ``act_bytes``: one microbatch's ``[B, S_local, H]`` activation."""
    named = dict(model.named_modules())
    layer_bytes = [sum(p.numel() * p.element_size() for p in named[n].parameters()) for n in layer_names]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    inner = getattr(model, "model", model)
    embed = sum(p.numel() * p.element_size() for p in inner.embed_tokens.parameters())
    rest = total - sum(layer_bytes) - embed            # final norm + LM head
    n_stages, m = pp * virtual, microbatches
    ranks = []
    for r in range(pp):
        held = rank_stages(len(layer_names), pp, r, virtual)
        ids, chunks = [s for s, _c in held], [c for _s, c in held]
        layers = [i for c in chunks for i in c]
        own = sum(layer_bytes[i] for i in layers) + (embed if 0 in ids else 0) + (rest if n_stages - 1 in ids else 0)
        held = (m if schedule == "gpipe" else min((virtual - 1) * pp + 2 * (pp - 1 - r) + 1, virtual * m)
                if virtual > 1 else min(pp - r, m))
        ranks.append({"stages": ids, "layers": layers, "param_bytes": float(own), "in_flight": held,
                      "chunk_layers": max(len(c) for c in chunks)})
    largest = max(range(pp), key=lambda i: ranks[i]["param_bytes"])
    return PipelineFigures(ranks, (pp - 1) / (virtual * m + pp - 1), largest, 2.0 * act_bytes * m * virtual)
