"""The CP batch context across a Trainer step: set at the forward, kept through the backward.

Hugging Face's Trainer runs ``compute_loss`` (the forward) and ``accelerator.backward`` separately,
so a ``with cp_batch_context(meta)`` around the forward would be gone when activation
checkpointing recomputes a layer (and its CP attention) in the backward. :func:`activate` makes
``meta`` this thread's current CP batch until the next :func:`activate` or :func:`release` — the
next micro-batch's forward replaces it, so the backward of micro-batch ``i`` always sees
micro-batch ``i``'s meta. The autograd engine runs CPU backward in the calling thread; the
library's CUDA/NPU backward kernels take their meta from the saved forward state.
"""
from __future__ import annotations

import threading

from ...distributed.context_parallel.meta import cp_batch_context


class _Sticky(threading.local):
    def __init__(self):
        self.meta = None
        self.ctx = None


_STATE = _Sticky()


def activate(meta) -> None:
    """Make ``meta`` the current CP batch meta of this thread (replacing the previous one)."""
    if _STATE.meta is meta:
        return
    release()
    ctx = cp_batch_context(meta)
    ctx.__enter__()
    _STATE.meta, _STATE.ctx = meta, ctx


def release() -> None:
    """Leave the context :func:`activate` entered (no-op when none)."""
    ctx = _STATE.ctx
    _STATE.meta = _STATE.ctx = None
    if ctx is not None:
        ctx.__exit__(None, None, None)
