"""The refusal: the :class:`CPConfigError` naming the first differing module, whether a
``plan_overrides`` entry covers it, why it differs and the fix."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

from ...errors import CPConfigError
from ..semantics import mixer_methods_for, uncarried_attention_semantics
from .report import FIX, PROOF_TOLERANCE, REASON_DECLARED, REASON_UNDECLARED, _dtype

if TYPE_CHECKING:
    from .prover import _Prover


def _covering(plan, fqn: str):
    """(spec, declared fqn) of the plan_overrides entry covering ``fqn`` (itself or an ancestor), or None."""
    for t in getattr(plan, "cp_targets", []) or []:
        for declared in (t.fqn, t.inner_fqn):
            if fqn == declared or fqn.startswith(declared + "."):
                return t
    return None


def _contained(plan, fqn: str) -> list:
    return [t.fqn for t in getattr(plan, "cp_targets", []) or [] if t.fqn.startswith(fqn + ".")]


def _parent_of_layers(names: dict, layer_fqn: str) -> tuple[str, str]:
    parts = layer_fqn.split(".")
    for i in range(len(parts) - 1, 0, -1):
        cand = ".".join(parts[:i])
        mod = names.get(cand)
        if mod is not None and not isinstance(mod, nn.ModuleList):
            return cand, type(mod).__name__
    return "", "the model"


def _refusal(prover: _Prover, check: tuple, culprit) -> CPConfigError:
    key, layer_fqn, diff, scale, _res, dtype = check
    rel = diff / scale if scale else float("inf")
    plan = prover.plan
    names = prover.names
    cp = prover.cp_size
    head = (f"CP preflight proof: the model computes differently under CP (cp_size={cp}) than without it "
            f"on the probe input (S={prover.S}, {prover.layout.R} documents{', packed row' if prover.packed else ''})")
    if key == "logits":
        fqn, cls = _parent_of_layers(names, prover.layers[-1][0]) if prover.layers else ("", type(prover.model).__name__)
        return CPConfigError(
            "plan_overrides",
            f"{head}: every decoder layer matches, but the logits differ — code after the last decoder layer "
            f"(in {type(prover.model).__name__}.forward / {cls}.forward) {REASON_UNDECLARED}; max relative error "
            f"{rel:.3e}", module=fqn or None, fix=FIX)
    if key.startswith("in:"):
        idx = [f for f, _ in prover.layers].index(layer_fqn)
        fqn, cls = _parent_of_layers(names, layer_fqn)
        where = (f"between '{prover.layers[idx - 1][0]}' and '{layer_fqn}'" if idx else
                 f"before the first decoder layer '{layer_fqn}' (embeddings)")
        return CPConfigError(
            "plan_overrides",
            f"{head}: the input of decoder layer '{layer_fqn}' already differs — code {where}, in "
            f"'{fqn}' ({cls}).forward, {REASON_UNDECLARED}; not covered by any plan_overrides declaration; "
            f"max relative error {rel:.3e}", module=fqn or None, fix=FIX)
    if culprit is not None:
        fqn, cls, rel = culprit
    else:
        fqn, cls = layer_fqn, type(names[layer_fqn]).__name__
    target = _covering(plan, fqn)
    module = names.get(fqn)
    if target is not None:
        field = target.spec.field(target.kind)
        ref = target.spec.inner_wrapper if target.kind == "inner_wrapper" else target.spec.local_compute_fn
        cover = (f"covered by {target.spec.field()} (match={target.spec.match!r}, {target.kind}="
                 f"{ref.describe()})")
        reason = REASON_DECLARED
        semantics = uncarried_attention_semantics(module) if module is not None else []
        if semantics:
            reason = f"the declared CP method does not carry what the module computes: {'; '.join(semantics)}"
        fix = ("fix or replace the declared CP method so that it computes what the module computes (e.g. a method "
               "that supports its mask/window), or use accelerator.cp_size: 1")
    else:
        field = "plan_overrides"
        inside = _contained(plan, fqn)
        cover = "not covered by any plan_overrides declaration" + (
            f" (it contains the declared {inside[:2]}, but the difference is in its own computation)" if inside else "")
        reason = REASON_UNDECLARED
        fix = FIX
        methods = mixer_methods_for(module, cp) if module is not None and fqn != layer_fqn else []
        if methods:
            fix = (f"{FIX} (token-mixer methods that accept {cls}: inner_wrapper: {' | '.join(methods)}, on a match "
                   f"selecting these modules, e.g. '{_pattern(fqn)}')")
    within = "" if fqn == layer_fqn else f"; first differing submodule '{fqn}' ({cls})"
    if culprit is None and fqn == layer_fqn:
        within = f"; none of its submodules differs on identical inputs, so the layer's own forward ({cls})"
    return CPConfigError(
        field, f"{head}: first differing decoder layer '{layer_fqn}'{within}, {cover}: {reason}; max relative "
        f"error {rel:.3e} (tolerance {PROOF_TOLERANCE.get(_dtype(dtype), 1e-4):g} relative, {dtype})",
        module=fqn, fix=fix)


def _pattern(fqn: str) -> str:
    """``model.layers.0.conv`` -> ``*[0-9].conv``: a plan_overrides glob for every layer's copy that
    does not also match a same-named grandchild (LFM2's ``conv.conv``)."""
    parent, _, name = fqn.rpartition(".")
    if not parent:
        return fqn
    return f"*[0-9].{name}" if parent.rpartition(".")[2].isdigit() else f"*.{name}"
