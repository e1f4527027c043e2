"""Async CP primitives: launch at a handoff, wait at the consumer, mirrored in backward.

An :class:`AsyncCollective` is created per attention invocation and per tensor (K, V, and for
the pipelined query side of Ulysses / Hybrid / Head-Tail each query chunk and each output chunk).
It owns two platform collectives: ``forward_comm`` (launched by :meth:`launch` at the safe
handoff point, right after the tensor's projection/norm/RoPE) and ``backward_comm`` (the
inverse, launched when the consumer's gradient arrives). Autograd contract::

    forward:  x_local --launch()--> x_local' ... other compute ... --wait()--> x_comm
    backward: d x_comm --(Wait.backward launches backward_comm async)--> placeholder
              ... autograd runs other branches (e.g. the Q projection's grad GEMM) ...
              Launch.backward waits backward_comm and returns d x_local

So the inverse collective overlaps whatever autograd schedules between the two nodes, and
the forward collective overlaps whatever the caller computes between launch and wait. Every
handle is waited exactly once (``hyper_parallel.platform.pending_handles()`` returns to 0
after forward+backward). An :func:`async_trace` context records launch/wait events so tests
can prove the overlap order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Optional

import torch

from ...platform import CommHandle

_TRACE: list | None = None


@contextlib.contextmanager
def async_trace():
    """Record ``(event, name, t)`` tuples for async launch/wait (and :func:`trace_event`)."""
    global _TRACE
    prev, _TRACE = _TRACE, []
    try:
        yield _TRACE
    finally:
        _TRACE = prev


def tracing() -> bool:
    """Whether an :func:`async_trace` is recording (callers skip trace-only work otherwise)."""
    return _TRACE is not None


def trace_event(event: str, name: str) -> None:
    if _TRACE is not None:
        _TRACE.append((event, name, time.perf_counter()))


@dataclasses.dataclass
class AsyncCollective:
    """One async collective on one tensor of one attention call, with its autograd mirror.

    ``forward_comm(x)`` / ``backward_comm(g)`` each start a platform collective on the caller's
    group (closures chosen by the adapter: e.g. AllGather on the cp group along the sequence
    dim, with ReduceScatter as its backward; seq->head all-to-all with the inverse all-to-all)
    and return a :class:`~hyper_parallel.platform.CommHandle`. Shapes are whatever the two
    collectives produce: ``wait`` returns ``forward_comm``'s result (e.g. ``[B, H, S_local, D]``
    -> ``[B, H, S, D]``), and backward maps that result's gradient back to ``x``'s shape via
    ``backward_comm``.

    Use once per forward: ``tok = c.launch(x)`` then ``y = c.wait(tok)`` (launching twice or
    waiting before launch raises). Backward: ``wait``'s node launches ``backward_comm`` on the
    incoming gradient asynchronously; ``launch``'s node waits it and adds it to ``x``'s
    gradient, so the inverse collective overlaps whatever autograd runs in between. All ranks
    of the group must launch in the same order.
    """

    name: str
    forward_comm: Callable[[torch.Tensor], CommHandle]
    backward_comm: Callable[[torch.Tensor], CommHandle]
    handle: Optional[CommHandle] = None
    bwd_handle: Optional[CommHandle] = None

    def launch(self, x: torch.Tensor) -> torch.Tensor:
        """Start ``forward_comm(x)``; returns a token tensor (x itself) to pass to :meth:`wait`."""
        return _Launch.apply(x, self)

    def wait(self, token: torch.Tensor) -> torch.Tensor:
        """Materialize the forward collective's result (autograd-connected to the token)."""
        return _Wait.apply(token, self)


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, state: AsyncCollective):
        if state.handle is not None:
            raise RuntimeError(f"async collective {state.name} launched twice without wait")
        state.handle = state.forward_comm(x.detach())
        trace_event("launch", state.name)
        ctx.state = state
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        state: AsyncCollective = ctx.state
        if state.bwd_handle is None:
            raise RuntimeError(f"async collective {state.name}: backward reached launch without the "
                               "consumer's gradient (wait() output unused?)")
        trace_event("bwd_wait", state.name)
        g = state.bwd_handle.wait()
        state.bwd_handle = None
        return grad + g, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, state: AsyncCollective):
        if state.handle is None:
            raise RuntimeError(f"async collective {state.name}: wait() before launch()")
        trace_event("wait", state.name)
        out = state.handle.wait()
        state.handle = None
        ctx.state = state
        ctx.token_shape = token.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        state: AsyncCollective = ctx.state
        state.bwd_handle = state.backward_comm(grad.contiguous())
        trace_event("bwd_launch", state.name)
        return grad.new_zeros(ctx.token_shape), None


# ----------------------------------------------------------------------------- comm plans
# A plan is (forward_comm, backward_comm) for :class:`AsyncCollective`: each takes a tensor and
# returns a CommHandle. Every step runs on the platform's communication thread
# (:func:`hyper_parallel.platform.launch_chain`, FIFO, same submission order on every rank) and
# calls the sync CP collectives (the same layout functions the sync strategies use) on a
# detached tensor, so no autograd graph is built there; the autograd mirror is
# :class:`AsyncCollective`'s. A step with several collectives (Hybrid K/V: ulysses A2A then
# colossal AllGather) is one chain: the dependency is kept on the comm thread. Each method's
# plans: ``methods/<method>/async_.py``.
def comm_chain(steps, op: str) -> Callable[[torch.Tensor], CommHandle]:
    from ...platform import launch_chain

    def run(x: torch.Tensor) -> CommHandle:
        return launch_chain(x, [_no_grad(s, op) for s in steps], op=op)

    return run


def _no_grad(step, op: str):
    def run(y):
        # labelled for torch.profiler traces (profile_all_threads shows the comm thread's spans)
        with torch.no_grad(), torch.profiler.record_function(f"hp_comm:{op}"):
            return step(y)
    return run
