"""Cross-rank fail-fast: a bad config on one rank fails every rank promptly, never hangs.

Each rank runs its local checks (no collectives inside), then all ranks exchange outcomes in
one object all-gather that every rank is guaranteed to reach. If any rank failed, every rank
raises: the failing rank re-raises its own error, the others raise :class:`PreflightError`
naming the failing rank(s) and their messages.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch.distributed as dist

from ..platform import all_gather_object
from .errors import PreflightError

T = TypeVar("T")


def agree_or_raise(check: Callable[[], T], what: str = "preflight", group=None) -> T:
    """Run ``check()`` on every rank; if it raised anywhere, raise everywhere."""
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
    outcome = None if error is None else f"{type(error).__name__}: {error}"
    outcomes = all_gather_object(outcome, group=group)
    failed = [(r, msg) for r, msg in enumerate(outcomes) if msg is not None]
    if failed:
        if error is not None:
            raise error
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise PreflightError(f"{what} failed on {len(failed)} rank(s): {detail}")
    return result
