"""Collectives: the only module in hyper_parallel that calls torch.distributed collectives.

Every function takes an explicit ``group`` (a ProcessGroup cached from the root DeviceMesh;
never created here) and works on local tensors. ``async_op=True`` returns a :class:`CommHandle`
whose ``wait()`` materializes the result; sync calls are launch + wait. Every wait has a
timeout (``HYPER_PARALLEL_COMM_TIMEOUT`` seconds, default 300) so no rank hangs forever, and a
failed wait raises a typed :class:`~hyper_parallel.platform.peer.CollectiveError` naming the
collective, its group (global ranks) and the elapsed time: :class:`CommTimeoutError` when a peer
did not answer in time, :class:`PeerLostError` when the backend lost the connection to it.
A group of size 1 is the identity: no collective is issued and nothing is counted.

Byte accounting (:func:`comm_counter`) records, per call and per rank, the logical bytes this
rank sends to and receives from *other* ranks (its own chunk excluded):
  all_gather   (input n bytes, W ranks): sent = recv = n*(W-1)
  reduce_scatter (input n bytes):        sent = recv = n*(W-1)/W
  all_to_all   (input n bytes):          sent = recv = n*(W-1)/W
  all_reduce   (n bytes, ring):          sent = recv = 2*n*(W-1)/W
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist


from . import simlink as _simlink
from .release import release_temporaries
from .peer import TIMEOUT, CollectiveError, CommTimeoutError, PeerLostError, classify_failure, group_ranks_of


_CONFIGURED_TIMEOUT: Optional[datetime.timedelta] = None


def set_default_timeout(seconds: Optional[float]) -> None:
    """Set the process-wide collective timeout (``accelerator.comm_timeout_s``).

    ``None`` restores the environment default. Takes effect for every later
    :class:`CommHandle`, :func:`barrier` and every process group created afterwards by the mesh
    (``MeshContext`` passes it as backend options); a process group that already exists keeps
    the timeout it was created with.
    """
    global _CONFIGURED_TIMEOUT
    if seconds is None:
        _CONFIGURED_TIMEOUT = None
        return
    seconds = float(seconds)
    if not seconds > 0:
        raise ValueError(f"collective timeout must be > 0 seconds, got {seconds}")
    _CONFIGURED_TIMEOUT = datetime.timedelta(seconds=seconds)


def default_timeout() -> datetime.timedelta:
    """The timeout of every hyper_parallel collective wait: the value given to
    :func:`set_default_timeout` if any, else ``HYPER_PARALLEL_COMM_TIMEOUT`` seconds (300)."""
    if _CONFIGURED_TIMEOUT is not None:
        return _CONFIGURED_TIMEOUT
    return datetime.timedelta(seconds=float(os.environ.get("HYPER_PARALLEL_COMM_TIMEOUT", "300")))


# ----------------------------------------------------------------------------- accounting
@dataclasses.dataclass
class CommRecord:
    op: str
    group_size: int
    bytes_sent: int
    bytes_received: int
    tag: str = ""


class _Counter:
    """Process-wide (collectives issued by the async chain thread are counted too)."""

    def __init__(self):
        self.stack: list[list[CommRecord]] = []
        self.lock = threading.Lock()


_COUNTER = _Counter()


@contextlib.contextmanager
def comm_counter():
    """Collect a :class:`CommRecord` for every collective issued in the body (any thread)."""
    records: list[CommRecord] = []
    with _COUNTER.lock:
        _COUNTER.stack.append(records)
    try:
        yield records
    finally:
        with _COUNTER.lock:
            _COUNTER.stack.remove(records)


def _record(op: str, world: int, sent: float, recv: float, tag: str) -> Optional[float]:
    """Count the collective; return when it completes on the simulated link (None: link off)."""
    with _COUNTER.lock:
        for records in _COUNTER.stack:
            records.append(CommRecord(op, world, int(sent), int(recv), tag))
    return _simlink.reserve(int(max(sent, recv)))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ----------------------------------------------------------------------------- handles
class CommHandle:
    """An in-flight collective. ``wait()`` blocks (with timeout) and returns the result tensor.

    Waiting twice returns the cached result; a handle that is never waited is reported by
    :func:`pending_handles` (tests assert no handle dangles after forward/backward).
    """

    def __init__(self, op: str, work, finalize: Callable[[], torch.Tensor], timeout=None, group=None,
                 ready_at: Optional[float] = None, temps: tuple = ()):
        self.op = op
        self._temps = temps              # buffers created for the backend, freed once finalized (release.py)
        self._ready_at = ready_at        # simulated link (platform/simlink.py): wait() blocks until then
        self.group = group
        self._t0 = time.monotonic()
        self._work = work
        self._finalize = finalize
        self._timeout = timeout or default_timeout()
        self._result: Optional[torch.Tensor] = None
        self._done = False
        if work is not None:
            _PENDING.add(self)

    def wait(self) -> torch.Tensor:
        if not self._done:
            t_wait = time.monotonic()
            if self._work is not None:
                try:
                    ok = self._work.wait(timeout=self._timeout)
                except RuntimeError as exc:  # gloo raises on timeout / peer failure
                    _PENDING.discard(self)
                    if isinstance(exc, CollectiveError):   # from a chain step: already typed
                        raise
                    raise peer_error(self.op, self.group, self._t0, self._timeout, exc) from exc
                if ok is False:
                    _PENDING.discard(self)
                    raise peer_error(self.op, self.group, self._t0, self._timeout)
                _PENDING.discard(self)
            _simlink.settle(self._ready_at)     # on the thread that waits: the comm thread for async CP
            _simlink.note_wait(time.monotonic() - t_wait)
            self._result = self._finalize()
            release_temporaries(self._temps, keep=self._result)
            self._work = self._finalize = None      # nothing here keeps the backend's buffers alive
            self._temps = ()
            self._done = True
        return self._result

    @property
    def done(self) -> bool:
        return self._done


_PENDING: set = set()


def pending_handles() -> int:
    """Number of launched collectives whose handle has not been waited."""
    return len(_PENDING)


def forget_pending_handles() -> None:
    """Stop counting every handle launched so far (a test harness starting an unrelated task after
    one that failed mid-exchange on purpose); the collectives themselves are not touched."""
    _PENDING.clear()


def drain_chain_thread() -> None:
    """Return once the chain thread (:func:`launch_chain`) has released everything its finished
    chains referenced (inputs, intermediates): it runs FIFO and drops a chain before taking the
    next, so a no-op submitted now runs after that. Local to this process, no collective."""
    if _CHAIN is not None:
        _CHAIN.submit(lambda: None).result()


def peer_error(op: str, group, t0: float, timeout: datetime.timedelta,
               exc: Optional[BaseException] = None) -> CollectiveError:
    """The typed error of collective ``op`` on ``group`` launched at ``t0`` (``time.monotonic``)
    whose wait failed with ``exc`` (None: the wait returned "not completed" after ``timeout``).
    A closed/reset connection is :class:`PeerLostError`; anything else, a timeout included, is
    :class:`CommTimeoutError` (the peer did not complete its side in time)."""
    cls = PeerLostError if exc is not None and classify_failure(str(exc)) == "peer_lost" else CommTimeoutError
    rank = dist.get_rank() if dist.is_initialized() else None
    text = "" if exc is None else str(exc).strip()
    detail = text.splitlines()[0] if text else ("" if exc is None else type(exc).__name__)
    return cls(op, group_ranks=group_ranks_of(group), elapsed_s=time.monotonic() - t0,
               timeout_s=timeout.total_seconds(), rank=rank, detail=detail)


def _launch(op: str, group, fn):
    """Issue a collective; a backend error raised at launch becomes the typed error too."""
    t0 = time.monotonic()
    try:
        return fn()
    except RuntimeError as exc:
        if isinstance(exc, CollectiveError) or classify_failure(str(exc)) is None:
            raise
        raise peer_error(op, group, t0, default_timeout(), exc) from exc


def _ready(result: torch.Tensor, op: str) -> CommHandle:
    return CommHandle(op, None, lambda: result)


def group_size(group) -> int:
    """Ranks in ``group``; a ``None`` group is a group of one (no collective is issued)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group`` (0 for a ``None`` group)."""
    return 0 if group is None else dist.get_rank(group)


# ----------------------------------------------------------------------------- collectives
# torch >= 2.13 names the flat-tensor collectives *_single; older releases *_into_tensor/_tensor.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

def all_gather(x: torch.Tensor, group, dim: int = 0, async_op: bool = False, tag: str = ""):
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order."""
    world = group_size(group)
    if world == 1:
        return _ready(x, "all_gather") if async_op else x
    xc = x.contiguous()
    flat = torch.empty(world * xc.numel(), dtype=xc.dtype, device=xc.device)
    work = _launch("all_gather", group, lambda: _ALL_GATHER(flat, xc.view(-1), group=group, async_op=True))
    ready = _record("all_gather", world, _nbytes(xc) * (world - 1), _nbytes(xc) * (world - 1), tag)
    d = dim % x.dim()
    handle = CommHandle("all_gather", work,
                        lambda: torch.cat(flat.view((world,) + tuple(xc.shape)).unbind(0), dim=d), group=group,
                        ready_at=ready, temps=(flat,) + ((xc,) if xc is not x else ()))
    return handle if async_op else handle.wait()


