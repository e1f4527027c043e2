"""Trainer: YAML -> model -> CP batch -> loss -> FSDP/TP gradients -> optimizer step."""
from .config import TrainerConfig
from .loss import GlobalLoss, mean_global_loss, token_loss_sum
from .model import HyperAutoModel, build_model


def __getattr__(name):  # the trainer classes import the distributed stack lazily
    if name in ("BaseTrainer", "StepProbe", "StepResult", "clip_grad_norm_global"):
        from . import base

        return getattr(base, name)
    if name == "TextTrainer":
        from .text import TextTrainer

        return TextTrainer
    if name == "NonFiniteError":
        from .nonfinite import NonFiniteError

        return NonFiniteError
    raise AttributeError(name)


__all__ = ["TrainerConfig", "HyperAutoModel", "build_model", "BaseTrainer", "TextTrainer",
           "StepProbe", "StepResult", "mean_global_loss", "GlobalLoss", "token_loss_sum",
           "clip_grad_norm_global", "NonFiniteError"]
