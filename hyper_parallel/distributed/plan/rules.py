"""The Phase-1 refusals that need the whole plan or the topology, in one place.

Each raises :class:`~..errors.CPConfigError` naming the YAML field, the module and the fix;
local only, no collective, nothing modified:

* :func:`check_topology` — degrees are integers >= 1 and match the MeshContext; sequence / loss
  parallelism and EP are not applied in Phase 1;
* :func:`tp_layer_plan` — a TP plan exists for the architecture and divides the layers;
* :func:`check_target` — a registered model spec's allowed wrappers; an async wrapper is a model
  adapter for this architecture; the wrapper's ``validate`` hook again with TP-local
  heads;
* :func:`batch_policy` — one batch layout per model: a reordering method (Head-Tail, balanced) is on
  every attention or none, never with Ulysses/Hybrid; a token-mixer method runs next to any layout
  in :data:`MIXER_LAYOUTS` (moved to the contiguous one when permuted) and has no CP method inside it.
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch.nn as nn

from ..context_parallel import catalogue
from ..errors import CPConfigError
from ..tensor_parallel import check_tp_plan, get_tp_plan
from .resolver import ResolvedCPTarget, resolve_wrapper

__all__ = ["MIXER_LAYOUTS", "check_topology", "tp_layer_plan", "check_target", "batch_policy", "documents_matter"]



def _reorders(method: str) -> bool:
    """The method's batch layout is not the contiguous one (Head-Tail): it cannot share a model."""
    return method in catalogue.method_policies() and catalogue.reorders(catalogue.get_method(method))


def _splits_heads(method: str) -> bool:
    return method in catalogue.method_policies() and catalogue.get_method(method).head_rule == "split"


def _validate_accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _ref_names(target: ResolvedCPTarget) -> set:
    ref = target.spec.inner_wrapper if target.kind == "inner_wrapper" else target.spec.local_compute_fn
    names = {ref.name, ref.target}
    if target.info is not None:
        names.add(target.info.qualname)
        names.add(getattr(target.fn, "__name__", None))
    fn_mod = getattr(target.fn, "__module__", None)
    if fn_mod:
        names.add(f"{fn_mod}.{getattr(target.fn, '__qualname__', '')}")
    return {n for n in names if n}


def _field(target: ResolvedCPTarget) -> str:
    return target.spec.field(target.kind)


def _batch_policy(targets: list) -> Optional[str]:
    """One batch policy for the model (:func:`~.context_parallel.catalogue.batch_policy_for`);
    a method that reorders the sequence (catalogue ``layout``, Head-Tail) must be on every
    attention. Raises CPConfigError naming the field and module."""
    methods: dict[str, str] = {}
    for t in targets:
        if not _is_mixer(t):       # mixers reach any layout contiguously (_check_mixer_layout)
            methods.setdefault(t.info.method if t.info is not None else "custom", t.fqn)
    if not methods:
        return None if not targets else "all_gather"
    seq_head = [m for m in methods if _splits_heads(m) and not _reorders(m)]   # Hybrid on the balanced split: itself
    reorder = [m for m in methods if _reorders(m)]
    if reorder:
        lb = next(t for t in targets if t.info is not None and t.info.method == reorder[0])
        title = catalogue.get_method(reorder[0]).title
        if seq_head:
            raise CPConfigError(
                _field(lb), f"{title} cannot be combined with {'/'.join(seq_head).title()} "
                f"(used on '{methods[seq_head[0]]}') in one model: Ulysses/Hybrid + {title} is not a supported "
                "combination", module=lb.fqn,
                fix=f"use the {reorder[0]} wrapper on every attention, or the Ulysses/Hybrid wrapper on every "
                    "attention")
        if len(methods) > 1:
            raise CPConfigError(
                _field(lb), f"{title} reorders the whole sequence and cannot be mixed with other CP "
                f"methods in one model (found {sorted(methods)})", module=lb.fqn,
                fix=f"declare the {reorder[0]} wrapper on every attention, or none")
    return catalogue.batch_policy_for(methods)


#: batch layouts (catalogue ``layout``) a token-mixer method runs under exactly: "contiguous";
#: "head_tail" (Head-Tail keeps the contiguous layout at the module boundary); "balanced" (the mixer's
#: tokens move to the contiguous layout and back, ``mixers.layout.on_contiguous_layout``)
MIXER_LAYOUTS = (catalogue.CONTIGUOUS, catalogue.HEAD_TAIL, catalogue.BALANCED)