def reduce_scatter(x: torch.Tensor, group, dim: int = 0, op=dist.ReduceOp.SUM,
                   async_op: bool = False, tag: str = ""):
    """Sum ``x`` over the group and return this rank's ``dim``-chunk (inverse of all_gather)."""
    world = group_size(group)
    if world == 1:
        return _ready(x, "reduce_scatter") if async_op else x
    d = dim % x.dim()
    if x.shape[d] % world:
        raise ValueError(f"reduce_scatter: dim {d} of size {x.shape[d]} is not divisible by group size {world}")
    stacked = torch.stack(x.chunk(world, dim=d), dim=0).contiguous()
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    work = _launch("reduce_scatter", group,
                   lambda: _REDUCE_SCATTER(out.view(-1), stacked.view(-1), op=op, group=group, async_op=True))
    n = _nbytes(stacked)
    ready = _record("reduce_scatter", world, n * (world - 1) / world, n * (world - 1) / world, tag)
    handle = CommHandle("reduce_scatter", work, lambda: out, group=group, ready_at=ready, temps=(stacked,))
    return handle if async_op else handle.wait()


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int,
               async_op: bool = False, tag: str = ""):
    """Split ``x`` along ``scatter_dim`` into W chunks, send chunk j to rank j, and
    concatenate the received chunks along ``gather_dim`` in group-rank order."""
    world = group_size(group)
    if world == 1:
        return _ready(x, "all_to_all") if async_op else x
    sd, gd = scatter_dim % x.dim(), gather_dim % x.dim()
    if x.shape[sd] % world:
        raise ValueError(
            f"all_to_all: scatter dim {sd} of size {x.shape[sd]} is not divisible by group size {world}"
        )
    stacked = torch.stack(x.chunk(world, dim=sd), dim=0).contiguous()
    out = torch.empty_like(stacked)
    work = _launch("all_to_all", group, lambda: dist.all_to_all_single(out, stacked, group=group, async_op=True))
    n = _nbytes(stacked)
    ready = _record("all_to_all", world, n * (world - 1) / world, n * (world - 1) / world, tag)
    handle = CommHandle("all_to_all", work, lambda: torch.cat(out.unbind(0), dim=gd), group=group, ready_at=ready,
                        temps=(stacked, out))
    return handle if async_op else handle.wait()


