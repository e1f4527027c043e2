"""Trainer: YAML -> model -> CP batch -> loss -> FSDP/TP gradients -> optimizer step."""
from .config import TrainerConfig
