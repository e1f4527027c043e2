"""Warm multi-rank harness: real processes on gloo, kept alive across tests.

``RankPool(n)`` spawns ``n`` worker processes once; each initializes a gloo process group
(loopback TCP rendezvous) and then serves calls. ``pool.run(fn, *args)`` runs the importable
top-level function ``fn(*args)`` on every rank and returns the per-rank results in rank order;
``pool.outcomes(fn, ...)`` returns results or exceptions without raising. Every call has a
timeout: on expiry the pool is torn down (and re-spawned on next use) and RankTimeout is
raised, so a hung collective never hangs the test session. A rank that dies mid-call (a native
crash: abort, segfault, out of memory) is noticed while the call waits, without waiting out its
timeout: the pool is torn down and RankDied names the rank and its signal, and the rank's
stderr holds every thread's Python stack at the crash (``faulthandler``). Pass ``rank_args`` to give each
rank different arguments (e.g. a bad config on one rank).

Timeouts catch hangs, not slowness: every harness timeout (pool start, each call, the workers'
collective timeout) is multiplied by :func:`timeout_scale` — ``HYPER_PARALLEL_TEST_TIMEOUT_SCALE``,
which ``scripts/test.sh`` sets to 4 unless given — so a busy machine makes tests slower, never
red. A call that *expects* a hang (it tests the timeout itself) passes ``expect_hang=True`` and
keeps its exact timeout.

Ranks start from a forkserver that has imported torch, transformers and this package once
(``HYPER_PARALLEL_POOL_START=forkserver``, the default): a rank costs a fork, not a fresh
interpreter's imports (~3 s of CPU each), so re-spawning a pool after a failure test is cheap.
``HYPER_PARALLEL_POOL_START=spawn`` starts fresh interpreters instead. The server never runs
tensor code (no OpenMP team, no process group), so forking from it is safe.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import traceback
from typing import Any, Callable, Sequence


def timeout_scale() -> float:
    """The factor every test timeout is multiplied by (``HYPER_PARALLEL_TEST_TIMEOUT_SCALE``, >= 1)."""
    raw = os.environ.get("HYPER_PARALLEL_TEST_TIMEOUT_SCALE", "1")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"HYPER_PARALLEL_TEST_TIMEOUT_SCALE must be a number >= 1, got {raw!r}") from None
    if not value >= 1:
        raise ValueError(f"HYPER_PARALLEL_TEST_TIMEOUT_SCALE must be a number >= 1, got {raw!r}")
    return value


def scaled(seconds: float) -> float:
    """``seconds`` x :func:`timeout_scale`: the bound for anything a test waits on (subprocesses too)."""
    return seconds * timeout_scale()


#: Modules the forkserver imports once; every rank forked from it starts with them loaded.
PRELOAD = ("torch", "torch.distributed", "transformers", "hyper_parallel.distributed",
           "hyper_parallel.trainer.config", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe")
START_ENV = "HYPER_PARALLEL_POOL_START"


def start_context():
    """The multiprocessing context ranks start from (``HYPER_PARALLEL_POOL_START``: forkserver | spawn)."""
    method = os.environ.get(START_ENV, "forkserver").strip().lower() or "forkserver"
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_ENV} must be 'forkserver' or 'spawn', got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))   # read when the server starts (once per process)
    return ctx


class RankTimeout(TimeoutError):
    pass


class RankDied(RuntimeError):
    """A rank process exited (crashed) during a call without reporting a result."""

    def __init__(self, qualname: str, dead: dict[int, int | None]):
        self.dead = dead
        super().__init__(f"{qualname}: " + "; ".join(
            f"rank {r} died ({_exit_words(code)}) without a result" for r, code in sorted(dead.items()))
            + "; its own stderr (above) says why; pool torn down")


def _exit_words(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


#: How often a waiting call checks that the ranks it waits for are alive, and how long a result a
#: dead rank sent before exiting may still be in the queue's pipe (both seconds; neither bounds a call).
_LIVENESS_POLL = 1.0
_LAST_WORDS = 2.0


class MultiRankError(RuntimeError):
    def __init__(self, errors: dict[int, BaseException], tracebacks: dict[int, str]):
        self.errors = errors
        self.tracebacks = tracebacks
        body = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(tracebacks.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{body}")


class RemoteError(RuntimeError):
    """Stand-in for an exception whose class could not be pickled back."""


def _forget_earlier_tasks() -> None:
    """Each task starts with no pending collective handle: one an earlier task left behind (a test
    that fails on purpose mid-exchange) is not the next task's leak (tests assert ``pending_handles()``)."""
    comm = sys.modules.get("hyper_parallel.platform.comm")
    if comm is not None:
        comm.forget_pending_handles()


def _worker(rank: int, world: int, port: int, tasks, results, sys_path: list, env: dict) -> None:
    sys.path[:] = sys_path
    os.environ.update(env)
    import faulthandler

    faulthandler.enable(all_threads=True)   # a native crash (abort, segfault) prints every thread's Python stack
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=float(env.get("HYPER_PARALLEL_COMM_TIMEOUT", "60")))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timeout)
    results.put((rank, "ready", None, None))
    import importlib
    import pickle

    while True:
        item = tasks.get()
        if item is None:
            break
        module, qualname, args, kwargs = item
        _forget_earlier_tasks()
        try:
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            value = obj(*args, **kwargs)
            results.put((rank, "ok", value, None))
        except BaseException as exc:  # noqa: BLE001 - shipped to the parent
            tb = traceback.format_exc()
            try:
                pickle.loads(pickle.dumps(exc))
                shipped = exc
            except Exception:  # noqa: BLE001
                shipped = RemoteError(f"{type(exc).__name__}: {exc}")
            results.put((rank, "err", shipped, tb))
    dist.destroy_process_group()


