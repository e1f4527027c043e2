"""The async handoff protocol (docs/async_cp.md) and the generic async CP installation.

**Protocol.** An attention that can run async CP exposes its real handoff modules::

    attn.get_async_cp_handoffs() -> {"q": cp_q_handoff, "k": cp_k_handoff, "v": cp_v_handoff,
                                     "wait": cp_attn_wait}

and its forward calls them in this contract (one call each per forward)::

    k = self.cp_k_handoff(k)          # k [B, Hk, L, D]: projection (+ norm) + RoPE done, last safe point
    v = self.cp_v_handoff(v)          # v [B, Hk, L, D]
    q = self.cp_q_handoff(q)          # q [B, Hq, L, D]
    q, k, v = self.cp_attn_wait(q, k, v)     # the handoff outputs, unchanged
    out = attention_interface(self, q, k, v, ...)   # transformers' attention interface, once

The handoffs are parameter-free identity modules (:class:`HandoffPoint`, :class:`AttnWait`).
:func:`install_async` puts forward hooks on them that launch the method's collectives on the
platform's comm thread (:class:`~..async_collectives.AsyncCollective`) and wait them at
``cp_attn_wait``, where the attention call is routed to the engine with global positions; backward
mirrors it (a wait node launches the inverse collective, the launch node waits it before the
projection's grad GEMM). Query-side pipelining (``q_chunks``: Ulysses, Hybrid, Head-Tail) and the
K/V pipeline (``kv_chunks``: Colossal) change when collectives run, never the result; gathered
K/V are regathered in backward rather than kept. :func:`validate_async` is the preflight (no
collective): the protocol exists, a probe forward proves the call order and shapes, compute runs
between launch and wait (no pseudo-async), the static refusals and the head rule. Head layouts are
those of the sync strategies (:func:`..strategies.ulysses_layout.ulysses_head_layout`). Every
order, shape and volume: docs/async_cp.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

import torch
import torch.nn as nn

from ....platform import group_rank
from .. import catalogue
from ..async_collectives import (AsyncCollective, colossal_kv_plan, head_tail_out_plan, head_tail_q_plan,
                                 hybrid_kv_plan, trace_event, tracing, ulysses_out_plan, ulysses_plan)
from ..collectives import head_tail_sub_chunks, regather_saved_kv
from ..interception import (AttentionCall, CPInterceptionError, current_apply_context,
                            ensure_hf_interface_registered, hf_probe_inputs, install_private_config,
                            intercept_hf_interface)
from ..meta import current_cp_batch_meta
from ..strategies import AllGatherStrategy, HeadTailStrategy, HybridStrategy, UlyssesStrategy
from ..strategies.base import engine_attention
from ....ops.merge import merge_partial_attention
from ....ops.attention import kv_map_in_place
from ..strategies.ulysses_layout import UlyssesHeadLayout, ulysses_head_layout
from .heads import check_heads, module_heads
from .preflight import check_call, check_features, check_module_position_semantics
from .validate_mode import compare, hf_module_reference, rank_group, valid_query_rows

__all__ = ["HANDOFF_KEYS", "HandoffPoint", "AttnWait", "get_handoffs", "probe_handoffs", "validate_async",
           "install_async", "ASYNC_METHODS", "DEFAULT_Q_CHUNKS", "DEFAULT_KV_CHUNKS", "q_chunk_count",
           "check_q_chunks", "check_kv_chunks"]

HANDOFF_KEYS = ("q", "k", "v", "wait")
# which tensors each async method communicates at its handoffs
ASYNC_METHODS = {"colossal": ("k", "v"), "ulysses": ("q", "k", "v"), "hybrid": ("q", "k", "v"),
                 "load_balance": ("k", "v", "q")}
# query-side pipeline depth G of async Ulysses / Hybrid / Head-Tail when the wrapper names none
DEFAULT_Q_CHUNKS = 4
# K/V pipeline depth G of async Colossal when the wrapper names none
DEFAULT_KV_CHUNKS = 4
#: True: the attention keeps the gathered K/V for backward (no regather, more memory per rank)
keep_gathered_kv = False


def _check_chunks(value, field: str, default: int, what: str, who: str) -> int:
    """A pipeline depth field (None: ``default``) as an int >= 1; ValueError naming ``who`` and ``field``."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{who}: {field}={value!r} must be an int >= 1 (the number of {what}; 1 = no "
                         f"pipelining, default {default})")
    return value


