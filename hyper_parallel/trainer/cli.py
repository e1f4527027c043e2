"""``hyper-train CONFIG.yaml [dotted.key=value ...] [--nproc-per-node N]`` — train from a YAML file.

``hyper-train --help`` lists every YAML field (type, default, meaning; generated from the
schema in ``hyper_parallel/trainer/config.py``), ``hyper-train --version`` prints the version.

From a shell, ``hyper-train`` checks the whole config once, then starts N ranks itself (N from
the config's sizes unless given; :mod:`.launch`, one summary line per failure: :mod:`.failures`);
one rank trains in this process. Inside a torchrun worker it is one rank, as before::

    hyper-train examples/train_cp2.yaml
    torchrun --nproc-per-node 2 -m hyper_parallel.trainer.cli examples/train_cp2.yaml
    hyper-train examples/train_cp1.yaml schedule.steps=5 logging.out_dir=runs/try

Overrides are YAML-parsed (``accelerator.cp_size=2``, ``optimizer.lr=3e-4``, ``plan_overrides=[]``)
and checked by the schema exactly like the file. The config is loaded and checked on every rank
and agreed before anything else runs. Exit codes: 0 done (rank 0 prints where every artifact is),
1 other failure, 2 configuration or data error (message names the YAML field), 4 training stopped at a step whose loss or
gradient norm was NaN/Inf (one line: the step, the last good checkpoint, the fix; see
``schedule.on_nonfinite``), 3 a peer rank stopped or died (one line:
the collective, its group, the elapsed time, the likely cause; see docs/trainer.md "When a peer
stops or dies"), 143 terminated by SIGTERM (one line, e.g. torchrun stopping the survivors),
129 the launcher (torchrun) is gone (one line; the rank stops within a second instead of training
on as an orphan).

A peer failure ends the process with ``os._exit`` right after the line (a clean teardown could
block on the lost peer for another timeout). Its full traceback goes to
``<logging.out_dir>/peer_failure_rank<R>.log``; ``HYPER_PARALLEL_TRACEBACK=1`` also prints it.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback

USAGE = ("usage: hyper-train CONFIG.yaml [dotted.key=value ...] [--nproc-per-node N]\n"
         "       hyper-train CONFIG.yaml --explain   (meshes, plan, bytes per rank; starts no rank)\n"
         "       hyper-train --help | --version")
PEER_FAILURE_EXIT = 3
NONFINITE_EXIT = 4


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
    :func:`~hyper_parallel.trainer.config_checks.load_run_config`. Raises CPConfigError naming the field."""
    from .config_checks import load_run_config

    return load_run_config(argv)


def _options(argv: list):
    """(argv without ``--nproc-per-node N``, N or None, an error line or None)."""
    rest, nproc = [], None
    it = iter(argv)
    for a in it:
        if a == "--nproc-per-node" or a.startswith("--nproc-per-node="):
            value = a.partition("=")[2] if "=" in a else next(it, "")
            if not value.isdigit() or int(value) < 1:
                return rest, None, f"hyper-train: --nproc-per-node needs a positive integer, got {value!r}"
            nproc = int(value)
        elif a.startswith("-"):
            return rest, None, f"hyper-train: unknown option {a!r}\n{USAGE}"
        else:
            rest.append(a)
    return rest, nproc, None


def main(argv=None) -> int:
    """Run ``hyper-train``; returns the exit code. Outside a torchelastic worker the config is
    checked here and more than one rank is started by :mod:`.launch`; inside one (or for a single
    rank) this process trains. From the command line (``argv`` None) a peer failure or SIGTERM
    ends the process right after its one line (``os._exit``)."""
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
    argv, nproc, error = _options(argv)
    if error or not argv:
        print(error or USAGE, file=sys.stderr)
        return 2
    from . import launch

    if not launch.in_worker():
        from ..distributed.errors import CPConfigError
        from .start_method import choose as choose_start_method

        try:
            cfg, nproc = launch.check_before_launch(argv, nproc)
            method = choose_start_method(cfg) if nproc > 1 else None
        except (CPConfigError, FileNotFoundError) as exc:
            print(f"hyper-train: configuration error: {exc}", file=sys.stderr, flush=True)
            return 2
        if nproc > 1:
            return launch.launch(argv, nproc, method, worker=_train)
    elif nproc is not None:
        print("hyper-train: --nproc-per-node is the launcher's (torchrun's) here, not hyper-train's",
              file=sys.stderr)
        return 2
    return _train(argv, hard_exit)