def _release_subgroups(limit: int) -> int:
    from ..platform import release_subgroups

    return release_subgroups(limit)


#: Idle process groups a warm rank may keep between tests (each costs ~0.1 % of a core while idle:
#: see ``platform.release_subgroups``); past this, :meth:`RankPool.release_groups` frees them all.
GROUP_LIMIT = 24


class RankPool:
    def __init__(self, world_size: int, *, start_timeout: float = 180.0, env: dict | None = None):
        self.world_size = world_size
        self.start_timeout = scaled(start_timeout)
        self.env = {"HYPER_PARALLEL_COMM_TIMEOUT": str(scaled(60)), "OMP_NUM_THREADS": "1", **(env or {})}
        self._procs: list = []
        self._tasks: list = []
        self._results = None
        self._used = False

    def release_groups(self, limit: int = GROUP_LIMIT) -> int:
        """Between tests (no call in flight): if a rank holds more than ``limit`` process groups besides
        the world group, every rank destroys them (cached meshes are rebuilt on next use). Returns how
        many each rank destroyed (0 when the pool is not running or was not used since the last call)."""
        if not (self._used and self.alive):
            return 0
        self._used = False
        try:
            return self.run(_release_subgroups, limit, timeout=60)[0]
        except (RankTimeout, MultiRankError):
            self.shutdown()     # a group left mid-exchange by a failing test: start fresh on next use
            return 0

    # -- lifecycle -------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self.shutdown()
        from ..platform import free_port

        ctx = start_context()
        self._results = ctx.Queue()
        port = free_port()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self._tasks[r], self._results,
                                              list(sys.path), self.env), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        ready = 0
        while ready < self.world_size:
            try:
                _, status, _, _ = self._results.get(timeout=self.start_timeout)
            except queue.Empty:
                self.shutdown()
                raise RankTimeout(f"{self.world_size} ranks did not start within {self.start_timeout}s")
            ready += status == "ready"

    def shutdown(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        self._procs, self._tasks, self._results = [], [], None

    # -- calls -------------------------------------------------------------------------
    def outcomes(self, fn: Callable, *args, timeout: float = 120.0, rank_args: Sequence | None = None,
                 expect_hang: bool = False, **kwargs) -> list[Any]:
        """Run ``fn`` on all ranks; return each rank's result or exception (rank order).

        ``timeout`` is scaled by :func:`timeout_scale` unless ``expect_hang`` (the call is meant
        to hang and the test checks that the harness tears it down).
        """
        if not expect_hang:
            timeout = scaled(timeout)
        self.start()
        self._used = True
        module, qualname = fn.__module__, fn.__qualname__
        if "<locals>" in qualname:
            raise ValueError(f"{qualname} must be a module-level function to run on ranks")
        for r in range(self.world_size):
            a = tuple(rank_args[r]) if rank_args is not None else args
            self._tasks[r].put((module, qualname, a, kwargs))
        out: list[Any] = [None] * self.world_size
        tbs: dict[int, str] = {}
        got = 0
        import time

        deadline = time.monotonic() + timeout
        reported: set[int] = set()
        died_at = None
        while got < self.world_size:
            remaining = deadline - time.monotonic()
            try:
                rank, status, value, tb = self._results.get(timeout=min(max(remaining, 0.01), _LIVENESS_POLL))
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self._procs)
                        if r not in reported and not p.is_alive()}
                if dead:
                    died_at = died_at if died_at is not None else time.monotonic()
                    if time.monotonic() - died_at >= _LAST_WORDS:
                        self.shutdown()
                        raise RankDied(qualname, dead) from None
                    continue
                if remaining > _LIVENESS_POLL:
                    continue
                self.shutdown()
                raise RankTimeout(f"{qualname} did not finish on all {self.world_size} ranks within "
                                  f"{timeout}s ({got} finished); pool torn down") from None
            reported.add(rank)
            out[rank] = value
            if status == "err":
                tbs[rank] = tb
                value.__hp_traceback__ = tb
            got += 1
        if tbs and len(tbs) != self.world_size:
            # Some ranks failed while others finished: their collectives may be out of step.
            self.shutdown()
        return out

    def run(self, fn: Callable, *args, timeout: float = 120.0, rank_args: Sequence | None = None,
            expect_hang: bool = False, **kwargs) -> list[Any]:
        """Run ``fn`` on all ranks; raise MultiRankError if any rank raised."""
        res = self.outcomes(fn, *args, timeout=timeout, rank_args=rank_args, expect_hang=expect_hang,
                            **kwargs)
        errors = {r: v for r, v in enumerate(res) if isinstance(v, BaseException)}
        if errors:
            raise MultiRankError(errors, {r: getattr(e, "__hp_traceback__", repr(e)) for r, e in errors.items()})
        return res