def check_q_chunks(q_chunks, who: str) -> int:
    """``q_chunks`` (None: :data:`DEFAULT_Q_CHUNKS`) as an int >= 1; ValueError naming ``who``."""
    return _check_chunks(q_chunks, "q_chunks", DEFAULT_Q_CHUNKS,
                         "query sub-chunks pipelined through the Q / output collectives", who)


def check_kv_chunks(kv_chunks, who: str) -> int:
    """``kv_chunks`` (None: :data:`DEFAULT_KV_CHUNKS`) as an int >= 1; ValueError naming ``who``."""
    return _check_chunks(kv_chunks, "kv_chunks", DEFAULT_KV_CHUNKS,
                         "K/V sequence sub-chunks gathered separately and pipelined through the attention "
                         "with an LSE merge", who)


def q_chunk_count(rows: int, q_chunks: int) -> int:
    """The pipeline depth used for ``rows`` local query rows: the largest divisor of ``rows`` not
    above ``q_chunks`` (Ulysses/Hybrid: ``rows`` = the local length L; Head-Tail: L/2, the rows of
    one sub-chunk). Every chunk has the same number of rows, so every rank agrees."""
    for g in range(min(q_chunks, rows), 0, -1):
        if rows % g == 0:
            return g
    return 1


class HandoffPoint(nn.Module):
    """Identity module marking a tensor's last safe handoff (``[B, H, L, D]`` after projection,
    norm and RoPE). The async wrapper's forward hook launches the collective at its output."""

    def __init__(self, name: str):
        super().__init__()
        self.handoff = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return self.handoff


class AttnWait(nn.Module):
    """Identity on ``(q, k, v)`` right before the attention consumer; the async wrapper's hook
    replaces its output by the waited (communicated) tensors."""

    def forward(self, q, k, v):
        return q, k, v


# ----------------------------------------------------------------------------- protocol checks
def get_handoffs(module: nn.Module, who: str) -> dict:
    """The four handoff modules of ``module`` (checked: protocol present, distinct, owned)."""
    name = type(module).__name__
    getter = getattr(module, "get_async_cp_handoffs", None)
    if not callable(getter):
        raise ValueError(
            f"{who}: {name} does not implement the async handoff protocol (no get_async_cp_handoffs()), so "
            "async CP cannot choose its launch/wait points; use this model's adapter "
            "(hyper_parallel.models.<model_type>.adapter.*_async_*_cp_wrapper, docs/async_cp.md) or a sync wrapper "
            "(sdpa_hf / sdpa_hf_ulysses / sdpa_hf_hybrid_cp_wrapper)")
    got = getter()
    if not isinstance(got, dict) or set(got) != set(HANDOFF_KEYS):
        raise ValueError(f"{who}: {name}.get_async_cp_handoffs() must return a dict with keys {HANDOFF_KEYS}, "
                         f"got {sorted(got) if isinstance(got, dict) else type(got).__name__}")
    mods = [got[k] for k in HANDOFF_KEYS]
    for key, m in zip(HANDOFF_KEYS, mods):
        if not isinstance(m, nn.Module):
            raise ValueError(f"{who}: {name}.get_async_cp_handoffs()['{key}'] is a {type(m).__name__}, "
                             "not an nn.Module")
    if len({id(m) for m in mods}) != 4:
        raise ValueError(f"{who}: {name}.get_async_cp_handoffs() returns the same module twice; the q, k, v and "
                         "wait handoffs must be four distinct modules")
    owned = {id(m) for m in module.modules() if m is not module}
    for key, m in zip(HANDOFF_KEYS, mods):
        if id(m) not in owned:
            raise ValueError(f"{who}: the '{key}' handoff ({type(m).__name__}) is not a submodule of this {name}; "
                             "each attention must own its handoff modules")
    return dict(got)


def _compute_modules(module: nn.Module, handoffs: dict) -> dict:
    """Owned leaf modules with parameters (projections, norms), by name: the compute a launch overlaps."""
    skip = {id(m) for m in handoffs.values()}
    return {n: m for n, m in module.named_modules() if n and id(m) not in skip and not list(m.children())
            and any(True for _ in m.parameters(recurse=False))}


