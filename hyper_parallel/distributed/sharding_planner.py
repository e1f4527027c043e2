"""ShardingPlanner: plan_overrides + topology -> ShardingPlan (module specs + explicit CP intent).

The planner identifies boundaries (attention modules, decoder layers) and TP placements; it
never picks a CP method — each attention boundary's method is exactly what ``plan_overrides``
declares (resolved and validated by :class:`~.plan_resolver.PlanOverrideResolver`). On top of
the resolver it checks what needs the whole plan or the TP degree:

* the wrapper ``validate`` hooks again with TP-local heads (``tp_size``);
* a registered model spec's allowed wrappers (``register_cp_model_spec(wrappers=...)``);
* async wrappers must be model adapters for this architecture (design 4.4);
* Ulysses/Hybrid and Head-Tail load balance are not combined in one model (one batch layout);
* token-mixer methods (:mod:`.context_parallel.mixers`) are not combined with Head-Tail;
* TP plan exists and divides the layers; sequence/loss parallel and EP are not part of Phase 1.

Usage (design 3.2)::

    plan = ShardingPlanner(plan_overrides={
        "model.layers.*.self_attn": ModuleShardingSpec(inner_target="self", inner_wrapper="sdpa_hf",
                                                       region_dispatch=False, when="cp"),
    }).plan(model, mesh, tp_size=1, cp_size=2, ep_size=1, sequence_parallel=False, loss_parallel=False)
    model, tp_grad_info = apply_sharding_plan(model, plan, mesh)   # proves the CP model (opt-out:
                                                                   # preflight_proof=False)

The mapping form's entries default to ``when: cp`` (the design's snippet omits it).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

import torch.nn as nn

from .context_parallel import catalogue
from .context_parallel.model_spec import get_cp_model_spec, model_architecture
from .errors import CPConfigError
from .plan_resolver import PlanOverrideResolver, ResolvedCPTarget, ResolvedPlan
from .sharding_config import ModuleShardingSpec, parse_plan_overrides
from .tensor_parallel import check_tp_plan, find_decoder_layers, get_tp_plan

# wrapper method -> shard_batch_for_cp policy (one policy per batch), read from the catalogue
METHOD_POLICY = catalogue.method_policies()


def _reorders(method: str) -> bool:
    """The method's batch layout is not the contiguous one (Head-Tail): it cannot share a model."""
    return method in METHOD_POLICY and catalogue.get_method(method).layout != "contiguous"


def _splits_heads(method: str) -> bool:
    return method in METHOD_POLICY and catalogue.get_method(method).head_rule == "split"


@dataclasses.dataclass
class ShardingPlan:
    """What :func:`~.sharding_applier.apply_sharding_plan` applies, in order TP -> CP -> AC -> FSDP."""

    module_specs: dict                 # attention FQN -> the declared ModuleShardingSpec (explicit CP intent)
    cp_targets: list                   # list[ResolvedCPTarget]: fn, params, inner module per boundary
    resolved: ResolvedPlan             # the resolver's result (boundaries, skipped entries, summary)
    attention_boundaries: list         # every attention boundary FQN found in the model
    decoder_layers: list               # decoder-layer FQNs (TP / activation checkpointing / FSDP units)
    tp_layer_plan: dict                # decoder-layer-relative FQN -> "colwise" | "rowwise" ({} when tp 1)
    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    batch_policy: Optional[str] = None  # shard_batch_for_cp policy for this plan (None when cp 1)
    batch_prepare_fn: Optional[Callable] = None  # from a registered model spec, if any
    architecture: Optional[str] = None

    def hybrid_degrees(self) -> list[int]:
        return self.resolved.hybrid_degrees()

    def summary(self) -> str:
        lines = [f"sharding plan: arch={self.architecture} tp={self.tp_size} cp={self.cp_size} ep={self.ep_size} "
                 f"decoder_layers={len(self.decoder_layers)} batch_policy={self.batch_policy}"]
        if self.tp_layer_plan:
            lines.append("  TP per layer: " + ", ".join(f"{k}={v}" for k, v in self.tp_layer_plan.items()))
        lines.append(self.resolved.summary())
        from .context_parallel.wrappers.heads import head_layout_lines   # lazy: the planner does not import wrappers

        lines += head_layout_lines(self.cp_targets, self.cp_size, self.tp_size)   # Ulysses/Hybrid per-rank heads
        return "\n".join(lines)


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
        methods.setdefault(t.info.method if t.info is not None else "custom", t.fqn)
    if not methods:
        return None
    seq_head = [m for m in methods if _splits_heads(m)]
    reorder = [m for m in methods if _reorders(m)]
    if reorder:
        lb = next(t for t in targets if t.info is not None and t.info.method == reorder[0])
        title = catalogue.get_method(reorder[0]).title
        if seq_head:
            raise CPConfigError(
                _field(lb), f"{title} cannot be combined with {'/'.join(seq_head).title()} "
                f"(used on '{methods[seq_head[0]]}') in one model: Ulysses/Hybrid + Head-Tail is not a supported "
                "combination", module=lb.fqn,
                fix="use the load-balance wrapper on every attention, or the Ulysses/Hybrid wrapper on every attention")
        if len(methods) > 1:
            raise CPConfigError(
                _field(lb), f"{title} reorders the whole sequence and cannot be mixed with other CP "
                f"methods in one model (found {sorted(methods)})", module=lb.fqn,
                fix="declare the load-balance wrapper on every attention, or none")
    return catalogue.batch_policy_for(methods)


