"""The per-method plan of an async attention (:class:`AsyncPlan`): its collectives on the cached
groups, the sync strategy that checks a call, and for Ulysses / Hybrid the plans per head layout.
Each method builds its own in ``methods/<method>/async_.py::async_plan`` (named by its catalogue
row's ``async_plan``); ``wrappers/async_pipeline.py::make_plan`` resolves the row and calls it.
Also the pipeline helpers the methods' attention loops share (chunk counts, names, tracing).
docs/async_cp.md."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from .async_collectives import trace_event, tracing
from .methods.ulysses.layout import ulysses_head_layout


def q_chunk_count(rows: int, q_chunks: int) -> int:
    """The pipeline depth used for ``rows`` local query rows: the largest divisor of ``rows`` not
    above ``q_chunks`` (Ulysses/Hybrid: ``rows`` = the local length L; Head-Tail: L/2, the rows of
    one sub-chunk). Every chunk has the same number of rows, so every rank agrees."""
    for g in range(min(q_chunks, rows), 0, -1):
        if rows % g == 0:
            return g
    return 1


def chunk_name(base: str, i: int) -> str:
    """Trace / collective name of chunk ``i`` of ``base`` (chunk 0 keeps the plain name)."""
    return base if i == 0 else f"{base}.{i}"


def split_q_rows(q: torch.Tensor, q_chunks: int) -> list:
    """The G query chunks launched at the Q handoff (G = :func:`q_chunk_count`), in sequence order:
    rows ``[c*L/G, (c+1)*L/G)`` of the local ``[B, Hq, L, D]`` (a method may split otherwise: ``AsyncPlan.split_q``)."""
    return list(q.chunk(q_chunk_count(q.shape[2], q_chunks), dim=2))


def trace_kv_chunk(k_c: torch.Tensor, v_c: torch.Tensor, ci: int) -> None:
    """Trace the attention of gathered K/V chunk ``ci`` (forward now; backward once, when the first of
    its dK / dV is consumed, i.e. right after the chunk's attention backward)."""
    if tracing():
        trace_event("compute", f"attention_kv{ci}")
        seen = []

        def once(g, ci=ci):
            if not seen:
                seen.append(True)
                trace_event("bwd_compute", f"attention_kv{ci}")
        for t in (k_c, v_c):
            if t.requires_grad:
                t.register_hook(once)


def trace_chunk(q_c: torch.Tensor, ci: int) -> None:
    """Trace the attention of query chunk ``ci`` (forward now; backward when its dQ exists)."""
    if tracing():
        trace_event("compute", f"attention_q{ci}")
        if q_c.requires_grad:
            q_c.register_hook(lambda g, ci=ci: trace_event("bwd_compute", f"attention_q{ci}"))


@dataclasses.dataclass
class AsyncPlan:
    """One async attention's collectives; a method's ``async_plan(method, strategy_cls, mesh,
    cp_mesh, ulysses_degree)`` returns it (resolving its groups from the cached mesh, never creating one)."""

    method: str
    plans: Optional[dict]    # "q"/"k"/"v"/"out" -> (forward_comm, backward_comm); None: per head layout (build)
    checker: object          # the sync strategy of the method on the same groups (local checks only)
    out_group: object = None  # ulysses group of the output head->seq A2A (Ulysses/Hybrid)
    ulysses_degree: Optional[int] = None
    group: object = None     # cp group (Head-Tail combine)
    build: Optional[Callable] = None    # Ulysses/Hybrid: UlyssesHeadLayout -> plans
    by_heads: dict = dataclasses.field(default_factory=dict)
    # the method's attention after the wait: attend(plan, call_state, q, k, v, meta, sinks, kw, keep) -> out
    # [B, Hq, L, D]; call_state is the forward's wrappers/async_pipeline._Call (its launched chunks,
    # plans, head layout, regather), keep: keep the gathered K/V for backward instead of regathering
    attend: Optional[Callable] = None
    split_q: Callable = split_q_rows    # (q, q_chunks) -> the query chunks launched at the Q handoff
    kv_chunked: bool = False            # the K/V gathers are pipelined in ``kv_chunks`` sequence chunks
    check_meta: Optional[Callable] = None   # (meta, owner) -> None: the method's batch checks, first handoff

    def at_heads(self, num_q_heads: int, num_kv_heads: int, who: str) -> tuple:
        """``(plans, layout)`` for a forward with these local (TP-local) heads; ``layout`` is the
        :class:`UlyssesHeadLayout` of the Ulysses group (None for Colossal / Head-Tail). Cached per
        head counts; raises ValueError (no collective) when no exact split exists."""
        if self.build is None:
            return self.plans, None
        key = (num_q_heads, num_kv_heads)
        if key not in self.by_heads:
            u = self.ulysses_degree or self.checker.cp_size
            lay = ulysses_head_layout(num_q_heads, num_kv_heads, u, who=who,
                                      what="ulysses_degree" if self.ulysses_degree else "cp_size (ulysses_degree)")
            self.by_heads[key] = (self.build(lay), lay)
        return self.by_heads[key]


def group_of(cp_mesh):
    """The cp ProcessGroup of ``cp_mesh`` (a 1-D DeviceMesh or the group itself); ValueError when CP is off."""
    if cp_mesh is None:
        raise ValueError("async CP wrappers need an active cp mesh (accelerator.cp_size > 1)")
    return cp_mesh if not hasattr(cp_mesh, "get_group") else cp_mesh.get_group()