@dataclasses.dataclass
class ProbeRecord:
    events: list            # ("handoff", key, out) | ("compute", name) | ("attention",)
    wait_args: tuple


def probe_handoffs(module: nn.Module, forward: Callable, who: str) -> Optional[ProbeRecord]:
    """Run ``forward`` (the attention's protocol forward) on 2 dummy tokens in train mode with
    recording hooks and the attention call answered by zeros; None when the module cannot be
    probed (meta/DTensor parameters, no HF signature)."""
    kwargs = hf_probe_inputs(module)
    if kwargs is None:
        return None
    handoffs = get_handoffs(module, who)
    events: list = []
    wait_args: list = []
    hooks = []
    for key in ("q", "k", "v"):
        hooks.append(handoffs[key].register_forward_hook(
            lambda m, a, out, key=key: events.append(("handoff", key, out))))
    hooks.append(handoffs["wait"].register_forward_hook(
        lambda m, a, out: (events.append(("handoff", "wait", out)), wait_args.append(a))[0] and None))
    for n, m in _compute_modules(module, handoffs).items():
        hooks.append(m.register_forward_hook(lambda m, a, out, n=n: events.append(("compute", n))))

    def zeros(call: AttentionCall) -> torch.Tensor:
        events.append(("attention",))
        return call.q.new_zeros(call.q.shape[0], call.q.shape[1], call.q.shape[2], call.v.shape[-1])

    ensure_hf_interface_registered()
    undo = install_private_config(module)
    was_training = module.training
    try:
        module.train(True)
        with torch.no_grad(), intercept_hf_interface(who, module, zeros, max_calls=1 << 30, check=False):
            forward(**kwargs)
    finally:
        module.train(was_training)
        undo()
        for h in hooks:
            h.remove()
    return ProbeRecord(events, wait_args[0] if wait_args else ())


def check_probe_record(rec: ProbeRecord, module: nn.Module, method: str, who: str) -> None:
    """The probe's evidence against the protocol contract (see the module docstring)."""
    name = type(module).__name__
    calls = {k: [i for i, e in enumerate(rec.events) if e[0] == "handoff" and e[1] == k] for k in HANDOFF_KEYS}
    att = [i for i, e in enumerate(rec.events) if e[0] == "attention"]
    for key, idx in calls.items():
        if len(idx) != 1:
            raise ValueError(f"{who}: a probe forward of {name} called its '{key}' handoff {len(idx)} times; the "
                             "protocol needs exactly one call per forward (launch and wait must pair up)")
    if len(att) != 1:
        raise ValueError(f"{who}: a probe forward of {name} made {len(att)} attention-interface calls; the async "
                         "wrapper replaces exactly one (check attn_implementation and the adapter's forward)")
    w = calls["wait"][0]
    for key in ("q", "k", "v"):
        if calls[key][0] > w:
            raise ValueError(f"{who}: {name} calls cp_attn_wait before its '{key}' handoff; every handoff must "
                             "precede the wait")
    if att[0] < w:
        raise ValueError(f"{who}: {name} calls its attention before cp_attn_wait; the wait must precede the consumer")
    hq, hk = module_heads(module)
    outs = {k: rec.events[calls[k][0]][2] for k in ("q", "k", "v")}
    for i, key in enumerate(("q", "k", "v")):
        t = outs[key]
        heads = hq if key == "q" else hk
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[2] != 2 or (
                heads is not None and t.shape[1] != heads):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{who}: {name}'s '{key}' handoff outputs {shape}; the async wrappers need "
                             f"[B, H, S, D] with H = {heads} ({'query' if key == 'q' else 'KV'} heads) and the "
                             "sequence on dim 2 (probe: S=2)")
        if len(rec.wait_args) != 3 or rec.wait_args[i] is not t:
            raise ValueError(f"{who}: {name} does not pass its '{key}' handoff output to cp_attn_wait unchanged; "
                             "the wait must receive exactly the launched tensors (no reshape/copy in between)")
    launches = [calls[k][0] for k in ASYNC_METHODS[method]]
    first = min(launches)
    if not any(e[0] == "compute" for e in rec.events[first:w]):
        order = [e[1] if e[0] != "attention" else "attention" for e in rec.events]
        raise ValueError(
            f"{who}: {name} launches its {'/'.join(ASYNC_METHODS[method])} collectives and waits for them with no "
            f"compute in between (probe order {order}): that is launch-then-wait, pseudo-async with no overlap. "
            "Place the handoffs at the last safe point before the remaining projections, or use the sync wrapper")


