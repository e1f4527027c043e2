"""``hyper-train CONFIG [k=v ...] [--nproc-per-node N]`` outside torchrun: check once, then start the ranks.

Contract (:func:`launch`, called by the CLI when this process is not a torchelastic worker):

1. In this one process, before any rank exists: the whole config (the schema, the sizes against
   N, then :func:`.config_checks.check_run_config`: cross-field checks, plan targets, tokenizer
   and vocabulary), the model on the meta device (:func:`_check_model`: the plan against it, the
   tiled MLP's and activation offload's modules; the ranks check again), the data (``data.path``
   is a file; ``data.source: files``: the files are read and tokenized into the cache once, here,
   saying so) and the output paths. A problem is one line and exit code 2.
2. N is ``--nproc-per-node`` or the product of the config's sizes (dp_replicate x dp_shard x cp x
   tp x pp). N = 1 runs in this process (the CLI goes on; no launcher).
3. The ranks are started by PyTorch's elastic launch API (``torch.distributed.launcher.api.
   elastic_launch``, standalone c10d rendezvous on localhost, no restarts), by the start method
   :func:`.start_method.choose` picks (``HYPER_PARALLEL_START_METHOD``): ``fork`` (CPU-only
   machines, the default there) runs :func:`.start_method.forked_rank`, the CLI's worker path,
   in ranks forked from this already-imported process (no second ``import torch, transformers``).
   Checked for fork safety: this process has run no backward and touched no device, ran its
   checks on one OpenMP thread (no libgomp team), flushes stdio, gives the ranks
   ``TOKENIZERS_PARALLELISM=false``; threads alive at fork (OpenBLAS servers, the rendezvous
   TCPStore server, a Rayon pool) are not needed by a rank. Details: :mod:`.start_method`;
   ``spawn`` (any accelerator, or asked for) starts ``python -m hyper_parallel.trainer.cli
   CONFIG k=v ...`` in fresh interpreters. Inside them the CLI behaves as under torchrun. When one rank fails, torchelastic stops the others (SIGTERM, then SIGKILL after
   ``shutdown_timeout``) and this process prints one line per root cause (:mod:`.failures`),
   with no launcher traceback and the launchers' own log lines silenced (:data:`QUIETED_LOGGERS`).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from pathlib import Path

from .failures import LAUNCHED_ENV, summarise

#: seconds torchelastic waits for a SIGTERMed rank before SIGKILL (a rank reports SIGTERM in ~2 s)
SHUTDOWN_TIMEOUT_S = 10


def in_worker() -> bool:
    """True inside a rank started by torchrun / torchelastic (or any launcher setting LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def world_size_of(cfg) -> int:
    """The number of ranks the config's sizes ask for."""
    return cfg.accelerator.mesh_sizes().product()


def check_before_launch(argv: list, nproc: int | None):
    """Step 1 of the module doc; returns (config, N). Raises CPConfigError naming the field."""
    from ..distributed.errors import CPConfigError
    from ..distributed.mesh import MeshConfigError
    from .config import TrainerConfig
    from .config_checks import check_run_config
    from .metrics import check_output_paths
    from .start_method import serial_threads

    cfg = TrainerConfig.from_yaml(argv[0], list(argv[1:]))   # the schema, then the sizes (cheap) ...
    n = world_size_of(cfg) if nproc is None else nproc
    try:
        cfg.accelerator.mesh_sizes().check(n)
    except MeshConfigError as exc:
        raise CPConfigError("accelerator", f"{exc} (--nproc-per-node {n})",
                            fix=f"use --nproc-per-node {world_size_of(cfg)} (or leave it out), or change the "
                                "sizes") from None
    with serial_threads():   # one thread: no OpenMP team in a process that may fork (start_method.py)
        check_run_config(cfg)   # ... then the checks that load transformers, the tokenizer and the plan targets
        _check_model(cfg)
        _check_data(cfg.data)
    check_output_paths(cfg.logging, (cfg.schedule.checkpoint_dir or Path(cfg.logging.out_dir) / "checkpoints")
                       if cfg.schedule.save_every else None)
    return cfg, n


def _check_model(cfg) -> None:
    """The refusals that need the model, made here on the meta device instead of after the ranks
    started (seconds of process start and imports per rank): the sharding/CP plan against the
    model (every target found, each method's own check of its module), the dense token-wise MLPs
    ``schedule.tiled_mlp`` tiles and the decoder layers ``schedule.activation_offload`` needs.
    A model that cannot be built on the meta device here is left to the ranks (they build it for
    real and repeat every check), with one line on stderr when there was a check to make (a plan
    override, cp / tp / ep > 1, the tiled MLP or activation offload); any other exception of these
    checks is a bug and propagates."""
    from ..distributed.errors import CPConfigError
    from ..distributed.plan import ShardingPlanner
    from ..distributed.tensor_parallel import find_decoder_layers
    from .model import run_model
    from .tiled_mlp import install_tiled_mlp

    a, s = cfg.accelerator, cfg.schedule
    try:
        model = run_model(cfg)
    except CPConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a build the meta device cannot do: the ranks build it for real
        if cfg.plan_overrides or max(a.cp_size, a.tp_size, a.ep_size) > 1 or s.tiled_mlp or s.activation_offload:
            print(f"hyper-train: the model was not built on the meta device here ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}); its plan is checked on the ranks",
                  file=sys.stderr, flush=True)
        return
    ShardingPlanner(cfg.plan_overrides, cfg.data.packed_documents).plan(
        model, tp_size=a.tp_size, cp_size=a.cp_size, ep_size=a.ep_size, sequence_parallel=a.sequence_parallel,
        loss_parallel=a.loss_parallel, packed_rows=cfg.data.packing)
    if s.tiled_mlp:
        install_tiled_mlp(model, s.tiled_mlp_chunk_size, tp_size=a.tp_size)
    if s.activation_offload and not list(find_decoder_layers(model)):
        raise CPConfigError("schedule.activation_offload", f"no decoder layers found in {type(model).__name__}",
                            fix="set schedule.activation_offload: false")


def _check_data(data) -> None:
    from ..distributed.errors import CPConfigError
    from .paths import resolve_path

    if data.source == "files":
        from .data_sources import open_token_store

        open_token_store(data)   # no process group: this process tokenizes once (first run) and opens it
    elif data.source == "media":
        from .data_sources import load_tokenizer, resolve_files

        resolve_files(data.files)   # the records and their media are read by the ranks (trainer/media.py)
        load_tokenizer(data.tokenizer)
    elif data.path is not None and not resolve_path(data.path).is_file():
        raise CPConfigError("data.path", f"{data.path} is not a file",
                            fix="point it at a text file, e.g. examples/data/corpus.txt")


#: the loggers that report worker exits and stops; the summary replaces them. ``torch.multiprocessing``
#: stops forked ranks: "Terminating process P via signal SIGTERM" for a rank still alive when another failed
QUIETED_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


def _quiet_torchelastic() -> None:
    """torchelastic (and, for forked ranks, ``torch.multiprocessing``) log every worker exit and
    stop at WARNING/ERROR: the summary replaces them (``LOGLEVEL`` set by the user wins)."""
    if "LOGLEVEL" not in os.environ:
        os.environ["LOGLEVEL"] = "CRITICAL"   # read when torchelastic creates its loggers
    if os.environ["LOGLEVEL"] != "CRITICAL":
        return
    for name in (*QUIETED_LOGGERS, *logging.root.manager.loggerDict):
        if name.startswith(QUIETED_LOGGERS):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _every_failure(failures: dict) -> dict:
    """torchelastic's function-entrypoint context reports only the first rank it saw fail; the
    others' error files (``.../attempt_N/<local rank>/error.json``, single node: local = global
    rank) are added, so the summary can tell a root cause from its consequences."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    out = dict(failures)
    first = next(iter(failures.values()), None)
    folder = Path(first.error_file).parent.parent if first is not None and first.error_file else None
    for path in sorted(folder.glob("*/error.json")) if folder and folder.is_dir() else ():
        other = int(path.parent.name) if path.parent.name.isdigit() else None
        if other is None or other in out:
            continue
        try:
            code = int(json.loads(path.read_text()).get("hyper_parallel", {}).get("code", 1))
        except (OSError, ValueError, AttributeError):
            continue
        out[other] = ProcessFailure(local_rank=other, pid=0, exitcode=code, error_file=str(path))
    return out


def launch(argv: list, nproc: int, start_method: str = "spawn", worker=None) -> int:
    """Step 3 of the module doc: start ``nproc`` ranks running the CLI on ``argv``; ``start_method``
    ``fork`` runs ``worker(argv, True)`` (the CLI's ``_train``) in forked ranks, ``spawn`` fresh
    interpreters. Returns the exit code."""
    _quiet_torchelastic()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_torchelastic()
    os.environ[LAUNCHED_ENV] = "1"
    if "OMP_NUM_THREADS" not in os.environ:   # as torchrun: one thread per rank unless told otherwise
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1, start_method=start_method, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    try:
        if start_method == "fork" and worker is None:
            raise ValueError("launch(start_method='fork') needs the worker function (cli._train)")
        if start_method == "fork":
            from .start_method import forked_rank, prepare_parent_for_fork

            prepare_parent_for_fork()
            elastic_launch(config, forked_rank)(worker, list(argv))
        else:
            elastic_launch(config, sys.executable)("-u", "-m", "hyper_parallel.trainer.cli", *argv)
    except ChildFailedError as exc:
        lines, code = summarise(_every_failure(exc.failures), nproc)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        print(f"hyper-train: stopped by {exc.sigval.name}; every rank was stopped", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0
