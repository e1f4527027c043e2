"""``--explain`` with ``accelerator.pp_size > 1``: the stages and what one rank of the largest holds.

:func:`pipeline_figures` cuts the meta model's parameter bytes the way :func:`~hyper_parallel.distributed.
pipeline_parallel.stage_layers` cuts the layers (embedding on the first stage, final norm + LM head on
the last), and gives the schedule's bubble fraction ``(pp - 1) / (m + pp - 1)`` for ``m`` microbatches
(GPipe and 1F1B alike), the microbatches whose activations a stage holds at once (GPipe: all ``m``;
1F1B: ``min(pp - s, m)`` on stage ``s``), and the activation bytes each stage sends per step (one
``[B, S_local, H]`` tensor per microbatch forward and its gradient backward). docs/pipeline_parallel.md.
"""
from __future__ import annotations

import dataclasses

import torch.nn as nn

from ..distributed.pipeline_parallel import stage_layers

__all__ = ["PipelineFigures", "pipeline_figures"]


@dataclasses.dataclass
class PipelineFigures:
    stages: list            # per stage: {"layers": range, "param_bytes": float, "in_flight": int}
    bubble: float           # idle fraction of the schedule
    largest: int            # the stage with the most parameter bytes
    p2p_bytes: float        # activation + gradient bytes a middle stage sends per step

    def lines(self, schedule: str, microbatches: int) -> list:
        out = [f"schedule {schedule}, {microbatches} microbatches, {len(self.stages)} stages; bubble fraction "
               f"{self.bubble:.3f} ((pp - 1) / (microbatches + pp - 1))"]
        for i, st in enumerate(self.stages):
            r = st["layers"]
            out.append(f"  stage {i}: layers {r.start}-{r.stop - 1} ({len(r)}), parameters {st['param_bytes'] / 1e9:.3f} "
                       f"GB, activations of {st['in_flight']} microbatch(es) held at once")
        out.append(f"  point-to-point: {self.p2p_bytes / 1e6:.2f} MB per step per rank (activations forward, their "
                   f"gradients backward); per-rank figures below: stage {self.largest}'s parameters and layers, "
                   "stage 0's microbatches in flight (an upper bound)")
        return out


def pipeline_figures(model: nn.Module, layer_names: list, pp: int, schedule: str, microbatches: int,
                     act_bytes: float) -> PipelineFigures:
    """Figures of ``model`` (meta) cut in ``pp`` stages; ``layer_names``: its decoder-layer FQNs in order;
    ``act_bytes``: one microbatch's ``[B, S_local, H]`` activation."""
    named = dict(model.named_modules())
    layer_bytes = [sum(p.numel() * p.element_size() for p in named[n].parameters()) for n in layer_names]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    inner = getattr(model, "model", model)
    embed = sum(p.numel() * p.element_size() for p in inner.embed_tokens.parameters())
    rest = total - sum(layer_bytes) - embed            # final norm + LM head
    stages = []
    for s in range(pp):
        r = stage_layers(len(layer_names), pp, s)
        own = sum(layer_bytes[i] for i in r) + (embed if s == 0 else 0) + (rest if s == pp - 1 else 0)
        held = microbatches if schedule == "gpipe" else min(pp - s, microbatches)
        stages.append({"layers": r, "param_bytes": float(own), "in_flight": held})
    largest = max(range(pp), key=lambda s: stages[s]["param_bytes"])
    return PipelineFigures(stages, (pp - 1) / (microbatches + pp - 1), largest, 2.0 * act_bytes * microbatches)
