"""Exact context parallelism inside the Hugging Face ``Trainer`` and TRL's ``SFTTrainer``.

    trainer = SFTTrainer(...)                      # the script as it was
    context_parallel(trainer, cp_size=2, plan_overrides="plan.yaml")
    trainer.train()

See docs/hf_integration.md. Modules: :mod:`.entry` (the one call), :mod:`.declaration`
(plan_overrides), :mod:`.checks` (refusals), :mod:`.data` (one batch per CP group), :mod:`.batch`
(collator -> CP shard), :mod:`.forward` (forward + loss normalisation), :mod:`.grpo` (TRL's
GRPOTrainer), :mod:`.evaluation`, :mod:`.context`.
"""
from .batch import CPDataCollator
from .checks import KNOWN_COLLATORS, check_trainer
from .declaration import load_plan_overrides
from .entry import context_parallel

__all__ = ["context_parallel", "CPDataCollator", "check_trainer", "load_plan_overrides", "KNOWN_COLLATORS"]
