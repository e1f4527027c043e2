"""``hyper-train CONFIG.yaml [dotted.key=value ...]`` — train from a YAML file.

Single process when launched directly (world size 1); multi-rank under torchrun::

    torchrun --nproc-per-node 2 -m hyper_parallel.trainer.cli examples/train_cp2.yaml
    hyper-train examples/train_cp1.yaml schedule.steps=5 logging.out_dir=runs/try

Overrides are YAML-parsed (``accelerator.cp_size=2``, ``plan_overrides=[]``). The config is
loaded and checked on every rank and agreed before anything else runs. Exit codes: 0 done,
2 configuration error (message names the YAML field), 1 other failure.
"""
from __future__ import annotations

import logging
import os
import sys

USAGE = "usage: hyper-train CONFIG.yaml [dotted.key=value ...]   (under torchrun for more than one rank)"


def _threads() -> None:
    import torch

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ if argv else USAGE)
        return 0 if argv else 2
    _threads()
    from ..distributed.errors import CPConfigError, PreflightError
    from ..distributed.preflight import agree_or_raise
    from ..platform import destroy_distributed, get_platform, init_distributed
    from .config import TrainerConfig
    from .text import TextTrainer

    code = 0
    import torch.distributed as dist

    try:
        from .base import bind_local_device

        platform = get_platform()
        bind_local_device(platform)
        init_distributed(platform)
        cfg = agree_or_raise(lambda: TrainerConfig.from_yaml(argv[0], argv[1:]), what="config load")
        is_main = not dist.is_initialized() or dist.get_rank() == 0
        level = getattr(logging, str(cfg.logging.level).upper(), logging.INFO)
        logging.basicConfig(level=level if is_main else max(level, logging.WARNING),
                            format="%(levelname)s %(name)s: %(message)s")
        trainer = TextTrainer(cfg)
        results = trainer.train()
        if is_main:
            log = trainer.run_log
            if results:
                first, last = trainer.run_log.records[0], results[-1]
                tps = sum(r.tokens_per_s for r in results) / len(results)
                print(f"done: {trainer.step} steps, loss {first['loss']:.4f} -> {last.loss:.4f}, "
                      f"mean {tps:,.0f} tokens/s, {last.valid_tokens} valid tokens/step", flush=True)
            else:
                print(f"done: nothing to do (already at step {trainer.step})", flush=True)
            print(f"log: {log.json_path}", flush=True)
            if cfg.logging.plot:
                print(f"loss curve: {log.plot_path}", flush=True)
    except (CPConfigError, PreflightError, FileNotFoundError) as exc:
        # agreed on every rank (preflight): rank 0 reports it once
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"hyper-train: configuration error: {exc}", file=sys.stderr, flush=True)
        code = 2
    finally:
        destroy_distributed()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