def validate_async(target_module: nn.Module, method: str, who: str, *, cp_size: int, tp_size: int = 1,
                   ulysses_degree=None, probe: bool = True, forward: Optional[Callable] = None) -> None:
    """Preflight of a generic async wrapper (no collective); raises ValueError naming ``who``."""
    get_handoffs(target_module, who)
    check_features(target_module, who)
    check_module_position_semantics(target_module, who, "the async wrappers (Q moves at its handoff)")
    check_heads(method, target_module, cp_size, tp_size, ulysses_degree, who)
    if probe:
        rec = probe_handoffs(target_module, forward or target_module.forward, who)
        if rec is not None:
            check_probe_record(rec, target_module, method, who)


# ----------------------------------------------------------------------------- installation
@dataclasses.dataclass
class _Plan:
    method: str
    plans: Optional[dict]    # "q"/"k"/"v"/"out" -> (forward_comm, backward_comm); None: per head layout (build)
    checker: object          # the sync strategy of the method on the same groups (local checks only)
    out_group: object = None  # ulysses group of the output head->seq A2A (Ulysses/Hybrid)
    ulysses_degree: Optional[int] = None
    group: object = None     # cp group (Head-Tail combine)
    build: Optional[Callable] = None    # Ulysses/Hybrid: UlyssesHeadLayout -> plans
    by_heads: dict = dataclasses.field(default_factory=dict)

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


def _group_of(cp_mesh):
    if cp_mesh is None:
        raise ValueError("async CP wrappers need an active cp mesh (accelerator.cp_size > 1)")
    return cp_mesh if not hasattr(cp_mesh, "get_group") else cp_mesh.get_group()


def make_plan(method: str, mesh, cp_mesh, ulysses_degree=None) -> _Plan:
    """The collectives of ``method`` on the cached groups (never creates one)."""
    if method == "hybrid":
        if mesh is None or not hasattr(mesh, "hybrid_groups"):
            raise ValueError("the async Hybrid wrapper needs the MeshContext (mesh) to find its cached sub-groups")
        cg, ug = mesh.hybrid_groups(ulysses_degree)

        def hybrid(lay):
            kv = hybrid_kv_plan(cg, ug, lay)
            return {"k": kv, "v": kv, "q": ulysses_plan(ug, lay, "q"), "out": ulysses_out_plan(ug, lay)}
        return _Plan(method, None, HybridStrategy(cg, ug), ug, ulysses_degree, build=hybrid)
    group = _group_of(cp_mesh)
    if method == "colossal":
        kv = colossal_kv_plan(group)
        return _Plan(method, {"k": kv, "v": kv}, AllGatherStrategy(group), group=group)
    if method == "ulysses":
        def ulysses(lay):
            kv = ulysses_plan(group, lay, "kv")
            return {"q": ulysses_plan(group, lay, "q"), "k": kv, "v": kv, "out": ulysses_out_plan(group, lay)}
        return _Plan(method, None, UlyssesStrategy(group), group, build=ulysses)
    if method == "load_balance":
        kv = colossal_kv_plan(group)
        return _Plan(method, {"k": kv, "v": kv, "q": head_tail_q_plan(group), "out": head_tail_out_plan(group)},
                     HeadTailStrategy(group), group=group)
    raise ValueError(f"no async plan for CP method {method!r}")


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

    def regather(self, k_name: str, v_name: str, gathered: tuple):
        """:func:`..collectives.regather_saved_kv` around the engine call(s) consuming ``gathered``
        (the waited results of collectives ``k_name`` / ``v_name``, or tensors they are views of):
        backward re-runs both forward collectives on their local tensors, on the comm thread; the
        regather of the pair created before this one (the previous chunk / layer) is started when
        this one is read. The caller must make the same choice on every rank of the collectives'
        groups (a rank that regathers issues the collectives in backward)."""
        if keep_gathered_kv or k_name not in self.sent or v_name not in self.sent:
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


