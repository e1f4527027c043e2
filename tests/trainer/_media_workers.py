"""Rank function of the media trainer tests (module-level: picklable for the pool)."""
from __future__ import annotations


def train_media(cfg: dict) -> dict:
    """``trainer.train()`` on the media source: every step's loss, every parameter after the steps (full,
    fp32 CPU) and the HF export's path (``logging.export_hf``)."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    res = trainer.train()
    params = trainer.named_full("param")
    media = sum(len(b.get("media", {}).get("video", ((), ()))[1]) for b in
                [trainer.data.batcher.batch(i) for i in range(trainer.data.position)])
    return {"losses": [r.loss for r in res], "params": params if trainer.rank == 0 else None,
            "videos_seen": media, "fsdp": trainer.uses_fsdp}
