"""Rank functions of the non-finite step tests (module-level, picklable): a TextTrainer whose loss
turns NaN at chosen steps, optionally on one rank only."""
from __future__ import annotations

import torch

from hyper_parallel.trainer.text import TextTrainer


class NaNTrainer(TextTrainer):
    """The loss sum (hence the gradients) is NaN on ``nan_ranks`` at the 1-based ``nan_steps``."""

    nan_steps: tuple = ()
    nan_ranks: tuple | None = None   # None: every rank

    def compute_loss(self, prepared):
        logits, loss_sum, valid = super().compute_loss(prepared)
        if self.step + 1 in self.nan_steps and (self.nan_ranks is None or self.rank in self.nan_ranks):
            loss_sum = loss_sum * float("nan")
        return logits, loss_sum, valid


def params_of(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.named_full("param").items()}


def train_until_error(cfg: dict, nan_steps: tuple, nan_ranks: tuple | None = None):
    """Train ``schedule.steps`` with NaN injected; -> (error type, step, message) or None, the
    trainer's step, whether the last attempted step left the parameters as they were, whether they
    are all finite."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.nonfinite import NonFiniteError

    cls = type("T", (NaNTrainer,), {"nan_steps": tuple(nan_steps), "nan_ranks": nan_ranks})
    trainer = cls(TrainerConfig.from_dict(cfg))
    err = None
    try:
        while trainer.step < trainer.cfg.schedule.steps:
            before = params_of(trainer)    # the weights before the last attempted step
            trainer.train(steps=trainer.step + 1)
    except NonFiniteError as exc:
        err = (type(exc).__name__, exc.step, str(exc))
    after = params_of(trainer)
    same = all(torch.equal(before[k], after[k]) for k in before)
    finite = all(bool(torch.isfinite(v).all()) for v in after.values())
    return {"error": err, "step": trainer.step, "unchanged": same, "finite": finite}