def all_to_all_uneven(x: torch.Tensor, group, send_counts, recv_counts, dim: int,
                      async_op: bool = False, tag: str = "", piece: int | None = None):
    """Exchange equal-size pieces along ``dim`` with per-peer counts (a sparse permutation).

    ``x`` holds ``sum(send_counts)`` pieces: the first ``send_counts[0]`` go to rank 0, the
    next ``send_counts[1]`` to rank 1, ... The result holds ``sum(recv_counts)`` pieces,
    ``recv_counts[s]`` from rank s, in source-rank order. Only pieces for other ranks count
    as moved bytes (pieces a rank keeps for itself are not sent anywhere). ``piece``: the size
    of one piece along ``dim`` (default: ``x``'s size over the pieces sent); give it when a rank
    may send nothing (token rows routed to experts: any count may be zero).
    """
    world = group_size(group)
    send_counts, recv_counts = list(send_counts), list(recv_counts)
    if len(send_counts) != world or len(recv_counts) != world:
        raise ValueError(f"all_to_all_uneven: need {world} send/recv counts, got {len(send_counts)}/{len(recv_counts)}")
    d = dim % x.dim()
    n_send = sum(send_counts)
    if piece is None:
        if n_send == 0 or x.shape[d] % n_send:
            raise ValueError(f"all_to_all_uneven: dim {d} of size {x.shape[d]} is not {n_send} equal pieces")
        piece = x.shape[d] // n_send
    elif piece < 1 or x.shape[d] != n_send * piece:
        raise ValueError(f"all_to_all_uneven: dim {d} of size {x.shape[d]} is not {n_send} pieces of {piece}")
    if world == 1:
        return _ready(x, "all_to_all_uneven") if async_op else x
    xt = x.movedim(d, 0).contiguous()
    if xt.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        xt = xt.clone()     # the backend holds only platform buffers (release.py), never the caller's
    out = xt.new_empty((sum(recv_counts) * piece,) + tuple(xt.shape[1:]))
    work = _launch("all_to_all_uneven", group, lambda: dist.all_to_all_single(
        out, xt, output_split_sizes=[c * piece for c in recv_counts],
        input_split_sizes=[c * piece for c in send_counts], group=group, async_op=True))
    me = group_rank(group)
    pb = piece * math.prod(xt.shape[1:]) * xt.element_size()     # bytes of one piece (x may be empty)
    ready = _record("all_to_all", world, pb * (n_send - send_counts[me]), pb * (sum(recv_counts) - recv_counts[me]),
                    tag)
    handle = CommHandle("all_to_all_uneven", work, lambda: out.movedim(0, d), group=group, ready_at=ready,
                        temps=(xt,))
    return handle if async_op else handle.wait()


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False, tag: str = ""):
    """Out-of-place all-reduce (the input is not modified)."""
    world = group_size(group)
    if world == 1:
        return _ready(x, "all_reduce") if async_op else x
    out = x.detach().clone().contiguous()
    work = _launch("all_reduce", group, lambda: dist.all_reduce(out, op=op, group=group, async_op=True))
    n = _nbytes(out)
    ready = _record("all_reduce", world, 2 * n * (world - 1) / world, 2 * n * (world - 1) / world, tag)
    handle = CommHandle("all_reduce", work, lambda: out, group=group, ready_at=ready)
    return handle if async_op else handle.wait()


