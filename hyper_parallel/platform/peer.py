"""A collective that fails because a peer rank stopped or died: typed errors and the diagnosis.

Contract:

* Every hyper_parallel collective (``platform/comm.py``) raises a :class:`CollectiveError`
  subclass when its wait fails: :class:`CommTimeoutError` (alias :data:`PeerTimeoutError`) when
  the peer did not answer within the timeout (frozen, SIGSTOPped, hung, or far too slow),
  :class:`PeerLostError` when the backend reports a closed/reset connection (the peer process
  died: killed, crashed, out of memory). Both carry ``op``, ``group_ranks`` (global ranks),
  ``elapsed_s``, ``timeout_s`` and ``rank``; ``str()`` starts with ``collective <op>``.
* Collectives that do not pass through the platform layer (FSDP2, DTensor, DCP call
  ``torch.distributed`` themselves) raise the backend's raw ``RuntimeError``/``DistBackendError``.
  :func:`diagnose` turns either kind into a :class:`PeerFailure`: the cause from the message
  (:func:`classify_failure`), the collective and its group from the traceback's innermost
  ``torch.distributed`` frame (:func:`locate_collective`), the elapsed time from the error or
  the backend's ``Timed out waiting <N>ms``. Anything else is not a peer failure (``None``).
* :meth:`PeerFailure.one_line` is the single line a user sees (no newline), e.g.::

    rank 0: collective all_gather_single on group [0, 1] (global ranks) timed out after 10.0 s
    - likely cause: peer rank 1 stopped responding (frozen/SIGSTOP, hung or overloaded) or died
"""
from __future__ import annotations

import dataclasses
import re
import types
from typing import Iterable, Optional

TIMEOUT = "timeout"
PEER_LOST = "peer_lost"

# Backend messages (gloo, TCPStore, NCCL/HCCL) of a peer that is gone: checked before timeouts,
# because a reset connection is the more specific diagnosis.
_PEER_LOST_RE = re.compile(
    r"connection closed by peer|connection reset|reset by peer|broken pipe|econnreset|epipe"
    r"|connection refused|socket closed|remote process exited|peer closed|closed by remote"
    r"|failed to recv, got 0 bytes|communicator was aborted|nccl error.*remote",
    re.IGNORECASE)
_TIMEOUT_RE = re.compile(
    r"timed out|timeout|deadline exceeded|watchdog caught collective operation", re.IGNORECASE)
_TIMEOUT_MS_RE = re.compile(r"timed out waiting\s*(\d+)\s*ms|timeout\(ms\)\s*=\s*(\d+)", re.IGNORECASE)


class CollectiveError(RuntimeError):
    """A collective failed because of a peer; see the module doc for the fields."""

    cause = ""

    def __init__(self, op: str, *, group_ranks: Optional[list] = None, elapsed_s: Optional[float] = None,
                 timeout_s: Optional[float] = None, rank: Optional[int] = None, detail: str = ""):
        self.op = op
        self.group_ranks = None if group_ranks is None else list(group_ranks)
        self.elapsed_s = elapsed_s
        self.timeout_s = timeout_s
        self.rank = rank
        self.detail = detail
        super().__init__(self._message())

    def _message(self) -> str:
        f = self.failure()
        msg = f"collective {self.op}{f.where()} {f.what()}"
        return msg + (f": {self.detail}" if self.detail else "")

    def failure(self) -> "PeerFailure":
        return PeerFailure(self.cause, self.op, self.group_ranks, self.elapsed_s, self.rank,
                           self.timeout_s, _first_line(self.detail))

    def __reduce__(self):  # picklable across ranks (keyword-only fields)
        return (_rebuild, (type(self), self.op, self.group_ranks, self.elapsed_s, self.timeout_s,
                           self.rank, self.detail))


def _rebuild(cls, op, group_ranks, elapsed_s, timeout_s, rank, detail):
    return cls(op, group_ranks=group_ranks, elapsed_s=elapsed_s, timeout_s=timeout_s, rank=rank, detail=detail)


class CommTimeoutError(CollectiveError):
    """A collective did not complete within the configured timeout (a peer stopped answering)."""

    cause = TIMEOUT


PeerTimeoutError = CommTimeoutError


class PeerLostError(CollectiveError):
    """The backend lost its connection to a peer during a collective (the peer process died)."""

    cause = PEER_LOST


