"""Per-forward state of an async attention: the method's collectives on the cached groups
(:func:`make_plan`: the row's own ``async_plan``), the launched collectives and their K/V regather
(:class:`_Call`), and the K/V pipeline's chunk launch (:func:`_launch_kv_chunk`). Used by
:mod:`.async_handoff`; the methods' attention loops read a :class:`_Call` (``methods/<m>/async_.py``)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .. import catalogue
from ..async_collectives import AsyncCollective, trace_event
from ..comm import regather_saved_kv
from ..async_plan import AsyncPlan, chunk_name, q_chunk_count
from ..methods.factory import STRATEGY_CLASSES
from ..methods.ulysses.layout import UlyssesHeadLayout


def make_plan(method: str, mesh, cp_mesh, ulysses_degree=None) -> AsyncPlan:
    """The collectives of ``method`` on the cached groups (never creates one): the async plan its
    catalogue row names (``methods/<method>/async_.py::async_plan``), checked by the row's sync strategy."""
    row = catalogue.get_method(method)
    build = catalogue.async_plan_builder(row)
    if build is None:
        raise ValueError(f"no async plan for CP method {method!r}")
    return build(method, STRATEGY_CLASSES[row.strategy], mesh, cp_mesh, ulysses_degree)


class _Call:
    """State of one forward of one attention: its collectives and the compute seen since launch."""

    def __init__(self):
        # every AsyncCollective of this forward by trace name: "k", "v", the query chunks "q", "q.1", ...
        # and the output chunks "out", "out.1", ... (chunk 0 keeps the tensor's plain name)
        self.colls: dict = {}
        self.q_parts: list = []                        # [(AsyncCollective, token)] per query chunk, in order
        # Colossal K/V pipeline: "k"/"v" -> [(AsyncCollective, token)] per sequence chunk, in order;
        # "k_rest"/"v_rest": the chunks 1.. of the first handoff, launched interleaved at the second
        self.kv_parts: dict = {}
        self.sent: dict = {}                           # name -> (forward_comm, the local tensor it was launched on)
        self.plans: dict = {}                          # this forward's collectives (per head layout)
        self.layout: Optional[UlyssesHeadLayout] = None  # Ulysses/Hybrid head split of this forward
        self.computes_since_launch = 0
        self.checked = False

    def launch(self, name: str, plan: tuple, x: torch.Tensor) -> tuple:
        """A new :class:`AsyncCollective` ``name`` on ``plan`` launched on ``x``: ``(coll, token)``."""
        coll = AsyncCollective(name, *plan)
        self.colls[name] = coll
        if name[:1] in ("k", "v"):                    # K/V (chunks): what a regather re-sends
            self.sent[name] = (coll.forward_comm, x)
        return coll, coll.launch(x)

    def regather(self, k_name: str, v_name: str, gathered: tuple, keep: bool = False):
        """:func:`..comm.regather_saved_kv` around the engine call(s) consuming ``gathered``
        (the waited results of collectives ``k_name`` / ``v_name``, or tensors they are views of):
        backward re-runs both forward collectives on their local tensors, on the comm thread; the
        regather of the pair created before this one (the previous chunk / layer) is started when
        this one is read. The caller must make the same choice on every rank of the collectives'
        groups (a rank that regathers issues the collectives in backward). ``keep``: no regather, the
        gathered K/V stay saved for backward."""
        if keep or k_name not in self.sent or v_name not in self.sent:
            return contextlib.nullcontext()
        (fk, xk), (fv, xv) = self.sent[k_name], self.sent[v_name]
        tag = f"{k_name}+{v_name}"

        def launch(kl, vl):
            trace_event("regather_launch", tag)
            return _PairHandle(fk(kl), fv(vl), tag)

        return regather_saved_kv((xk, xv), gathered, launch=launch)


class _PairHandle:
    """The two handles of a K/V regather; ``wait()`` -> ``(k, v)``."""

    def __init__(self, hk, hv, tag: str):
        self.hk, self.hv, self.tag = hk, hv, tag

    def wait(self) -> tuple:
        try:
            k = self.hk.wait()
        finally:
            v = self.hv.wait()          # waited even when K's wait raised: no handle left behind
        trace_event("regather_wait", self.tag)
        return k, v


def _launch_kv_chunk(c: "_Call", plan_kv: tuple, key: str, x: torch.Tensor, kv_chunks: int) -> None:
    """K/V pipeline (Colossal): split ``x`` ``[B, Hk, L, D]`` into G sequence chunks; launch chunk 0
    now; at the second of the two handoffs, also launch the remaining chunks interleaved
    (first tensor's chunk c, then the second's), so the FIFO comm thread sends K_0, V_0, K_1, V_1, ..."""
    parts = list(x.chunk(q_chunk_count(x.shape[2], kv_chunks), dim=2))
    c.kv_parts[key] = [c.launch(key, plan_kv, parts[0])]
    other = "v" if key == "k" else "k"
    if other not in c.kv_parts:            # first of the two: keep chunks 1.. for the second handoff
        c.kv_parts[key + "_rest"] = parts[1:]
        return
    first_rest = c.kv_parts.pop(other + "_rest")
    if len(first_rest) != len(parts) - 1:
        raise ValueError(f"K and V local lengths give different chunk counts ({len(first_rest) + 1} vs {len(parts)})")
    for ci, (a, b) in enumerate(zip(first_rest, parts[1:]), start=1):
        c.kv_parts[other].append(c.launch(chunk_name(other, ci), plan_kv, a))
        c.kv_parts[key].append(c.launch(chunk_name(key, ci), plan_kv, b))
