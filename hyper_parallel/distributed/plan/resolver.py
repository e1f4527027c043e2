"""PlanOverrideResolver: turns ``plan_overrides`` into one declared CP method per attention
boundary of a real model instance, or fails before any collective with a message that names
the YAML field, the module FQN and the fix.

Checks (cp_size > 1): every ``when: cp`` entry matches at least one module; every matched
module is an attention boundary (or the entry declares a token-mixer method, ``mixer=True``);
every attention boundary gets exactly one method;
``inner_wrapper`` XOR ``local_compute_fn``; ``region_dispatch: false`` present whenever the
method communicates; ``inner_target`` exists; ``_target_`` imports, is ``@inner_wrapper``-
decorated and its named parameters exist; the wrapper's own ``validate`` hook passes.
With cp_size == 1, ``when: cp`` entries are skipped with an INFO log — except an ``at_cp1`` method's,
and every entry under ``packed_documents: independent`` (the methods run as a CP group of one; an
async or Hybrid wrapper, or a ``local_compute_fn``, is refused there by name).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib.util
import logging
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch.nn as nn

from ..context_parallel import catalogue
from ..context_parallel.meta import INDEPENDENT
from ..context_parallel.model_spec import find_attention_boundaries
from ..context_parallel.semantics import is_token_mixer, mixer_hint
from ..context_parallel.vision import carried_towers, media_input_names, media_module, vision_tower
from ..context_parallel.registry import (WrapperInfo, get_registered, import_target,
                                        registered_names, wrapper_info)
from ..errors import CPConfigError
from .spec import ModuleShardingSpec, TargetRef

_VISION = re.compile(r"vision|visual", re.IGNORECASE)     # a VLM's vision encoder (class or attribute name)

log = logging.getLogger("hyper_parallel.plan")


@dataclasses.dataclass
class ResolvedCPTarget:
    fqn: str                      # the matched attention boundary
    module: nn.Module
    inner_fqn: str                # module the method is installed on (inner_target)
    inner_module: nn.Module
    spec: ModuleShardingSpec
    kind: str                     # "inner_wrapper" | "local_compute_fn"
    fn: Callable
    info: WrapperInfo | None
    params: dict

    def describe(self) -> str:
        ref = self.spec.inner_wrapper if self.kind == "inner_wrapper" else self.spec.local_compute_fn
        method = self.info.method if self.info else "custom"
        sched = "async" if (self.info and self.info.is_async) else "sync"
        return f"{self.fqn} -> {self.kind}={ref.describe()} [{method}, {sched}] on '{self.inner_fqn}'"


@dataclasses.dataclass
class ResolvedPlan:
    cp_size: int
    boundaries: list
    targets: list
    skipped: list

    def hybrid_degrees(self) -> list[int]:
        return sorted({int(t.params["ulysses_degree"]) for t in self.targets if "ulysses_degree" in t.params})

    def summary(self) -> str:
        lines = [f"CP plan: cp_size={self.cp_size}, {len(self.boundaries)} attention boundaries, "
                 f"{len(self.targets)} declared"]
        lines += [f"  {t.describe()}" for t in self.targets]
        for spec in self.skipped:
            lines.append(f"  skipped {spec.field()} match={spec.match!r} (when: cp, cp_size=1)")
        return "\n".join(lines)


def resolve_wrapper(spec: ModuleShardingSpec, ref: TargetRef, fqn: str) -> tuple:
    """``(fn, WrapperInfo, params)`` of an ``inner_wrapper`` reference: the registry name or
    ``_target_`` resolves to an ``@inner_wrapper`` whose named parameters are exactly those
    given (unknown or missing ones refused). Needs no model and no ``cp_size``; no collective."""
    field = spec.field("inner_wrapper")
    if ref.name is not None:
        fn = get_registered(ref.name)
        if fn is None:
            raise CPConfigError(field, f"unknown inner_wrapper name {ref.name!r}", module=fqn,
                                fix=f"use one of {registered_names()} or a {{_target_: ...}} mapping")
    else:
        fn = import_callable(field, ref.target, fqn)
    info = wrapper_info(fn)
    if info is None:
        raise CPConfigError(field, f"{ref.describe()} is not decorated with @inner_wrapper", module=fqn,
                            fix="decorate it with hyper_parallel.distributed.context_parallel.inner_wrapper")
    unknown = sorted(set(ref.params) - set(info.named_params))
    if unknown:
        raise CPConfigError(f"{field}.{unknown[0]}",
                            f"{info.qualname} has no parameter(s) {unknown} (it takes {list(info.named_params)})",
                            module=fqn, fix="remove the key or fix its spelling")
    missing = [p for p in info.required_params if p not in ref.params]
    if missing:
        raise CPConfigError(f"{field}.{missing[0]}", f"{info.qualname} requires parameter(s) {missing}",
                            module=fqn, fix=f"add {missing[0]}: <value> under inner_wrapper")
    return fn, info, dict(ref.params)


def import_callable(field: str, path: str, fqn: str) -> Any:
    """Import a ``_target_`` path; an ImportError becomes a CPConfigError naming ``field``."""
    try:
        return import_target(path)
    except ImportError as exc:
        raise CPConfigError(f"{field}._target_", f"cannot import {path!r}: {exc}", module=fqn,
                            fix="check the dotted path (package.module.callable)") from exc


def check_plan_targets(specs: Sequence, source: str | Path | None = None) -> None:
    """Resolve every ``_target_`` and registry name of ``plan_overrides`` without a model — also in
    an entry that ``cp_size: 1`` skips — with :func:`resolve_wrapper`'s checks. A ``_target_``
    whose module is not importable is looked for next to the config file ``source``: in its
    directory, then each parent, the first holding the module's file (``a/b/c.py`` or
    ``a/b/c/__init__.py`` for ``a.b.c``) is put on ``sys.path`` (so ``examples/cp/custom_wrapper.yaml``
    finds ``examples.cp.custom_wrapper_example`` from any working directory)."""
    for spec in specs:
        for ref, field in ((spec.inner_wrapper, "inner_wrapper"), (spec.local_compute_fn, "local_compute_fn")):
            if ref is None:
                continue
            if ref.target is not None and source is not None:
                _add_module_dir(ref.target, Path(source))
            if field == "inner_wrapper":
                resolve_wrapper(spec, ref, spec.match)
            elif ref.target is not None:
                import_callable(spec.field(field), ref.target, spec.match)


def _add_module_dir(target: str, source: Path) -> None:
    parts = target.split(".")
    try:
        if importlib.util.find_spec(parts[0]) is not None:
            return
    except (ImportError, ValueError):
        return
    for base in [source.resolve().parent, *source.resolve().parent.parents]:
        for cut in range(len(parts) - 1, 0, -1):
            rel = Path(*parts[:cut])
            if (base / rel.with_suffix(".py")).is_file() or (base / rel / "__init__.py").is_file():
                if str(base) not in sys.path:
                    sys.path.insert(0, str(base))
                return


class PlanOverrideResolver:
    """Binds the ``when: cp`` entries to one model's modules at one ``cp_size`` (:meth:`resolve`)."""

    def __init__(self, specs: list[ModuleShardingSpec], cp_size: int, packed_documents: Optional[str] = None):
        self.specs = list(specs)
        self.cp_size = cp_size
        self.packed_documents = packed_documents

    def _declares_mixer(self, spec: ModuleShardingSpec, fqn: str) -> bool:
        """True when ``spec`` declares a token-mixer method (``@inner_wrapper(mixer=True)``, see
        :mod:`..context_parallel.mixers`): those may be installed on non-attention modules."""
        if spec.inner_wrapper is None:
            return False
        _fn, info, _params = resolve_wrapper(spec, spec.inner_wrapper, fqn)
        return bool(getattr(info, "mixer", False))

    def _runs_at_cp1(self, spec: ModuleShardingSpec) -> bool:
        """True when ``spec`` declares a method installed at cp_size 1 too: every method under
        ``packed_documents: independent`` (the declared methods run as a CP group of one, so each packed
        document computes as if alone, as under CP), else an ``@inner_wrapper(at_cp1=True)`` one (its
        one-rank computation fixes a selection transformers leaves unspecified)."""
        if spec.inner_wrapper is None:
            if self.packed_documents == INDEPENDENT and spec.local_compute_fn is not None:
                raise CPConfigError(
                    spec.field("local_compute_fn"), "with packed_documents: independent the declared methods also run "
                    "at cp_size 1, as a CP group of one, but a local_compute_fn is not run there (it would leave the "
                    "module to plain transformers at cp_size 1 only)", fix="declare an inner_wrapper for this module, "
                    "or packed_documents: as_transformers")
            return False
        _fn, info, _params = resolve_wrapper(spec, spec.inner_wrapper, spec.match)
        if self.packed_documents != INDEPENDENT:
            return bool(getattr(info, "at_cp1", False))
        if info is not None and info.is_async:
            raise CPConfigError(
                spec.field("inner_wrapper"), f"{spec.inner_wrapper.describe()} is async, but with packed_documents: "
                "independent the declared methods also run at cp_size 1, as a CP group of one, where an async "
                "wrapper has no CP mesh and nothing to overlap", fix="declare the sync wrapper of the same method "
                "for the cp_size 1 run (e.g. sdpa_hf for colossal), or packed_documents: as_transformers")
        row = catalogue.METHODS.get(info.method) if info is not None else None
        if row is not None and row.degree == "param":        # Hybrid: a degree between 1 and cp_size
            raise CPConfigError(
                spec.field("inner_wrapper"), f"{spec.inner_wrapper.describe()} needs 1 < {row.degree_param} < cp_size, "
                "but with packed_documents: independent the declared methods also run at cp_size 1, as a CP group "
                "of one", fix="declare the colossal or Ulysses wrapper for the cp_size 1 run (at one rank every "
                "method computes the same), or packed_documents: as_transformers")
        return True

    # -- main -----------------------------------------------------------------------
    def resolve(self, model: nn.Module) -> ResolvedPlan:
        """Bind every ``when: cp`` entry to the attention boundaries of ``model``; return a ResolvedPlan.

        Runs on every rank, locally: imports/looks up each ``_target_``, checks the entry
        (one method per boundary, ``region_dispatch: false``, ``inner_target``, named params)
        and runs the wrapper's ``validate(inner_module, cp_size=..., **params)`` hook with the
        model's global heads (``tp_size`` is left at its default 1; the planner re-runs it with
        the TP degree). Issues no collective and modifies nothing. With ``cp_size == 1`` the
        ``when: cp`` entries are skipped (``ResolvedPlan.skipped``) — except those declaring an
        ``at_cp1`` method, bound like at cp > 1 — and no boundary needs a method. Raises :class:`CPConfigError` (YAML field, module FQN, fix) on the first
        problem.
        """
        names = dict(model.named_modules())
        boundaries = find_attention_boundaries(model)
        cp_specs, skipped = [], []
        for spec in self.specs:
            if spec.declares_cp_method and spec.when != "cp":
                raise CPConfigError(spec.field("when"), "an entry declaring a CP method must say 'when: cp'",
                                    fix="add 'when: cp' to the entry")
            if spec.when != "cp":
                continue
            if self.cp_size == 1 and not self._runs_at_cp1(spec):
                log.info("plan_overrides: skipping %s match=%r (when: cp, cp_size=1)", spec.field(), spec.match)
                skipped.append(spec)
                continue
            cp_specs.append(spec)

        tower = vision_tower(model)
        if self.cp_size > 1:
            self._refuse_uncarried_vision(model, names, boundaries, tower)
        owner: dict[str, ModuleShardingSpec] = {}
        targets: list[ResolvedCPTarget] = []
        for spec in cp_specs:
            matched = [n for n in names if n and fnmatch.fnmatchcase(n, spec.match)]
            if tower is not None and matched:       # a carried tower runs per rank on whole media, never under CP
                outside = [n for n in matched if not tower.holds(n)]
                if not outside:
                    raise CPConfigError(spec.field("match"), f"pattern {spec.match!r} matches only modules of the "
                                        f"vision tower ({tower.prefix}), which runs per rank on whole media, not "
                                        "under CP (context_parallel/vision.py)", module=matched[0],
                                        fix="drop this entry; declare methods for the language model's attentions "
                                            "only (e.g. match: 'model.language_model.layers.*.self_attn')")
                matched = outside
            if not matched:
                raise CPConfigError(spec.field("match"), f"pattern {spec.match!r} matches no module of "
                                    f"{type(model).__name__}",
                                    fix=f"match one of the attention modules, e.g. {boundaries[:3]}")
            if not spec.declares_cp_method:
                raise CPConfigError(spec.field(), "declares no CP method", module=matched[0],
                                    fix="add inner_wrapper (e.g. sdpa_hf) or local_compute_fn")
            if spec.inner_wrapper is not None and spec.local_compute_fn is not None:
                raise CPConfigError(spec.field("local_compute_fn"),
                                    "inner_wrapper and local_compute_fn are mutually exclusive",
                                    module=matched[0], fix="keep exactly one of them")
            if spec.inner_target is None:
                raise CPConfigError(spec.field("inner_target"), "is required for a CP method", module=matched[0],
                                    fix="add 'inner_target: self' (or the attribute path of the inner attention)")
            for fqn in matched:
                if fqn not in boundaries and not self._declares_mixer(spec, fqn):
                    raise CPConfigError(spec.field("match"),
                                        f"{type(names[fqn]).__name__} is not an attention boundary", module=fqn,
                                        fix=f"match attention modules only (found: {boundaries[:3]}...) or "
                                            "register_cp_model_spec(attention_targets=...); for a token mixer "
                                            "(Gated DeltaNet, Mamba2, short conv) declare a mixer method, e.g. "
                                            "inner_wrapper: sequence_gather")
                if fqn in owner:
                    raise CPConfigError(spec.field("match"),
                                        f"conflicts with {owner[fqn].field()} (match={owner[fqn].match!r}): "
                                        "two CP methods for one attention", module=fqn,
                                        fix="make the match patterns disjoint")
                owner[fqn] = spec
                targets.append(self._resolve_target(spec, fqn, names))

        if self.cp_size > 1:
            for fqn in boundaries:
                if tower is not None and tower.holds(fqn):
                    continue         # the tower runs per rank on whole images (context_parallel/vision.py)
                if fqn not in owner and is_token_mixer(names[fqn]):
                    raise CPConfigError("plan_overrides", "is named like an attention boundary but its forward makes "
                                        "no SDPA or attention-interface call, and no CP method is declared for it "
                                        f"(accelerator.cp_size={self.cp_size})", module=fqn,
                                        fix=mixer_hint(names[fqn], self.cp_size, fqn))
                if fqn not in owner:
                    raise CPConfigError("plan_overrides", f"attention boundary has no CP method declared "
                                        f"(accelerator.cp_size={self.cp_size}; there is no default method)",
                                        module=fqn,
                                        fix="add {match: '*.self_attn', when: cp, region_dispatch: false, "
                                            "inner_target: self, inner_wrapper: <method>}")
        return ResolvedPlan(self.cp_size, boundaries, targets, skipped)

    def _refuse_uncarried_vision(self, model: nn.Module, names: dict, boundaries: list, tower) -> None:
        """At cp_size > 1, refuse (before any declaration is read) the first attention of a vision encoder
        whose family registers no tower (an unregistered VLM), naming it and the fix; or, where no such
        attention is recognised, a model that takes images or video (``vision.media_input_names``) without a
        registered tower, naming its media encoder."""
        model_type = getattr(getattr(model, "config", None), "model_type", "?")
        for fqn in boundaries:
            if tower is not None and tower.holds(fqn):
                continue
            if _VISION.search(type(names[fqn]).__name__) or any(_VISION.search(p) for p in fqn.split(".")):
                raise CPConfigError(
                    "plan_overrides", f"{type(names[fqn]).__name__} is the attention of a vision encoder of "
                    f"{type(model).__name__} (model_type {model_type!r}), whose tower is not registered"
                    ": CP shards the language model's token sequence only, while the vision tower "
                    "runs on image patches and the model feeds its features to the token sequence — not carried "
                    f"(accelerator.cp_size={self.cp_size}; refused whether or not a method is declared)",
                    module=fqn, fix="train the language model alone under CP (its *ForCausalLM on inputs_embeds with "
                    "the model's position ids, docs/strategies/batch_contract.md), the "
                    f"multimodal model with accelerator.cp_size=1, or a VLM whose tower is carried "
                    f"({', '.join(carried_towers())}: docs/vlm.md; a new family registers its tower from "
                    "models/<model_type>/vision.py)")
        inputs = media_input_names(model)
        if tower is None and inputs:     # a tower with no attention recognised above (patch projection, VQ, conv)
            where = media_module(model)
            raise CPConfigError(
                "plan_overrides", f"{type(model).__name__} (model_type {model_type!r}) takes images or video "
                f"({', '.join(inputs)}) through {type(names[where]).__name__ if where else 'its media encoder'}, "
                "whose tower is not registered: under CP the media features would be scattered into a shard of "
                "the token sequence without being spread over the CP group or exchanged (media_embeddings_for_cp) "
                f"— not carried (accelerator.cp_size={self.cp_size})", module=where or None,
                fix="the multimodal model with accelerator.cp_size=1, the language model alone under CP, or a VLM "
                f"whose tower is carried ({', '.join(carried_towers())}: docs/vlm.md; a new family registers its "
                "tower from models/<model_type>/vision.py)")

    def _resolve_target(self, spec: ModuleShardingSpec, fqn: str, names: dict) -> ResolvedCPTarget:
        module = names[fqn]
        if spec.inner_target == "self":
            inner_fqn, inner = fqn, module
        else:
            inner_fqn = f"{fqn}.{spec.inner_target}"
            if inner_fqn not in names:
                raise CPConfigError(spec.field("inner_target"),
                                    f"{type(module).__name__} has no submodule {spec.inner_target!r}", module=fqn,
                                    fix="use 'self' or an existing child path "
                                        f"({[n for n, _ in module.named_children()][:6]})")
            inner = names[inner_fqn]
        if spec.inner_wrapper is not None:
            fn, info, params = resolve_wrapper(spec, spec.inner_wrapper, fqn)
            kind = "inner_wrapper"
            communicates = info.communicates
        else:
            ref = spec.local_compute_fn
            field = spec.field("local_compute_fn")
            fn = get_registered(ref.name) if ref.name else import_callable(field, ref.target, fqn)
            if fn is None or not callable(fn):
                raise CPConfigError(field, f"{ref.describe()} is not a callable", module=fqn)
            info, params, kind = wrapper_info(fn), dict(ref.params), "local_compute_fn"
            communicates = True  # user compute replacing a CP region: treat as communicating
        if spec.region_dispatch is None:
            raise CPConfigError(spec.field("region_dispatch"), "is required for a CP method and must be false",
                                module=fqn, fix="add 'region_dispatch: false'")
        if spec.region_dispatch and communicates:
            raise CPConfigError(spec.field("region_dispatch"),
                                "must be false: the declared method issues CP collectives, and region "
                                "dispatch would issue conflicting communication", module=fqn,
                                fix="set 'region_dispatch: false'")
        if info is not None and info.validate is not None:
            try:
                info.validate(inner, cp_size=self.cp_size, **params)
            except CPConfigError:
                raise
            except (ValueError, TypeError) as exc:
                raise CPConfigError(spec.field(kind), str(exc), module=fqn) from exc
        return ResolvedCPTarget(fqn, module, inner_fqn, inner, spec, kind, fn, info, params)
