"""What the applier tells a wrapper while it is installed (:func:`applying`,
:func:`current_apply_context`: module FQN and mode, thread-local)."""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Optional


@dataclasses.dataclass(frozen=True)
class ApplyContext:
    """What the applier tells a wrapper while it is being installed (read at wrap time)."""

    fqn: Optional[str] = None          # FQN of the module the wrapper is installed on
    mode: str = "production"           # "production" | "validate"


class _ApplyTLS(threading.local):
    def __init__(self):
        self.stack: list[ApplyContext] = []


_APPLY_TLS = _ApplyTLS()


@contextlib.contextmanager
def applying(fqn: Optional[str], mode: str = "production"):
    """Set the :class:`ApplyContext` seen by wrappers installed in the body (this thread)."""
    if mode not in ("production", "validate"):
        raise ValueError(f"mode must be 'production' or 'validate', got {mode!r}")
    _APPLY_TLS.stack.append(ApplyContext(fqn, mode))
    try:
        yield _APPLY_TLS.stack[-1]
    finally:
        _APPLY_TLS.stack.pop()


def current_apply_context() -> ApplyContext:
    return _APPLY_TLS.stack[-1] if _APPLY_TLS.stack else ApplyContext()
