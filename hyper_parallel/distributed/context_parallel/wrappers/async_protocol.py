"""The async handoff protocol (docs/async_cp.md) and its preflight. An attention that can run async
CP exposes its real handoff modules::

    attn.get_async_cp_handoffs() -> {"q": cp_q_handoff, "k": cp_k_handoff, "v": cp_v_handoff,
                                     "wait": cp_attn_wait}

and its forward calls them in this contract (one call each per forward)::

    k = self.cp_k_handoff(k)          # k [B, Hk, L, D]: projection (+ norm) + RoPE done, last safe point
    v = self.cp_v_handoff(v)          # v [B, Hk, L, D]
    q = self.cp_q_handoff(q)          # q [B, Hq, L, D]
    q, k, v = self.cp_attn_wait(q, k, v)     # the handoff outputs, unchanged
    out = attention_interface(self, q, k, v, ...)   # transformers' attention interface, once

The handoffs are parameter-free identity modules (:class:`HandoffPoint`, :class:`AttnWait`).
:func:`validate_async` is the preflight (no collective): the protocol exists, a probe forward
proves the call order and shapes, compute runs between launch and wait (no pseudo-async), the
static refusals and the head rule.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn as nn

from .. import catalogue
from ..interception import (AttentionCall, ensure_hf_interface_registered, hf_probe_inputs, install_private_config,
                            intercept_hf_interface)
from .heads import check_heads, module_heads
from .preflight import check_features, check_module_position_semantics

HANDOFF_KEYS = ("q", "k", "v", "wait")


def handoff_comm(method: str) -> tuple:
    """The tensors async ``method`` communicates at its handoffs, read off its catalogue row live (a
    row added later counts): K/V alone when the K/V AllGather is its only exchange, K/V then Q for
    Head-Tail (queries dispatched), Q/K/V when the heads are split over a Ulysses group; () for a
    method without async variants."""
    row = catalogue.METHODS.get(method)
    if row is None or row not in catalogue.async_methods():
        return ()
    if catalogue.gathers_kv_only(row):
        return ("k", "v")
    if catalogue.gathers_kv(row):
        return ("k", "v", "q")
    return ("q", "k", "v")


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
    launches = [calls[k][0] for k in handoff_comm(method)]
    first = min(launches)
    if not any(e[0] == "compute" for e in rec.events[first:w]):
        order = [e[1] if e[0] != "attention" else "attention" for e in rec.events]
        raise ValueError(
            f"{who}: {name} launches its {'/'.join(handoff_comm(method))} collectives and waits for them with no "
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