def _train(argv: list, hard_exit: bool) -> int:
    """This process's rank of the run (alone, or one of torchrun's / hyper-train's ranks)."""
    _threads()
    from ..distributed.errors import CPConfigError, PreflightError
    from ..distributed.preflight import agree_or_raise
    from ..platform import destroy_distributed, diagnose, get_platform, init_distributed
    from ..platform.faults import maybe_inject_fault
    from ..platform.shutdown import exit_now, install_parent_watch, install_sigterm_report, set_exit_reporter
    from . import failures
    from .nonfinite import NonFiniteError
    from .run_summary import summary_lines
    from .text import TextTrainer

    code = 0
    import torch.distributed as dist

    if hard_exit:
        set_exit_reporter(lambda line, c: failures.record_failure(line, c, _EXIT_KINDS.get(c, failures.ERROR),
                                                                  _rank()))
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
        if failures.launched():
            from .start_method import origin_line

            logging.getLogger(__name__).info(origin_line())
        maybe_inject_fault(_rank() or 0, 1, "setup")   # test hook (platform/faults.py)
        trainer = TextTrainer(cfg)
        results = trainer.train()
        if is_main:
            print("\n".join(summary_lines(trainer, results)), flush=True)
    except (CPConfigError, PreflightError, FileNotFoundError) as exc:
        # agreed on every rank (preflight): every rank records it, rank 0 prints it once; a
        # PreflightError echoes another rank's error
        code = 2
        failures.record_failure(f"hyper-train: configuration error: {exc}", code,
                                failures.ECHO if isinstance(exc, PreflightError) else failures.CONFIG, _rank(),
                                echo=_rank() in (None, 0))
    except NonFiniteError as exc:   # raised on every rank at the same step: rank 0 reports it once
        code = NONFINITE_EXIT
        failures.record_failure(f"hyper-train: {exc}", code, failures.NONFINITE, _rank(), echo=_rank() in (None, 0))
    except BaseException as exc:  # noqa: BLE001 - only peer failures are handled here (DCP's
        # CheckpointException is a BaseException); anything else keeps its traceback
        failure = None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else diagnose(exc, rank=_rank())
        if failure is None:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) or not hard_exit:
                raise
            code = 1   # started by hyper-train: one line for the parent, the traceback in a file;
            # otherwise the traceback on stderr and the line in torchrun's error file
            launched = failures.launched()
            if not launched:
                traceback.print_exc()
            failures.record_failure(failures.error_line(exc, _rank(), cfg.logging.out_dir if cfg is not None
                                                        else None, save=launched),
                                    code, failures.ERROR, _rank(), echo=False)
        else:
            line = failures.peer_failure_line(failure, exc, cfg.logging.out_dir if cfg is not None else None,
                                              PEER_FAILURE_EXIT)
            if hard_exit:
                exit_now(line, PEER_FAILURE_EXIT)
            print(line, file=sys.stderr, flush=True)
            code = PEER_FAILURE_EXIT
    finally:
        destroy_distributed()
    return _leave(code, hard_exit)


def _leave(code: int, hard_exit: bool) -> int:
    """``code``; from the command line an error ends the process here, after the process group was
    destroyed and the output flushed: no interpreter teardown, whose C++ destructors (a collective
    thread still joinable) could abort the rank ("terminate called without an active exception")
    and which takes seconds on a loaded machine while the peers wait to be stopped."""
    if hard_exit and code:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        os._exit(code)
    return code


_EXIT_KINDS = {PEER_FAILURE_EXIT: "peer", 143: "terminated", 129: "launcher_gone"}


if __name__ == "__main__":
    raise SystemExit(main())