def _is_mixer(t: ResolvedCPTarget) -> bool:
    return t.info is not None and bool(getattr(t.info, "mixer", False))


def _check_mixer_layout(targets: list) -> None:
    """Token-mixer methods (``@inner_wrapper(mixer=True)``) run on the contiguous layout: refuse
    them next to an attention method whose layout is not in :data:`MIXER_LAYOUTS` (before
    ``_batch_policy``'s generic rule, so the message names the mixer's field), and any CP method
    declared inside a mixer."""
    mixers = [t for t in targets if _is_mixer(t)]
    for m in mixers:
        for t in targets:
            m_outer = t.inner_fqn.startswith(m.inner_fqn + ".")
            if t is not m and (m_outer or m.inner_fqn.startswith(t.inner_fqn + ".")):
                outer, inner = (m, t) if m_outer else (t, m)
                raise CPConfigError(
                    _field(inner), f"'{inner.inner_fqn}' is inside '{outer.inner_fqn}', which {_field(outer)} also "
                    "declares a CP method for: a token-mixer method runs its module on the whole sequence, so "
                    "nothing inside it may carry a CP method of its own", module=inner.fqn,
                    fix="make the match patterns select only the mixer modules themselves (e.g. '*[0-9].conv' "
                        "rather than '*.conv', which also matches LFM2's inner 'conv.conv')")
    lb = next((t for t in targets if t.info is not None and _reorders(t.info.method)
               and catalogue.get_method(t.info.method).layout not in MIXER_LAYOUTS), None)
    if mixers and lb is not None:
        m = mixers[0]
        title = catalogue.get_method(lb.info.method).title
        raise CPConfigError(
            _field(m), f"token-mixer method {m.info.qualname.rsplit('.', 1)[-1]} runs on the contiguous layout "
            f"(rank r owns global tokens [r*S/C, (r+1)*S/C) and runs the module on them in order), but "
            f"{_field(lb)} declares {title} on '{lb.fqn}', whose layout "
            f"'{catalogue.get_method(lb.info.method).layout}' has no exchange to it; a mixer method and "
            f"{lb.info.method} are not combined in one model", module=m.fqn,
            fix=f"declare an attention method whose layout a mixer can follow ({', '.join(sorted(MIXER_LAYOUTS))}) "
                f"instead of the {lb.info.method} wrapper, or use accelerator.cp_size: 1")


