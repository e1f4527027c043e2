"""Tiny demo: build meshes and print the resolved CP plan (run under torchrun on CPU).

    torchrun --nproc-per-node 2 -m hyper_parallel.demo examples/demo_plan_cp2.yaml
"""
from __future__ import annotations

import sys

from .distributed.infrastructure import setup_distributed
from .distributed.preflight import agree_or_raise
from .platform import destroy_distributed, get_platform, init_distributed


def build_model(cfg):
    from .trainer.model import build_model as _build

    return _build(cfg.model)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(__doc__)
        return 2
    from .trainer.config import TrainerConfig

    init_distributed(get_platform())
    cfg = agree_or_raise(lambda: TrainerConfig.from_yaml(argv[0], argv[1:]), what="config load")
    model = build_model(cfg)
    setup_distributed(cfg.accelerator, cfg.plan_overrides, model)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
