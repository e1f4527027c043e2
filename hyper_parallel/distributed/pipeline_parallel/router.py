"""The MoE router load-balancing loss across pipeline stages, exact.

Transformers' loss is ``aux = E * sum_e (C_e / R) * (P_e / R)`` with ``C`` (top-k counts, no gradient),
``P`` (softmax sums) and ``R`` (rows) summed over **every** layer of the model and every token of the
loss domain (docs/trainer.md, router loss). A stage holds some layers only, so no stage can compute
``aux``, nor its part of the gradient ``coef * E * C_e / R^2 * dP_e`` (which needs the whole model's
``C`` and ``R``), by itself. The pipeline's own point-to-point channels carry what is missing:

* forward: each stage adds its (domain-reduced) ``[C, P, R]`` to a ``[2E + 1]`` tensor passed on with
  the hidden states; the last stage then holds the totals, computes ``aux`` and adds
  ``scale * aux`` to its loss;
* backward: the "gradient" the last stage returns for that tensor is the totals themselves, and
  each earlier stage passes them on unchanged while it gives its own ``P`` the gradient
  ``scale * E * C / R^2`` — exactly the whole model's.

``scale`` (per microbatch) is ``coef x weight x grad_scale`` as in the trainer's step.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

__all__ = ["StageRouterLoss", "carry_router_stats", "router_aux", "routers_in"]


@dataclasses.dataclass
class StageRouterLoss:
    """``stats(router_logits, microbatch)`` -> this stage's ``(counts [E], prob_sum [E] with grad, rows)``
    over the loss domain (already reduced over its ranks) for microbatch ``microbatch`` of the step (the
    schedule sets :attr:`microbatch` before each forward); ``scale``: ``coef x weight x grad_scale`` of
    one microbatch. The last stage appends each microbatch's ``(aux, counts [E])`` to ``values``."""

    num_experts: int
    stats: Callable
    scale: float = 1.0
    values: list = dataclasses.field(default_factory=list)
    microbatch: int = 0


def _split(totals: torch.Tensor, E: int):
    return totals[:E], totals[E:2 * E], totals[2 * E].clamp(min=1.0)


class _Carry(torch.autograd.Function):
    """``stats_in + mine`` forward; backward: the totals arrive as the output's gradient and go on to
    ``stats_in`` unchanged, ``prob_sum`` gets ``scale * E * C / R^2``."""

    @staticmethod
    def forward(ctx, stats_in, mine, prob_sum, scale: float, E: int):
        ctx.scale, ctx.E = scale, E
        return stats_in.detach() + mine

    @staticmethod
    def backward(ctx, totals):
        C, _P, R = _split(totals, ctx.E)
        # a copy: the incoming tensor is the pipeline's receive buffer, which it may reuse while this one is sent
        return totals.clone(), None, ctx.scale * ctx.E * C / (R * R), None, None


class _Aux(torch.autograd.Function):
    """``scale * aux`` of the totals ``stats_in + mine`` (the last stage); backward: the totals as
    ``stats_in``'s gradient (the message the earlier stages read), ``prob_sum`` its own part."""

    @staticmethod
    def forward(ctx, stats_in, mine, prob_sum, scale: float, E: int):
        totals = stats_in.detach() + mine
        C, P, R = _split(totals, E)
        ctx.save_for_backward(totals)
        ctx.scale, ctx.E = scale, E
        return scale * E * ((C / R) * (P / R)).sum()

    @staticmethod
    def backward(ctx, g):
        (totals,) = ctx.saved_tensors
        C, _P, R = _split(totals, ctx.E)
        return totals.clone(), None, g * ctx.scale * ctx.E * C / (R * R), None, None


def _mine(router: StageRouterLoss, router_logits, device):
    E = router.num_experts
    if router_logits:
        counts, prob_sum, rows = router.stats(router_logits, router.microbatch)
    else:       # a stage without MoE layers adds nothing
        counts = prob_sum = torch.zeros(E, device=device)
        rows = torch.zeros((), device=device)
    mine = torch.cat([counts.detach().float(), prob_sum.detach().float(), rows.detach().float().reshape(1)])
    return mine, prob_sum


def carry_router_stats(router: StageRouterLoss, router_logits, stats_in: Optional[torch.Tensor], device):
    """A stage before the last: the ``[2E + 1]`` tensor to pass on (stats so far + this stage's)."""
    mine, prob_sum = _mine(router, router_logits, device)
    stats_in = torch.zeros_like(mine) if stats_in is None else stats_in
    return _Carry.apply(stats_in, mine, prob_sum, router.scale, router.num_experts)


def router_aux(router: StageRouterLoss, router_logits, stats_in: Optional[torch.Tensor], device) -> torch.Tensor:
    """The last stage: ``scale * aux`` to add to its loss; records ``(aux, C)`` in ``router.values``."""
    mine, prob_sum = _mine(router, router_logits, device)
    stats_in = torch.zeros_like(mine) if stats_in is None else stats_in
    out = _Aux.apply(stats_in, mine, prob_sum, router.scale, router.num_experts)
    E = router.num_experts
    router.values.append((out.detach() / router.scale if router.scale else out.detach(),
                          (stats_in.detach() + mine)[:E]))
    return out


def routers_in(base_model, layers) -> Optional[int]:
    """How many routers transformers records ``router_logits`` from in ``layers`` (the model's
    ``_can_record_outputs``), or None when the model declares no recorder to count."""
    rec = (getattr(base_model, "_can_record_outputs", None) or {}).get("router_logits")
    cls, name = getattr(rec, "target_class", None), getattr(rec, "class_name", None)
    if cls is None and name is None:
        return None
    return sum(1 for layer in layers for m in layer.modules()
               if (cls is not None and isinstance(m, cls)) or (name is not None and type(m).__name__ == name))


def check_router_logits(router_logits, expected: Optional[int], stage: int) -> None:
    """A stage's forward must return one ``router_logits`` entry per router of its layers (else the loss
    would silently leave some layers out)."""
    got = len(router_logits or ())
    if expected is not None and got != expected:
        raise RuntimeError(f"pipeline stage {stage}: the model returned {got} router_logits for the {expected} "
                           "routers of the stage's layers (transformers' output recording missed some)")
