"""Cross-rank fail-fast: a bad config on one rank fails every rank promptly, never hangs.

Each rank runs its local checks (no collectives inside), then all ranks exchange outcomes in
one object all-gather that every rank is guaranteed to reach. If any rank failed, every rank
raises: the failing rank re-raises its own error, the others raise :class:`PreflightError`
naming the failing rank(s) and their messages — or, with ``same_error=True``, every rank raises
the lowest failing rank's error, so each prints the same one line (checkpoint checks).
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch.distributed as dist

from ..platform import all_gather_object
from .errors import CPConfigError, PreflightError

T = TypeVar("T")


def agree_or_raise(check: Callable[[], T], what: str = "preflight", group=None, *, same_error: bool = False) -> T:
    """Run ``check()`` on every rank; if it raised anywhere, raise everywhere (module doc).

    ``same_error``: every rank raises the lowest failing rank's error — a :class:`CPConfigError`
    as it is, anything else as :class:`PreflightError` text naming that rank."""
    error: BaseException | None = None
    result = None
    try:
        result = check()
    except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
        error = exc
    if not dist.is_initialized():
        if error is not None:
            raise error
        return result
    if same_error:
        rank = dist.get_rank()
        payload = None
        if error is not None:
            payload = error if isinstance(error, CPConfigError) else \
                PreflightError(f"{what} failed on rank {rank}: {type(error).__name__}: {error}")
        failed = [(r, e) for r, e in enumerate(all_gather_object(payload, group=group)) if e is not None]
        if failed:
            first_rank, first = failed[0]
            raise (payload if first_rank == rank else first)
        return result
    outcome = None if error is None else f"{type(error).__name__}: {error}"
    outcomes = all_gather_object(outcome, group=group)
    failed = [(r, msg) for r, msg in enumerate(outcomes) if msg is not None]
    if failed:
        if error is not None:
            raise error
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise PreflightError(f"{what} failed on {len(failed)} rank(s): {detail}")
    return result
