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
# calls the sync CP collectives of :mod:`.collectives` (the same layout functions the sync
# strategies use) on a detached tensor, so no autograd graph is built there; the autograd
# mirror is :class:`AsyncCollective`'s. A step with several collectives (Hybrid K/V: ulysses A2A
# then colossal AllGather) is one chain: the dependency is kept on the comm thread.
def _chain(steps, op: str) -> Callable[[torch.Tensor], CommHandle]:
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


def colossal_kv_plan(group, seq_dim: int = 2) -> tuple:
    """K or V ``[B, Hk, L, D]`` -> AllGather on ``group`` -> ``[B, Hk, S, D]``; bwd: ReduceScatter(sum)."""
    from ...platform import reduce_scatter
    from .collectives import all_gather_seq

    return (_chain([lambda y: all_gather_seq(y, group, dim=seq_dim, tag="async_kv_gather")], "async_kv_gather"),
            _chain([lambda g: reduce_scatter(g, group, dim=seq_dim, tag="async_kv_reduce_scatter")],
                   "async_kv_reduce_scatter"))


def _exchange_heads(lay, kind: str) -> tuple:
    """(``heads=`` of the forward seq->head exchange, ``num_heads=`` of its adjoint) for a tensor of
    ``kind`` ("q" or "kv") under the Ulysses head layout ``lay``: ``(None, None)`` for the even
    split (plain all_to_all); else ``lay.q_heads`` / ``lay.kv_heads``, the KV adjoint summing the
    copies of a replicated KV head into it (``num_heads=Hk``)."""
    if lay is None or lay.even:
        return None, None
    if kind == "q":
        return lay.q_heads, None
    return lay.kv_heads, lay.num_kv_heads


def ulysses_plan(group, lay=None, kind: str = "q") -> tuple:
    """``[B, H, L, D]`` -> seq->head A2A on ``group`` -> ``[B, n_i, u*L, D]``; bwd: the adjoint A2A.

    ``lay`` (:class:`.strategies.ulysses_layout.UlyssesHeadLayout` of this group, None: even
    split) and ``kind`` ("q": query heads ``lay.q_heads``; "kv": KV heads ``lay.kv_heads``,
    replicated where several ranks' query heads use one) choose the heads rank ``i`` receives
    (``n_i``), exactly as the sync :func:`.strategies.ulysses.ulysses_group_attention`. Backward:
    ``ulysses_head_to_seq`` with the same heads; for K/V with ``num_heads=Hk``, so the gradients of
    a replicated KV head's copies are summed into it on the rank owning the sequence chunk."""
    from .collectives import ulysses_head_to_seq, ulysses_seq_to_head

    heads, num = _exchange_heads(lay, kind)
    return (_chain([lambda y: ulysses_seq_to_head(y, group, tag="async_seq_to_head", heads=heads)],
                   "async_seq_to_head"),
            _chain([lambda g: ulysses_head_to_seq(g, group, tag="async_head_to_seq", heads=heads, num_heads=num)],
                   "async_head_to_seq"))


def ulysses_out_plan(group, lay=None) -> tuple:
    """Attention output ``[B, n_i, u*L', D]`` (this rank's query heads ``lay.q_heads[i]``, the
    group's rows) -> head->seq A2A on ``group`` -> ``[B, Hq, L', D]`` (all query heads, this
    rank's rows); bwd: the seq->head A2A of dO with the same heads (the inverse permutation: the
    query split is disjoint). ``lay`` None / even: the plain all_to_all. The inverse of
    :func:`ulysses_plan` ``(group, lay, "q")`` — used per pipelined query chunk (``L' = L/G``)."""
    from .collectives import ulysses_head_to_seq, ulysses_seq_to_head

    heads, _num = _exchange_heads(lay, "q")
    return (_chain([lambda y: ulysses_head_to_seq(y, group, tag="async_out_head_to_seq", heads=heads)],
                   "async_out_head_to_seq"),
            _chain([lambda g: ulysses_seq_to_head(g, group, tag="async_out_seq_to_head", heads=heads)],
                   "async_out_seq_to_head"))


def hybrid_kv_plan(colossal_group, ulysses_group, lay=None) -> tuple:
    """K or V: seq->head A2A on the ulysses group chained into AllGather on the colossal group
    (``[B, Hk, S/C, D]`` -> ``[B, nk_i, S, D]``, ``nk_i`` the KV heads of ``lay.kv_heads[i]``,
    replicated when fewer than the ulysses degree; ``Hk/u`` for the even split / ``lay`` None);
    bwd: ReduceScatter(colossal) on that ``nk_i``-head shard chained into the adjoint A2A(ulysses)
    (``num_heads=Hk``: copies of a replicated KV head summed). Both stages run on the comm thread."""
    from ...platform import reduce_scatter
    from .collectives import all_gather_seq, ulysses_head_to_seq, ulysses_seq_to_head

    heads, num = _exchange_heads(lay, "kv")
    fwd = _chain([lambda y: ulysses_seq_to_head(y, ulysses_group, tag="async_seq_to_head", heads=heads),
                  lambda y: all_gather_seq(y, colossal_group, dim=2, tag="async_kv_gather")], "hybrid_kv_chain")
    bwd = _chain([lambda g: reduce_scatter(g, colossal_group, dim=2, tag="async_kv_reduce_scatter"),
                  lambda g: ulysses_head_to_seq(g, ulysses_group, tag="async_head_to_seq", heads=heads,
                                                num_heads=num)], "hybrid_kv_chain_bwd")
    return fwd, bwd


def head_tail_q_plan(group) -> tuple:
    """Q ``[B, Hq, L, D]`` (sub-chunks 2r, 2r+1) -> Head-Tail dispatch -> ``cat(q_head, q_tail)``
    along the sequence (sub-chunks r and 2C-1-r, ``[B, Hq, L, D]``); bwd: the combine exchange
    (the inverse permutation) of ``(dq_head, dq_tail)``."""
    from .collectives import head_tail_combine, head_tail_dispatch

    return (_chain([lambda y: torch.cat(head_tail_dispatch(y, group), dim=2)], "async_head_tail_dispatch"),
            _chain([lambda g: head_tail_combine(*g.chunk(2, dim=2), group)], "async_head_tail_dispatch_bwd"))


def head_tail_out_plan(group) -> tuple:
    """Head-Tail output ``cat(o_head, o_tail)`` along the sequence (rows of sub-chunks r and
    2C-1-r, ``[B, Hq, 2m, D]``) -> the combine exchange -> ``cat(o_lo, o_hi)`` (the same rows of
    this rank's sub-chunks 2r, 2r+1); bwd: the dispatch exchange of the gradient. The inverse of
    :func:`head_tail_q_plan` (forward and backward swapped), used per pipelined query chunk."""
    from .collectives import head_tail_combine, head_tail_dispatch

    return (_chain([lambda y: head_tail_combine(*y.chunk(2, dim=2), group)], "async_head_tail_combine"),
            _chain([lambda g: torch.cat(head_tail_dispatch(g, group), dim=2)], "async_head_tail_combine_bwd"))
