"""``hyper-train CONFIG.yaml [dotted.key=value ...]`` — train from a YAML file.

``hyper-train --help`` lists every YAML field (type, default, meaning; generated from the
schema in ``hyper_parallel/trainer/config.py``), ``hyper-train --version`` prints the version.

Single process when launched directly (world size 1); multi-rank under torchrun::

    torchrun --nproc-per-node 2 -m hyper_parallel.trainer.cli examples/train_cp2.yaml
    hyper-train examples/train_cp1.yaml schedule.steps=5 logging.out_dir=runs/try

Overrides are YAML-parsed (``accelerator.cp_size=2``, ``optimizer.lr=3e-4``, ``plan_overrides=[]``)
and checked by the schema exactly like the file. The config is loaded and checked on every rank
and agreed before anything else runs. Exit codes: 0 done,
2 configuration error (message names the YAML field), 4 training stopped at a step whose loss or
gradient norm was NaN/Inf (one line: the step, the last good checkpoint, the fix; see
``schedule.on_nonfinite``), 3 a peer rank stopped or died (one line:
the collective, its group, the elapsed time, the likely cause; see docs/trainer.md "When a peer
stops or dies"), 143 terminated by SIGTERM (one line, e.g. torchrun stopping the survivors),
129 the launcher (torchrun) is gone (one line; the rank stops within a second instead of training
on as an orphan), 1 other failure.

A peer failure ends the process with ``os._exit`` right after the line (a clean teardown could
block on the lost peer for another timeout). Its full traceback goes to
``<logging.out_dir>/peer_failure_rank<R>.log``; ``HYPER_PARALLEL_TRACEBACK=1`` also prints it.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path

USAGE = ("usage: hyper-train CONFIG.yaml [dotted.key=value ...]   (under torchrun for more than one rank)\n"
         "       hyper-train CONFIG.yaml --explain   (meshes, plan, bytes per rank; starts no rank)\n"
         "       hyper-train --help | --version")
PEER_FAILURE_EXIT = 3
NONFINITE_EXIT = 4
TRACEBACK_ENV = "HYPER_PARALLEL_TRACEBACK"


def _threads() -> None:
    import torch

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def _rank():
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None


def _peer_failure_line(failure, exc: BaseException, out_dir) -> str:
    """The one line for ``failure``; the full traceback goes to a per-rank debug log."""
    text = "".join(traceback.format_exception(exc))
    where = None
    if out_dir is not None:
        try:
            path = Path(out_dir) / f"peer_failure_rank{failure.rank if failure.rank is not None else 0}.log"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            where = path
        except OSError:
            pass
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        sys.stderr.write(text)
    tail = f" (traceback: {where})" if where else f" (traceback: set {TRACEBACK_ENV}=1)"
    return f"hyper-train: {failure.one_line()}; exiting with code {PEER_FAILURE_EXIT}{tail}"


def version() -> str:
    """The installed distribution's version (the package's ``__version__`` when not installed)."""
    try:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        return dist_version("hyper_parallel")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        from .. import __version__

        return __version__


def help_text() -> str:
    """``--help``: usage, what the run does, then every YAML field from the schema."""
    from .field_docs import field_reference_text

    return (f"{USAGE}\n\n{__doc__.strip()}\n\n"
            "YAML fields (a.b.c=value overrides any of them; generated from the schema):\n"
            f"{field_reference_text()}\n")


def load_config(argv: list):
    """The CLI's config path, local (no collective): ``argv[0]`` (the YAML file) + overrides ->
    :meth:`TrainerConfig.from_yaml` -> :func:`~hyper_parallel.trainer.config_checks.check_run_config`
    (the cross-field checks, :mod:`.config_checks`). Raises CPConfigError naming the field."""
    from .config import TrainerConfig
    from .config_checks import check_run_config

    return check_run_config(TrainerConfig.from_yaml(argv[0], argv[1:]))


def main(argv=None) -> int:
    """Run ``hyper-train``; returns the exit code. From the command line (``argv`` None) a peer
    failure or SIGTERM ends the process right after its one line (``os._exit``)."""
    hard_exit = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    if any(a in ("-V", "--version") for a in argv):
        print(f"hyper-train (hyper_parallel) {version()}")
        return 0
    if "--explain" in argv:   # one process, meta device, before any rank starts (trainer/explain.py)
        from .explain import explain_cli

        return explain_cli([a for a in argv if a != "--explain"])
    options = [a for a in argv if a.startswith("-")]
    if options:
        print(f"hyper-train: unknown option {options[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    _threads()
    from ..distributed.errors import CPConfigError, PreflightError
    from ..distributed.preflight import agree_or_raise
    from ..platform import destroy_distributed, diagnose, get_platform, init_distributed
    from ..platform.shutdown import exit_now, install_parent_watch, install_sigterm_report
    from .nonfinite import NonFiniteError
    from .text import TextTrainer

    code = 0
    import torch.distributed as dist

    if hard_exit:
        install_sigterm_report("hyper-train: ", _rank)
        install_parent_watch("hyper-train: ", _rank)   # launcher SIGKILLed: stop, write nothing more
    cfg = None
    try:
        from .base import bind_local_device

        platform = get_platform()
        bind_local_device(platform)
        init_distributed(platform)
        cfg = agree_or_raise(lambda: load_config(argv), what="config load")
        is_main = not dist.is_initialized() or dist.get_rank() == 0
        level = getattr(logging, str(cfg.logging.level).upper(), logging.INFO)
        logging.basicConfig(level=level if is_main else max(level, logging.WARNING),
                            format="%(levelname)s %(name)s: %(message)s")
        trainer = TextTrainer(cfg)
        results = trainer.train()
        if is_main:
            log = trainer.run_log
            applied = [r for r in results if not r.nonfinite]   # skipped steps carry a NaN/Inf loss
            if applied:
                first = next(r for r in trainer.run_log.records if not r.get("nonfinite"))
                last = applied[-1]
                tps = sum(r.tokens_per_s for r in results) / len(results)
                skipped = (f" ({trainer.nonfinite.skipped} non-finite step(s) skipped, see {log.jsonl_path})"
                           if trainer.nonfinite.skipped else "")
                print(f"done: {trainer.step} steps{skipped}, loss {first['loss']:.4f} -> {last.loss:.4f}, "
                      f"mean {tps:,.0f} tokens/s, {last.valid_tokens} valid tokens/step", flush=True)
            elif results:
                print(f"done: {trainer.step} steps, every one skipped as non-finite (see {log.jsonl_path})",
                      flush=True)
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
    except NonFiniteError as exc:   # raised on every rank at the same step: rank 0 reports it once
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"hyper-train: {exc}", file=sys.stderr, flush=True)
        code = NONFINITE_EXIT
    except BaseException as exc:  # noqa: BLE001 - only peer failures are handled here (DCP's
        # CheckpointException is a BaseException); anything else keeps its traceback
        failure = None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else diagnose(exc, rank=_rank())
        if failure is None:
            raise
        line = _peer_failure_line(failure, exc, cfg.logging.out_dir if cfg is not None else None)
        if hard_exit:
            exit_now(line, PEER_FAILURE_EXIT)
        print(line, file=sys.stderr, flush=True)
        code = PEER_FAILURE_EXIT
    finally:
        destroy_distributed()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