def all_gather_object(obj, group=None) -> list:
    """Gather a picklable object from every rank of ``group`` (default: world)."""
    if not dist.is_initialized() or group_size(group if group is not None else dist.group.WORLD) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    t0 = time.monotonic()
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as exc:
        if isinstance(exc, CollectiveError) or classify_failure(str(exc)) is None:
            raise
        raise peer_error("all_gather_object", group, t0, default_timeout(), exc) from exc
    return out


def barrier(group=None) -> None:
    """Block until every rank of ``group`` (default: world) arrives; raises
    :class:`CommTimeoutError` after :func:`default_timeout` instead of hanging."""
    if not dist.is_initialized() or group_size(group if group is not None else dist.group.WORLD) == 1:
        return
    work = _launch("barrier", group, lambda: dist.barrier(group=group, async_op=True))
    CommHandle("barrier", work, lambda: None, group=group).wait()


# ----------------------------------------------------------------------------- dependency chains
class _FutureWork:
    """Adapts a concurrent.futures.Future to the Work.wait(timeout) protocol."""

    def __init__(self, fut):
        self._fut = fut

    def wait(self, timeout=None):
        import concurrent.futures

        try:
            self._fut.result(timeout=None if timeout is None else timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            return False
        except CollectiveError:   # a chain step's collective failed: keep its op/group/elapsed
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced as RuntimeError to CommHandle.wait
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
        return True


class _ChainWorker:
    """One FIFO thread per process that runs dependent collective chains.

    All ranks submit the same chains in the same program order, and the single thread
    executes them in submission order, so the collective order on every group is identical
    across ranks while the main thread keeps computing (real overlap on CPU/gloo). On
    CUDA/NPU the collectives inside a chain run on the backend's own comm stream.
    """

    def __init__(self):
        import concurrent.futures

        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hp-comm-chain")

    def submit(self, fn):
        return self._pool.submit(fn)


_CHAIN: _ChainWorker | None = None


def launch_chain(x: torch.Tensor, steps, op: str = "chain") -> CommHandle:
    """Run ``steps`` (callables tensor -> tensor, each issuing *sync* platform collectives)
    one after another on the chain thread, starting from ``x``; return a handle whose
    ``wait()`` yields the last step's output. Use for collectives with a data dependency
    (Hybrid: Ulysses A2A, then Colossal AllGather) that must not block the caller."""
    global _CHAIN
    if _CHAIN is None:
        _CHAIN = _ChainWorker()
    src = x.detach()

    def run():
        y = src
        for step in steps:
            y = step(y)
        return y

    fut = _CHAIN.submit(run)
    return CommHandle(op, _FutureWork(fut), fut.result)