def _check_mixer_layout(targets: list) -> None:
    """Token-mixer methods (``@inner_wrapper(mixer=True)``) are declared for the contiguous layout
    only: refuse them next to a Head-Tail load-balance attention (before ``_batch_policy``'s
    generic rule, so the message names the mixer's field)."""
    mixers = [t for t in targets if t.info is not None and getattr(t.info, "mixer", False)]
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
    lb = next((t for t in targets if t.info is not None and _reorders(t.info.method)), None)
    if mixers and lb is not None:
        m = mixers[0]
        raise CPConfigError(
            _field(m), f"token-mixer method {m.info.qualname.rsplit('.', 1)[-1]} needs the contiguous layout "
            f"(rank r owns global tokens [r*S/C, (r+1)*S/C) and runs the module on them in order), but "
            f"{_field(lb)} declares Head-Tail load balance on '{lb.fqn}'; a mixer method and Head-Tail are not "
            "combined in one model", module=m.fqn,
            fix="declare a contiguous-layout attention method (sdpa_hf, sdpa_hf_ulysses, hybrid) instead of "
                "the load-balance wrapper, or use accelerator.cp_size: 1")


class ShardingPlanner:
    """``ShardingPlanner(plan_overrides=...)``: the YAML list, the mapping form, or specs."""

    def __init__(self, plan_overrides: Any = None):
        if isinstance(plan_overrides, dict):
            fixed = {}
            for pattern, spec in plan_overrides.items():
                if isinstance(spec, ModuleShardingSpec) and spec.when is None and spec.declares_cp_method:
                    spec = dataclasses.replace(spec, when="cp")
                elif isinstance(spec, dict) and "when" not in spec and (
                        spec.get("inner_wrapper") is not None or spec.get("local_compute_fn") is not None):
                    spec = {**spec, "when": "cp"}
                fixed[pattern] = spec
            plan_overrides = fixed
        if isinstance(plan_overrides, list) and all(isinstance(s, ModuleShardingSpec) for s in plan_overrides) \
                and all(s.index is not None for s in plan_overrides):
            self.specs = list(plan_overrides)
        else:
            self.specs = parse_plan_overrides(plan_overrides)

    def plan(self, model: nn.Module, device_mesh=None, *, tp_size: int = 1, cp_size: int = 1, ep_size: int = 1,
             sequence_parallel: bool = False, loss_parallel: bool = False) -> ShardingPlan:
        """Resolve ``plan_overrides`` on ``model`` and check everything that needs the topology.

        ``device_mesh`` (a MeshContext, optional) must have been built with the same
        ``tp_size`` / ``cp_size`` / ``ep_size``. Runs
        :meth:`~.plan_resolver.PlanOverrideResolver.resolve` (global heads), then, when
        ``tp_size > 1``, the TP plan checks and every wrapper ``validate`` hook that accepts
        ``tp_size`` again with the TP degree (so head splits are checked per TP rank, probe
        off); model-spec wrapper lists; async wrappers must be adapters for this
        architecture; one batch policy for the whole model. Local only: no collective, the
        model is not modified (``apply_sharding_plan`` applies the result). Raises
        :class:`~.errors.CPConfigError` naming the field, module and fix.
        """
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
        if ep_size > 1:
            raise CPConfigError("accelerator.ep_size", f"ep_size={ep_size}: EP+CP is not a Phase 1 production "
                                "combination; the planner places no experts", fix="set ep_size: 1")

        resolved = PlanOverrideResolver(self.specs, cp_size).resolve(model)
        arch = model_architecture(model)
        layers = find_decoder_layers(model)
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

        spec = get_cp_model_spec(model)
        for t in resolved.targets:
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
                        "model-specific wrapper that owns its handoff/launch/wait contract (design 4.4)",
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

        if cp_size > 1:
            _check_mixer_layout(resolved.targets)
        policy = _batch_policy(resolved.targets) if cp_size > 1 else None
        return ShardingPlan(
            module_specs={t.fqn: t.spec for t in resolved.targets},
            cp_targets=list(resolved.targets), resolved=resolved,
            attention_boundaries=list(resolved.boundaries), decoder_layers=layers, tp_layer_plan=tp_plan,
            tp_size=tp_size, cp_size=cp_size, ep_size=ep_size, sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel, batch_policy=policy,
            batch_prepare_fn=spec.batch_prepare_fn if spec is not None else None, architecture=arch)
