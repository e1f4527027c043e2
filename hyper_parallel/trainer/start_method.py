"""How ``hyper-train`` starts its ranks: forked from the checked parent (CPU) or spawned afresh.

Rule (:func:`choose`, made before any rank starts; a bad value is a one-line refusal, exit 2):

* ``HYPER_PARALLEL_START_METHOD`` (:data:`ENV`) = ``auto`` or unset: fork when allowed (below),
  else spawn; ``fork``: fork, refused when fork is not allowed; ``spawn``: spawn.
* fork is allowed only on Linux, with no accelerator on the machine (``torch.accelerator``, CUDA,
  NPU: a forked child of a process that touched a device driver is not safe, so GPU/NPU machines
  always spawn) and ``accelerator.device_type`` null or ``cpu``.

A forked rank (:func:`forked_rank`) runs the CLI's worker path (``cli._train``, handed over, as ``python -m
hyper_parallel.trainer.cli`` does inside a torchrun rank) without paying ``import torch,
transformers`` again. It is started by torchelastic's ``MultiprocessContext``: torchelastic sets
the rank's environment (RANK, LOCAL_RANK, TORCHELASTIC_ERROR_FILE, ...), ``@record`` wraps the
function, and the rank's one failure line goes to its error file exactly as in a spawned rank
(:mod:`.failures`); stdout/stderr are the parent's, as for spawned ranks (no redirects).

Fork safety: what the parent has run when it forks (checked; docs/trainer.md "Starting ranks"):
the config, tokenizer and data checks and the model on the meta device
(:func:`.launch.check_before_launch`), which runs under ``torch.set_num_threads(1)`` (see
:func:`serial_threads`), so libgomp never starts its thread team in the parent (a team made
before fork is dead in the child and its next parallel region would hang); no autograd backward,
no device initialisation. Threads alive at fork and not needed by a rank: OpenBLAS's idle
servers (numpy, scipy; OpenBLAS re-creates them after fork through its own ``pthread_atfork``),
the rendezvous ``TCPStore`` server (the ranks are its clients, over TCP), the tokenizers' Rayon
pool (its threads do not exist in the child: the ranks get ``TOKENIZERS_PARALLELISM=false``;
the data was tokenized by the parent already). The parent's stdio buffers are flushed before the
fork. The rank sets its own thread count (``OMP_NUM_THREADS``, as a spawned rank reads it).
"""
from __future__ import annotations

import contextlib
import os
import sys

ENV = "HYPER_PARALLEL_START_METHOD"
CHOICES = ("auto", "fork", "spawn")
_STARTED_BY: list = []   # ["fork"] once :func:`forked_rank` runs in this process


def _fork_blocker(device_type) -> str | None:
    """Why fork is not allowed here, or None."""
    if not sys.platform.startswith("linux"):
        return f"fork is only used on Linux (this is {sys.platform})"
    if device_type not in (None, "cpu"):
        return f"accelerator.device_type is {device_type!r}"
    import torch

    from ..platform.device import detect_device_type

    accel = getattr(torch, "accelerator", None)
    if (accel is not None and accel.is_available()) or detect_device_type() != "cpu":
        return "this machine has an accelerator"
    return None


def choose(cfg) -> str:
    """``"fork"`` or ``"spawn"`` for the ranks of ``cfg`` (module doc). Raises CPConfigError
    naming :data:`ENV` for a bad value or a fork that is not allowed."""
    from ..distributed.errors import CPConfigError

    asked = os.environ.get(ENV, "auto").strip().lower() or "auto"   # unset: auto (see module doc)
    if asked not in CHOICES:
        raise CPConfigError(ENV, f"{asked!r} is not one of {', '.join(CHOICES)}",
                            fix=f"set {ENV}=auto (fork on CPU-only machines, else spawn) or unset it")
    if asked == "spawn":
        return "spawn"
    blocker = _fork_blocker(cfg.accelerator.device_type)
    if blocker is None:
        return "fork"
    if asked == "fork":
        raise CPConfigError(ENV, f"fork is not safe here: {blocker}", fix=f"unset {ENV} or set it to spawn")
    return "spawn"


@contextlib.contextmanager
def serial_threads():
    """Run the block with one intra-op thread (no OpenMP/MKL thread team is created), then restore."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def prepare_parent_for_fork() -> None:
    """In the parent, right before the ranks are forked (module doc)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # read by tokenizers' at-fork handler in the child
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def forked_rank(worker, argv: list) -> int:
    """A rank forked from ``hyper-train``: its thread count, then ``worker(argv, True)`` (the CLI's
    worker path, ``cli._train``, handed over by the CLI: no fork needs pickling). Returns its code
    (0; an error ends the process inside ``_train`` with its exit code)."""
    import torch

    try:
        sys.stdout.reconfigure(line_buffering=True)   # as ``python -u`` for a spawned rank
    except (AttributeError, ValueError):
        pass
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))   # a spawned rank's OpenMP reads this at start-up
    _STARTED_BY[:] = ["fork"]
    return worker(list(argv), True)


def origin_line() -> str:
    """``rank started by fork|spawn (pid P, parent pid Q)`` for a rank ``hyper-train`` started (logged at INFO)."""
    return f"rank started by {(_STARTED_BY or ['spawn'])[0]} (pid {os.getpid()}, parent pid {os.getppid()})"
