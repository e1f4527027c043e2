"""Non-finite steps: a NaN/Inf loss or gradient norm never reaches the weights.

:func:`agree_nonfinite` decides, identically on every rank (one MAX all-reduce of a flag over the
world group), whether a step's loss or gradient norm is NaN/Inf; :func:`~.step.run_step` then
skips that step's optimizer update. :class:`NonFiniteGuard` applies ``schedule.on_nonfinite`` in
the training loop: ``stop`` (default) raises :class:`NonFiniteError` at that step, ``skip`` lets
the run go on up to ``schedule.max_nonfinite_skips`` skipped steps, then stops the same way.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..platform import all_reduce

__all__ = ["NonFiniteError", "NonFiniteGuard", "agree_nonfinite", "is_finite_number"]


class NonFiniteError(RuntimeError):
    """Training stopped at ``step`` because its loss or gradient norm was NaN/Inf (raised on every
    rank at the same step). The message names the step, the last good checkpoint and the fix."""

    def __init__(self, step: int, message: str):
        self.step = step
        super().__init__(message)


def is_finite_number(value) -> bool:
    """``value`` (a float, or None for "not computed") is a finite number or None."""
    return value is None or math.isfinite(float(value))


def agree_nonfinite(loss_value, grad_norm, device) -> bool:
    """True on every rank when the loss or the gradient norm is NaN/Inf on any rank. Collective
    over the world group (every rank calls it once per step); no-op without a process group."""
    bad = not (is_finite_number(loss_value) and is_finite_number(grad_norm))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return bad
    flag = torch.tensor([1.0 if bad else 0.0], dtype=torch.float32, device=device)
    return bool(all_reduce(flag, dist.group.WORLD, op=dist.ReduceOp.MAX, tag="trainer.nonfinite").item() > 0)


class NonFiniteGuard:
    """``schedule.on_nonfinite`` for one run of the loop: :meth:`check` is called with every step
    result (the same on every rank) and returns the extra JSONL fields of a skipped step, or raises
    :class:`NonFiniteError`. One per trainer: skips are counted over its ``train()`` calls (a
    resumed run starts counting again)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.skipped = 0

    def check(self, res, last_checkpoint) -> dict:
        """``{}`` for a finite step; ``{"nonfinite": true, "skipped": true, "skips": n}`` for a
        skipped one; raises NonFiniteError when the policy is ``stop`` or the skips ran out."""
        if not getattr(res, "nonfinite", False):
            return {}
        s = self.cfg.schedule
        if s.on_nonfinite == "skip" and self.skipped < s.max_nonfinite_skips:
            self.skipped += 1
            return {"nonfinite": True, "skipped": True, "skips": self.skipped}
        raise NonFiniteError(res.step, stop_message(self.cfg, res.step, res.loss, res.grad_norm,
                                                    last_checkpoint, self.skipped))


def stop_message(cfg, step: int, loss, grad_norm, last_checkpoint, skipped: int = 0) -> str:
    """One paragraph: the step, the values, the last good checkpoint (or "none saved yet"), the fix."""
    what = ", ".join(f"{name} {_fmt(v)}" for name, v in (("loss", loss), ("grad norm", grad_norm))
                     if not is_finite_number(v)) or "a non-finite value"
    o, s, m = cfg.optimizer, cfg.schedule, cfg.model
    fixes = [f"lower optimizer.lr (now {o.lr:g}; e.g. {o.lr / 10:g})"]
    fixes.append("clip gradients with optimizer.grad_clip (e.g. 1.0)" if o.grad_clip is None
                 else f"lower optimizer.grad_clip (now {o.grad_clip:g})")
    if m.dtype == "float16":
        fixes.append("keep model.dtype: float32 and train in bf16 with schedule.mixed_precision: bf16 "
                     "(float16 overflows at 65504)")
    elif s.mixed_precision != "bf16":
        fixes.append("train in bf16 (schedule.mixed_precision: bf16) if activations overflow")
    if s.on_nonfinite == "stop":
        fixes.append(f"or set schedule.on_nonfinite: skip to skip up to schedule.max_nonfinite_skips "
                     f"({s.max_nonfinite_skips}) such steps")
    else:
        fixes.append("or raise schedule.max_nonfinite_skips")
    ran_out = (f" after {skipped} skipped non-finite step(s) (schedule.max_nonfinite_skips: "
               f"{s.max_nonfinite_skips})" if s.on_nonfinite == "skip" else "")
    last = str(last_checkpoint) if last_checkpoint else "none saved yet"
    return (f"training stopped at step {step}{ran_out}: {what} (the step's update was not applied). "
            f"Last good checkpoint: {last}. Fix: {'; '.join(fixes)}")


def _fmt(v) -> str:
    return "null" if v is None else f"{float(v)}"