def check_topology(tp_size: int, cp_size: int, ep_size: int, sequence_parallel: bool, loss_parallel: bool,
                   device_mesh=None) -> None:
    """The degrees, against ``device_mesh`` (a MeshContext) when given, and the Phase-1 topology."""
    for name, val in (("tp_size", tp_size), ("cp_size", cp_size), ("ep_size", ep_size)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise CPConfigError(f"accelerator.{name}", f"must be an integer >= 1, got {val!r}")
    if device_mesh is not None and hasattr(device_mesh, "sizes"):
        s = device_mesh.sizes
        for name, want, have in (("cp_size", cp_size, s.cp), ("tp_size", tp_size, s.tp), ("ep_size", ep_size, s.ep)):
            if want != have:
                raise CPConfigError(f"accelerator.{name}", f"plan asks {name}={want} but the mesh was built with "
                                    f"{have}", fix="plan with the sizes the MeshContext was built from")
    if sequence_parallel:
        raise CPConfigError("accelerator.sequence_parallel", "sequence parallelism is not applied by the Phase 1 "
                            "planner (CP already shards the sequence)", fix="set sequence_parallel: false")
    if loss_parallel:
        raise CPConfigError("accelerator.loss_parallel", "loss parallelism (vocab-sharded logits) is not applied "
                            "by the Phase 1 planner", fix="set loss_parallel: false")


def check_routing_noise(model: nn.Module, cp_size: int, ep_size: int) -> None:
    """Router jitter (Mixtral's ``router_jitter_noise``: a random factor on each token's router input
    in training) draws other random numbers when the tokens are split, so CP/EP would not compute what
    one rank computes: refused naming the first module and the config field."""
    if cp_size == 1 and ep_size == 1:
        return
    for fqn, m in model.named_modules():
        noise = getattr(m, "jitter_noise", None)
        if isinstance(noise, (int, float)) and not isinstance(noise, bool) and noise > 0:
            raise CPConfigError("model.config.router_jitter_noise", f"{type(m).__name__} multiplies its router input "
                                f"by random noise ({noise}) in training; split over cp_size={cp_size} x "
                                f"ep_size={ep_size} ranks it draws other numbers than one rank does", module=fqn,
                                fix="set router_jitter_noise: 0 (the transformers default), or cp_size and ep_size 1")


def tp_layer_plan(model: nn.Module, layers: list, tp_size: int, arch: Optional[str]) -> dict:
    """The per-layer TP plan (``{}`` when ``tp_size`` is 1), checked against the model's layers."""
    tp_plan: dict = {}
    if tp_size > 1:
        tp_plan = get_tp_plan(model) or {}
        if not tp_plan:
            raise CPConfigError("accelerator.tp_size", f"tp_size={tp_size} but there is no TP plan for "
                                f"architecture {arch!r}", fix="register_tp_plan(architecture, {...}) or tp_size: 1")
        if not layers:
            raise CPConfigError("accelerator.tp_size", f"no decoder layers found in {type(model).__name__}")
        try:
            check_tp_plan(model, layers, tp_plan, tp_size)
        except ValueError as exc:
            raise CPConfigError("accelerator.tp_size", str(exc)) from exc
    return tp_plan


def check_target(t: ResolvedCPTarget, spec, arch: Optional[str], cp_size: int, tp_size: int) -> None:
    """One resolved target against the model spec ``spec``, the architecture and the TP degree."""
    if spec is not None and spec.wrappers and not (_ref_names(t) & set(spec.wrappers)):
        raise CPConfigError(
            _field(t), f"{t.spec.inner_wrapper.describe() if t.kind == 'inner_wrapper' else t.kind} is not "
            f"among the wrappers registered for architecture {spec.architecture!r} "
            f"({list(spec.wrappers)})", module=t.fqn, fix=f"declare one of {list(spec.wrappers)}")
    info = t.info
    if info is not None and info.is_async:
        adapters = info.model_adapter if isinstance(info.model_adapter, (tuple, list)) else (
            (info.model_adapter,) if info.model_adapter else ())
        if not adapters:
            raise CPConfigError(
                _field(t), f"{info.qualname} is async but declares no model_adapter: async CP must be a "
                "model-specific wrapper that owns its handoff/launch/wait contract",
                module=t.fqn, fix="use the sync wrapper, or an async wrapper written for this model "
                                  "(@inner_wrapper(is_async=True, model_adapter='<model_type>'))")
        if arch not in adapters:
            raise CPConfigError(
                _field(t), f"{info.qualname} is an async adapter for {list(adapters)}, but the model is "
                f"{arch!r}", module=t.fqn, fix="declare the sync wrapper or this model's own async wrapper")
    if tp_size > 1 and info is not None and info.validate is not None and _validate_accepts(info.validate, "tp_size"):
        kwargs = dict(t.params)
        if _validate_accepts(info.validate, "probe"):
            kwargs["probe"] = False
        try:
            info.validate(t.inner_module, cp_size=cp_size, tp_size=tp_size, **kwargs)
        except CPConfigError:
            raise
        except (ValueError, TypeError) as exc:
            raise CPConfigError(_field(t), str(exc), module=t.fqn) from exc


def batch_policy(targets: list, cp_size: int) -> Optional[str]:
    """The model's one batch policy (None when cp is 1), after the layout rules."""
    if cp_size == 1:
        return None
    _check_mixer_layout(targets)
    return _batch_policy(targets)


def documents_matter(model: nn.Module, resolved) -> list:
    """Where the meaning of packed documents (``packed_documents``) changes what the model computes:
    each declared token-mixer method (it keeps documents apart; transformers' torch paths run its
    state across them) but the ``at_cp1`` ones (apart at every size, as transformers' own mask), and
    each attention whose temperature tuning follows the row index in transformers (Llama 4 NoPE
    layers). Local, no collective."""
    import torch

    from ..context_parallel.semantics import query_position_rescale

    out = []
    for t in resolved.targets:
        if t.info is not None and t.info.mixer and not t.info.at_cp1:
            out.append(f"'{t.fqn}' ({t.spec.inner_wrapper.describe()})")
    for spec in resolved.skipped:
        if spec.inner_wrapper is not None:
            _fn, info, _p = resolve_wrapper(spec, spec.inner_wrapper, spec.match)
            if info is not None and info.mixer and not info.at_cp1:
                out.append(f"{spec.match!r} ({spec.inner_wrapper.describe()})")
    one = torch.zeros(1, 1, dtype=torch.int64)
    out.extend(f"'{fqn}' (attention temperature tuning on the row index)" for fqn, m in model.named_modules()
               if query_position_rescale(m, one, one) is not None)
    return out
