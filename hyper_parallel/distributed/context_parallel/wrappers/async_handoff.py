"""Generic async CP installation (:func:`install_async`), its attention consumer and the pipeline knobs.

:func:`install_async` hooks an attention's handoff modules (protocol: :mod:`.async_protocol`): each
handoff launches the method's collectives on the platform's comm thread
(:class:`~..async_collectives.AsyncCollective`), ``cp_attn_wait`` waits them and the attention call
goes to the engine with global positions; backward mirrors it (a wait node launches the inverse
collective, the launch node waits it before the projection's grad GEMM). ``q_chunks`` (Ulysses,
Hybrid, Head-Tail) and ``kv_chunks`` (Colossal, balanced split) pipeline the collectives (:mod:`.async_pipeline`)
and change when they run, never the result; gathered K/V are regathered in backward unless
:data:`keep_gathered_kv`. Every order, shape and volume: docs/async_cp.md.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from .. import catalogue
from ..async_collectives import trace_event, tracing
from ..interception import (AttentionCall, CPInterceptionError, current_apply_context, ensure_hf_interface_registered,
                            install_private_config, intercept_hf_interface)
from ..meta import current_cp_batch_meta
from ..async_plan import AsyncPlan, chunk_name, q_chunk_count
from .async_pipeline import _Call, _launch_kv_chunk, make_plan
from .async_protocol import (HANDOFF_KEYS, AttnWait, HandoffPoint, _compute_modules, get_handoffs, handoff_comm,
                             probe_handoffs, validate_async)
from .preflight import check_call
from .validate_mode import compare, hf_module_reference, rank_group, valid_query_rows

__all__ = ["HANDOFF_KEYS", "HandoffPoint", "AttnWait", "get_handoffs", "probe_handoffs", "validate_async",
           "install_async", "handoff_comm", "DEFAULT_Q_CHUNKS", "DEFAULT_KV_CHUNKS", "q_chunk_count",
           "check_q_chunks", "check_kv_chunks"]

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


def _consumer(plan: AsyncPlan, module: nn.Module, owner: str,
              current: Callable[[], "_Call"]) -> Callable[[AttentionCall], torch.Tensor]:
    """The attention call after the wait: the method's own loop (``plan.attend``, in
    ``methods/<m>/async_.py``) on the communicated tensors. ``current()`` is the :class:`_Call` of the
    forward in progress (its query / K/V chunks, head layout).

    A method that pipelines its query side waits the G chunks launched at the Q handoff one by one:
    ``wait q_0 -> attention_0 -> launch out_0 -> wait q_1 -> ... -> wait out_0 .. out_{G-1} ->
    concatenate`` (the later chunks' Q collectives travel while the earlier chunks compute; each
    output collective travels while the later chunks compute); Colossal's K/V pipeline merges the
    chunks' attention by LSE. Every query row sees exactly the keys it sees unpipelined: its global
    position goes to the engine (``q_pos``), with the batch meta's documents / padding, window,
    softcap and sinks."""
    who = f"module '{owner}'"

    def handler(call: AttentionCall) -> torch.Tensor:
        check_call(call, module, who, at="at the call")
        meta = current_cp_batch_meta()
        q, k, v = call.q, call.k, call.v
        kw = dict(meta=meta, scale=call.scale, window=call.window, softcap=call.softcap)
        sinks = call.sinks
        if sinks is not None and sinks.dtype != q.dtype:
            sinks = sinks.to(q.dtype)
        return plan.attend(plan, current(), q, k, v, meta, sinks, kw, keep_gathered_kv)

    return handler


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
    comm_keys = handoff_comm(method)
    if not comm_keys:
        raise ValueError(f"{who}: no async variant of method {method!r}")
    catalogue.check_degree(method, None, ulysses_degree, who)
    q_chunks = check_q_chunks(q_chunks, who)
    kv_chunks = check_kv_chunks(kv_chunks, who)
    ctx = current_apply_context()
    owner = ctx.fqn or type(target_module).__name__
    handoffs = get_handoffs(target_module, who)
    plan = make_plan(method, mesh, cp_mesh, ulysses_degree)
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
        if plan.check_meta is not None:
            plan.check_meta(meta, owner)

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
                for ci, part in enumerate(plan.split_q(out, q_chunks)):
                    c.q_parts.append(c.launch(chunk_name("q", ci), c.plans["q"], part))
                return None
            if plan.kv_chunked and q_chunk_count(out.shape[2], kv_chunks) > 1:
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