@dataclasses.dataclass
class PeerFailure:
    """What a user needs to know about a collective that failed because of a peer."""

    cause: str                          # TIMEOUT or PEER_LOST
    op: Optional[str] = None            # collective name, None if unknown
    group_ranks: Optional[list] = None  # global ranks of its group, None if unknown
    elapsed_s: Optional[float] = None
    rank: Optional[int] = None          # this process's global rank
    timeout_s: Optional[float] = None
    detail: str = ""                    # the backend's message (first line)

    def where(self) -> str:
        return "" if self.group_ranks is None else f" on group {self.group_ranks} (global ranks)"

    def what(self) -> str:
        after = "" if self.elapsed_s is None else f" after {self.elapsed_s:.1f} s"
        if self.cause == TIMEOUT:
            return f"timed out{after}"
        return f"failed{after}: the connection to a peer was closed"

    def peers(self) -> str:
        if self.group_ranks is None:
            return "a peer rank"
        others = [r for r in self.group_ranks if r != self.rank]
        if len(others) == 1:
            return f"peer rank {others[0]}"
        return f"a peer rank among {others}"

    def one_line(self) -> str:
        """The diagnosis on one line (no newline): collective, group, elapsed time, likely cause."""
        who = "" if self.rank is None else f"rank {self.rank}: "
        op = "a collective" if self.op is None else f"collective {self.op}"
        if self.cause == TIMEOUT:
            cause = f"{self.peers()} stopped responding (frozen/SIGSTOP, hung or overloaded) or died"
        else:
            cause = f"{self.peers()} died (killed, crashed or out of memory)"
        return f"{who}{op}{self.where()} {self.what()} - likely cause: {cause}"


def classify_failure(message: str) -> Optional[str]:
    """``PEER_LOST`` for a closed/reset connection, ``TIMEOUT`` for a timed-out wait, else None."""
    if _PEER_LOST_RE.search(message):
        return PEER_LOST
    if _TIMEOUT_RE.search(message):
        return TIMEOUT
    return None


def timeout_from_message(message: str) -> Optional[float]:
    """Seconds from a backend message such as ``Timed out waiting 10000ms``; None if absent."""
    m = _TIMEOUT_MS_RE.search(message)
    return None if m is None else int(m.group(1) or m.group(2)) / 1000.0


def group_ranks_of(group) -> Optional[list]:
    """Global ranks of a ProcessGroup / group name / DeviceMesh / rank list; None if unknown.
    ``None`` means the default (world) group."""
    if isinstance(group, (list, tuple)) and all(isinstance(r, int) for r in group):
        return list(group)
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        if group is None:
            return list(range(dist.get_world_size()))
        if hasattr(group, "mesh") and hasattr(group, "get_group"):   # DeviceMesh
            return [int(r) for r in group.mesh.flatten().tolist()]
        if isinstance(group, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(group)
        return list(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a diagnosis must never fail
        return None


def _frames_of_traceback(tb: Optional[types.TracebackType]) -> list:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames[::-1]   # innermost first


def frames_of_stack(frame: Optional[types.FrameType]) -> list:
    """A live stack (``sys._current_frames()[tid]``), innermost first."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def locate_collective(frames: Iterable[types.FrameType]):
    """(op, group_ranks) of the innermost public ``torch.distributed`` function in ``frames``
    (innermost first), e.g. ``("all_gather_single", [0, 1])``; (None, None) if there is none."""
    for frame in frames:
        path = frame.f_code.co_filename.replace("\\", "/")
        name = frame.f_code.co_name
        if "torch/distributed/" not in path or name.startswith("_") or name in ("wrapper", "wait"):
            continue
        if not (path.endswith("distributed_c10d.py") or path.endswith("_functional_collectives.py")):
            continue
        f_locals = frame.f_locals
        group = f_locals.get("group", f_locals.get("group_name"))
        return name, group_ranks_of(group)
    return None, None


def _first_line(text: str) -> str:
    text = str(text).strip()
    return text.splitlines()[0] if text else ""


def _chain(exc: BaseException, seen=None):
    """``exc``, its causes/contexts, and the per-rank exceptions a DCP ``CheckpointException``
    wraps in ``.failures`` ({rank: (exception, stack summary)})."""
    seen = set() if seen is None else seen
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for wrapped in failures.values():
                inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
                if isinstance(inner, BaseException):
                    yield from _chain(inner, seen)
        exc = exc.__cause__ or exc.__context__


def diagnose(exc: BaseException, rank: Optional[int] = None) -> Optional[PeerFailure]:
    """The :class:`PeerFailure` behind ``exc`` (a typed platform error, or a raw backend error
    from FSDP2/DTensor/DCP, anywhere in its cause/context chain); None if it is not one."""
    for e in _chain(exc):
        if isinstance(e, CollectiveError):
            f = e.failure()
            if f.rank is None:
                f.rank = rank
            return f
    for e in _chain(exc):
        if not isinstance(e, RuntimeError):
            continue
        text = str(e)
        cause = classify_failure(text)
        if cause is None:
            continue
        op, ranks = locate_collective(_frames_of_traceback(e.__traceback__))
        t = timeout_from_message(text) if cause == TIMEOUT else None
        return PeerFailure(cause, op, ranks, t, rank, t, _first_line(text))
    return None