def _chunk_name(base: str, i: int) -> str:
    return base if i == 0 else f"{base}.{i}"


def _split_q(method: str, q: torch.Tensor, q_chunks: int) -> list:
    """The G query chunks launched at the Q handoff (G = :func:`q_chunk_count`), in sequence order.

    Ulysses / Hybrid: rows ``[c*L/G, (c+1)*L/G)`` of the local ``[B, Hq, L, D]``. Head-Tail: the
    same rows of each of the two local sub-chunks (2r, 2r+1), concatenated ``[B, Hq, 2*L/(2G), D]``,
    so one dispatch per chunk carries both branches' rows (:func:`..async_collectives.head_tail_q_plan`)."""
    L = q.shape[2]
    if method == "load_balance":
        g = q_chunk_count(L // 2, q_chunks)
        lo, hi = q.chunk(2, dim=2)
        return [torch.cat([a, b], dim=2) for a, b in zip(lo.chunk(g, dim=2), hi.chunk(g, dim=2))]
    return list(q.chunk(q_chunk_count(L, q_chunks), dim=2))


def _kv_chunk_names(key: str, g: int) -> list:
    return [_chunk_name(key, i) for i in range(g)]


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
        c.kv_parts[other].append(c.launch(_chunk_name(other, ci), plan_kv, a))
        c.kv_parts[key].append(c.launch(_chunk_name(key, ci), plan_kv, b))


def _trace_kv_chunk(k_c: torch.Tensor, v_c: torch.Tensor, ci: int) -> None:
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


def _trace_chunk(q_c: torch.Tensor, ci: int) -> None:
    """Trace the attention of query chunk ``ci`` (forward now; backward when its dQ exists)."""
    if tracing():
        trace_event("compute", f"attention_q{ci}")
        if q_c.requires_grad:
            q_c.register_hook(lambda g, ci=ci: trace_event("bwd_compute", f"attention_q{ci}"))


def _consumer(plan: _Plan, module: nn.Module, owner: str,
              current: Callable[[], "_Call"]) -> Callable[[AttentionCall], torch.Tensor]:
    """The attention call after the wait: engine attention on the communicated tensors.
    ``current()`` is the :class:`_Call` of the forward in progress (its query chunks, head layout).

    Ulysses / Hybrid / Head-Tail pipeline the query side over the G chunks launched at the Q
    handoff: ``wait q_0 -> attention_0 -> launch out_0 -> wait q_1 -> attention_1 -> launch out_1
    ... -> wait out_0 .. out_{G-1} -> concatenate`` (the later chunks' Q collectives travel while
    the earlier chunks compute; each output collective travels while the later chunks compute).
    Every query row sees exactly the keys it sees unpipelined: its global position goes to the
    engine (``q_pos``), with the batch meta's documents / padding, window, softcap and sinks."""
    who = f"module '{owner}'"

    def handler(call: AttentionCall) -> torch.Tensor:
        check_call(call, module, who, at="at the call")
        meta = current_cp_batch_meta()
        q, k, v = call.q, call.k, call.v
        kw = dict(meta=meta, scale=call.scale, window=call.window, softcap=call.softcap)
        sinks = call.sinks
        if sinks is not None and sinks.dtype != q.dtype:
            sinks = sinks.to(q.dtype)
        m = plan.method
        c = current()
        if m == "colossal":
            if not c.kv_parts:         # G = 1: K/V waited whole at cp_attn_wait
                with c.regather("k", "v", (k, v)):
                    return engine_attention(q, k, v, q_pos=meta.q_index, k_pos=meta.k_index, sinks=sinks, **kw)
            return _colossal_pipelined(c, plan, q, meta, sinks, kw)
        outs = []
        if m == "load_balance":
            C, r = plan.checker.cp_size, plan.checker.cp_rank
            sub = meta.global_seq_len // (2 * C)
            rows = sub // len(c.q_parts)
            # one regather for all query chunks: the branches save key prefixes, views of k / v
            with c.regather("k", "v", (k, v)):
                for ci, (coll, tok) in enumerate(c.q_parts):
                    q_c = coll.wait(tok)             # [B, Hq, 2*rows, D]: rows of the head, then the tail branch
                    _trace_chunk(q_c, ci)
                    res = []
                    # head branch first, then tail (the docstring of the Head-Tail entry point states this order)
                    for q_part, chunk in zip(q_c.chunk(2, dim=2), head_tail_sub_chunks(r, C)):
                        lo = chunk * sub + ci * rows
                        q_pos = torch.arange(lo, lo + rows, dtype=torch.int64)
                        n_keys = lo + rows if meta.causal else meta.global_seq_len   # keys past the last query
                        trace_event("compute", f"attention_chunk{chunk}")
                        res.append(engine_attention(q_part, k[:, :, :n_keys], v[:, :, :n_keys], q_pos=q_pos,
                                                    k_pos=torch.arange(n_keys, dtype=torch.int64), sinks=sinks,
                                                    **kw))
                    outs.append(c.launch(_chunk_name("out", ci), c.plans["out"], torch.cat(res, dim=2)))
            got = [oc.wait(t) for oc, t in outs]     # each [B, Hq, 2*rows, D]: rows of sub-chunk 2r, then 2r+1
            return torch.cat([g[:, :, :rows] for g in got] + [g[:, :, rows:] for g in got], dim=2)
        # ulysses / hybrid: this rank's head slice over the (group's) whole sequence
        u = plan.ulysses_degree or plan.checker.cp_size
        i = group_rank(plan.out_group)
        lay = c.layout
        # this rank's query heads lay.q_ranges[i] and the KV heads they use (replicas, read in place
        # through the engine's head map) and the sinks of these query heads, as the sync
        # ulysses_group_attention
        kv_map = lay.kv_map_args(i)
        sinks_h = lay.q_slice(sinks, i)
        if m == "ulysses":
            q_pos = meta.k_index
        else:
            span = meta.local_seq_len * u
            start = (meta.cp_rank // u) * span
            q_pos = torch.arange(start, start + span, dtype=torch.int64)
        # chunk ci of the group: rows [ci*L/G, (ci+1)*L/G) of every group rank's chunk, rank-major
        q_pos = q_pos.view(u, len(c.q_parts), -1)
        # Hybrid: the colossal-gathered K/V are regathered in backward (Ulysses' head-exchanged K/V are
        # the size of the local ones: nothing to save); one exchange serves every query chunk. The
        # regather re-runs the ulysses A2A too, so every rank of the group must take part: the choice
        # depends only on values every rank shares. A backend that copies K/V per query head for a
        # head map (CUDA, NPU: kv_map_in_place False) saves that copy on the mapped ranks, which then
        # would not regather: there only layouts without a head map on any rank regather
        regather = m == "hybrid" and u < plan.checker.cp_size and (
            kv_map_in_place(k.device) or not any(lay.kv_map_args(j) for j in range(u)))
        with c.regather("k", "v", (k, v)) if regather else contextlib.nullcontext():
            for ci, (coll, tok) in enumerate(c.q_parts):
                q_c = coll.wait(tok)                 # [B, n_i, u*L/G, D]
                _trace_chunk(q_c, ci)
                out = engine_attention(q_c, k, v, q_pos=q_pos[:, ci].reshape(-1), k_pos=meta.k_index,
                                       sinks=sinks_h, **kv_map, **kw)
                outs.append(c.launch(_chunk_name("out", ci), c.plans["out"], out))
        return torch.cat([oc.wait(t) for oc, t in outs], dim=2)    # [B, Hq, L, D]

    return handler


def _colossal_pipelined(c: _Call, plan: _Plan, q: torch.Tensor, meta, sinks, kw: dict) -> torch.Tensor:
    """Colossal consumer over the G gathered K/V chunks: per chunk c, wait K_c and V_c, the engine
    with ``return_lse`` (local queries at ``meta.q_index``; keys at chunk c's global positions
    ``j*L + c*L/G + t``; sinks in chunk 0 only, so they count once) and the LSE merge into the running
    result (kept in fp32 or wider; rows seeing no key of a chunk: out 0, lse -inf). Returns
    ``[B, Hq, L, Dv]`` in q's dtype. Differentiable: backward runs the chunks' attention backwards
    last chunk first, each chunk's wait nodes launching its dK/dV ReduceScatter."""
    ks, vs = c.kv_parts["k"], c.kv_parts["v"]
    g, C = len(ks), plan.checker.cp_size
    k_pos = meta.k_index.view(C, g, -1)          # rank-major: rank j's rows of chunk ci
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    out = lse = None
    for ci, ((ck, tk), (cv, tv)) in enumerate(zip(ks, vs)):
        k_c, v_c = ck.wait(tk), cv.wait(tv)      # [B, Hk, C*L/G, D]
        _trace_kv_chunk(k_c, v_c, ci)
        # backward reads the chunks last first; reading chunk ci's pair starts chunk ci-1's regather
        with c.regather(_chunk_name("k", ci), _chunk_name("v", ci), (k_c, v_c)):
            o, l = engine_attention(q, k_c, v_c, q_pos=meta.q_index, k_pos=k_pos[:, ci].reshape(-1),
                                    sinks=sinks if ci == 0 else None, return_lse=True, **kw)
        if out is None:
            out, lse = o.to(acc_dtype), l
        else:
            out, lse = merge_partial_attention(out, lse, o, l)
    return out.to(q.dtype)


def install_async(method: str, target_module: nn.Module, mesh, cp_mesh, who: str, ulysses_degree=None,
                  forward: Optional[Callable] = None, q_chunks: Optional[int] = None,
                  kv_chunks: Optional[int] = None) -> Callable:
    """Install async ``method`` on an attention implementing the protocol; return the CP forward.

    ``forward`` is the protocol forward to run (default: the module's current forward).
    ``q_chunks`` (Ulysses, Hybrid, Head-Tail; None: :data:`DEFAULT_Q_CHUNKS`): the query side is
    pipelined in G = :func:`q_chunk_count` sequence chunks of the local query (G = 1: one Q
    collective, the output collective waited right after the attention); it changes when the
    collectives run, never the result. ``kv_chunks`` (Colossal; None: :data:`DEFAULT_KV_CHUNKS`):
    the K/V AllGathers are split in G = :func:`q_chunk_count` sequence chunks of the local K/V,
    pipelined through the attention with an LSE merge (G = 1: one gather per tensor, waited at
    ``cp_attn_wait``); exact up to fp rounding of the merge. Hooks
    are registered on the handoff modules and on the owned compute modules (overlap accounting
    and the trace of :func:`~..async_collectives.async_trace`); they act only inside the returned
    CP forward (elsewhere, e.g. with CP disabled for the preflight proof's reference, they are
    inert). ``__hp_undo__`` restores the module's config.
    """
    if method not in ASYNC_METHODS:
        raise ValueError(f"{who}: no async variant of method {method!r}")
    catalogue.check_degree(method, None, ulysses_degree, who)
    q_chunks = check_q_chunks(q_chunks, who)
    kv_chunks = check_kv_chunks(kv_chunks, who)
    ctx = current_apply_context()
    owner = ctx.fqn or type(target_module).__name__
    handoffs = get_handoffs(target_module, who)
    plan = make_plan(method, mesh, cp_mesh, ulysses_degree)
    comm_keys = ASYNC_METHODS[method]
    original = forward or target_module.forward
    groups = getattr(target_module, "num_key_value_groups", 1)
    state: list = []          # the _Call of the forward in progress (one at a time per module)

    def cur() -> Optional[_Call]:
        return state[-1] if state else None

    def check_first(c: _Call, key: str, t: torch.Tensor) -> None:
        if c.checked:
            return
        c.checked = True
        meta = current_cp_batch_meta()
        hk = t.shape[1] if key != "q" else t.shape[1] // groups
        kv_shape = (t.shape[0], hk, t.shape[2], t.shape[3])
        q_shape = (t.shape[0], hk * groups, t.shape[2], t.shape[3])
        plan.checker.check_shapes(q_shape, kv_shape, kv_shape, meta, cp_size=plan.checker.cp_size,
                                  cp_rank=plan.checker.cp_rank)
        c.plans, c.layout = plan.at_heads(hk * groups, hk, f"module '{owner}'")
        if plan.method == "load_balance" and meta.global_seq_len % (2 * plan.checker.cp_size):
            raise ValueError(f"module '{owner}': global sequence length {meta.global_seq_len} is not a multiple of "
                             f"2*cp_size={2 * plan.checker.cp_size}; shard the batch with policy='load_balance'")

    def launch_hook(key):
        def hook(mod, args, out):
            c = cur()
            if c is None or key not in comm_keys:     # outside the CP forward (e.g. CP disabled): inert
                return None
            check_first(c, key, out)
            if not c.colls:
                c.computes_since_launch = 0
            if key == "q":
                # G query chunks, each its own collective (and mirrored backward), all launched now;
                # the consumer waits them one by one. The handoff output stays the local q (the
                # consumer reads the chunks' tokens; their gradients reach q through the launches).
                for ci, part in enumerate(_split_q(plan.method, out, q_chunks)):
                    c.q_parts.append(c.launch(_chunk_name("q", ci), c.plans["q"], part))
                return None
            if plan.method == "colossal" and q_chunk_count(out.shape[2], kv_chunks) > 1:
                # G K (V) chunks, each its own gather; waited one by one in the consumer. The handoff
                # output stays the local tensor (the chunks' gradients reach it through the launches).
                _launch_kv_chunk(c, c.plans[key], key, out, kv_chunks)
                return None
            return c.launch(key, c.plans[key], out)[1]
        return hook

    def wait_hook(mod, args, out):
        c = cur()
        if c is None:
            return None
        got = dict(zip(("q", "k", "v"), out))
        missing = [k for k in comm_keys if k not in c.colls]
        if missing:
            raise CPInterceptionError(f"module '{owner}': cp_attn_wait ran before the {missing} handoff(s)")
        # K/V here (unless pipelined: Colossal's K/V chunks and the query chunks are waited one by one
        # in the consumer)
        res = {k: (c.colls[k].wait(got[k]) if k in ("k", "v") and k in c.colls and not c.kv_parts else got[k])
               for k in ("q", "k", "v")}
        if c.computes_since_launch == 0:
            raise ValueError(f"{who}: module '{owner}' waited its collectives with no compute since the first "
                             "launch (launch-then-wait, pseudo-async); place the handoffs before the remaining "
                             "projections or use the sync wrapper")
        return res["q"], res["k"], res["v"]

    def compute_hook(name):
        def hook(mod, args, out):
            if not state:
                return None
            state[-1].computes_since_launch += 1
            trace_event("compute", name)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                if tracing():
                    out.register_hook(lambda g, name=name: trace_event("bwd_compute", name))
            return None
        return hook

    hooks = [handoffs[k].register_forward_hook(launch_hook(k)) for k in ("q", "k", "v")]
    hooks.append(handoffs["wait"].register_forward_hook(wait_hook))
    hooks += [m.register_forward_hook(compute_hook(n)) for n, m in _compute_modules(target_module, handoffs).items()]

    ensure_hf_interface_registered()
    orig_cfg = getattr(target_module, "config", None)
    undo = [install_private_config(target_module)]
    handler = _consumer(plan, target_module, owner, lambda: state[-1])
    validate_mode = ctx.mode == "validate"
    ref_group = rank_group(cp_mesh) if validate_mode else None

    def cp_forward(*args, **kwargs):
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
            raise ValueError(f"module '{owner}': async CP does not support a KV cache / use_cache in training; call "
                             "the model with use_cache=False")
        state.append(_Call())
        try:
            with intercept_hf_interface(owner, target_module, handler):
                out = original(*args, **kwargs)
        finally:
            c = state.pop()
            for coll in c.colls.values():     # an error between launch and wait: never leave a handle behind
                if coll.handle is not None:
                    try:
                        coll.handle.wait()
                    except Exception:  # noqa: BLE001 - the original error is the one to report
                        pass
                    coll.handle = None
        if validate_mode:
            # the same reference as the sync *_hf wrappers: the module's forward on the CP-gathered
            # sequence with its own attention function and the model's own mask (hooks are inert
            # outside the CP forward, so the protocol forward computes the plain attention)
            meta = current_cp_batch_meta()
            ref = hf_module_reference(original, target_module, "hf_interface", args, kwargs, meta, ref_group,
                                      owner, orig_cfg)
            got = out[0] if isinstance(out, tuple) else out
            compare(got, ref, valid_query_rows(meta, got.shape[0]), 1, ref_group, owner, "module output")
        return out

    cp_forward.__hp_undo__ = undo
    cp_forward.__hp_strategy__ = plan.checker
    cp_forward.__wrapped__ = original
    return cp_forward
