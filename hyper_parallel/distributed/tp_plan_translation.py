"""Translate a transformers model's declared tensor-parallel plan into our decoder-layer plan.

Every transformers model declares its TP plan (``config.base_model_tp_plan``, exposed with the
model's prefixes as ``model.tp_plan``), keyed by glob FQNs such as
``model.layers.*.self_attn.q_proj``. :func:`translate_tp_plan` resolves it against the model's
decoder layers and returns a decoder-layer-relative plan (``{"self_attn.q_proj": "colwise"}``)
for :func:`~.tensor_parallel.apply_tensor_parallel`:

* translated exactly (plain ``nn.Linear`` under ``torch.distributed.tensor.parallel``):
  ``colwise`` -> ``ColwiseParallel()`` (replicated input, output features sharded, local output),
  ``rowwise`` -> ``RowwiseParallel()`` (input features sharded, output all-reduced);
  ``replicated_with_grad_allreduce`` (Qwen3/Gemma3 ``q_norm``/``k_norm`` acting on TP-local heads)
  -> kept replicated, listed in :attr:`~.tensor_parallel.TPGradInfo.partial_grad` (the trainer
  SUM-all-reduces its gradient over tp);
* left replicated, because that is mathematically exact (recorded in
  :attr:`TPPlanTranslation.replicated` with the reason): ``replicate``; every entry outside the
  decoder layers (embeddings ``embedding_rowwise``, ``lm_head`` ``colwise_gather_output``): they
  run on replicated inputs and produce replicated outputs; MoE expert modules and their packed
  parameters (``moe_tp_experts``, ``packed_colwise``, ``packed_rowwise``, ``moe_identity_expert``,
  ``local_params`` and any entry under such a module): expert tensor parallelism is out of scope,
  and an expert block whose input is replicated over tp (the residual stream after the
  attention's rowwise all-reduce) computes the same output and the same gradients on every tp
  rank;
* refused by name and FQN (:class:`~.errors.CPConfigError`, field ``accelerator.tp_size``) — every
  other style, e.g. ``sequence_parallel`` (CP already shards the sequence), ``colwise_rep`` /
  ``rowwise_rep`` / ``rowwise_split_input`` / ``local_*`` / ``gather`` / ``all_reduce`` /
  ``mla_kv_a_proj`` / ``ep_*`` / ``grouped_gemm`` inside a decoder layer, and ``colwise`` /
  ``rowwise`` on something that is not an ``nn.Linear`` outside an expert module.

Entries that match no module of this model (e.g. the dense ``mlp.gate_proj`` of an all-MoE
Qwen3-MoE) are dropped, as transformers does. Local only: no collective, the model is unchanged.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

import torch.nn as nn

from .errors import CPConfigError

FIELD = "accelerator.tp_size"
TRANSLATED = {"colwise": "colwise", "rowwise": "rowwise",
              "replicated_with_grad_allreduce": "replicated_with_grad_allreduce"}
EXPERT_STYLES = ("moe_tp_experts", "packed_colwise", "packed_rowwise", "moe_identity_expert", "local_params")
REPLICATE_STYLES = ("replicate",)
_WHY_OUTSIDE = ("outside the decoder layers: the module runs on replicated inputs and its output is replicated, "
                "so leaving it unsharded is exact")
_WHY_EXPERTS = ("expert tensor parallelism is out of scope: the expert module stays replicated over tp, which is "
                "exact (its input is the replicated residual stream; every tp rank computes the same output and "
                "gradients)")


@dataclasses.dataclass
class TPPlanTranslation:
    """``plan``: decoder-layer-relative FQN -> our style; ``replicated``: model FQN -> (declared style,
    reason) for what is declared but deliberately left replicated; ``source``: where the plan came from."""

    plan: dict
    replicated: dict
    source: str


def declared_tp_plan(model: nn.Module) -> tuple[Optional[dict], str]:
    """``({glob FQN from the model root: style}, source)``: ``model.tp_plan`` when transformers
    exposes it, else ``config.base_model_tp_plan`` under the base model's prefix; ``(None, ...)``
    when the model declares nothing."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan), f"{type(model).__name__}.tp_plan"
    cfg = getattr(model, "config", None)
    get_text = getattr(cfg, "get_text_config", None)
    text_cfg = get_text() if callable(get_text) else cfg
    base = getattr(text_cfg, "base_model_tp_plan", None) or getattr(cfg, "base_model_tp_plan", None)
    if not base:
        return None, "none"
    prefix = ""
    base_model = getattr(model, "base_model", None)
    if base_model is not None and base_model is not model:
        prefix = next((n for n, m in model.named_modules() if m is base_model), "")
    return {(f"{prefix}.{k}" if prefix else k): v for k, v in base.items()}, "config.base_model_tp_plan"


def fqn_glob(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")


def _layer_of(fqn: str, layers: list) -> Optional[str]:
    best = None
    for layer in layers:
        if fqn.startswith(layer + ".") and (best is None or len(layer) > len(best)):
            best = layer
    return best


def _refuse(key: str, style: str, fqn: str, why: str) -> CPConfigError:
    return CPConfigError(
        FIELD, f"the model declares TP style {style!r} for '{key}', which is not applied here: {why}", module=fqn,
        fix="register_tp_plan(model_type, {layer-relative FQN: 'colwise' | 'rowwise' | "
            "'replicated_with_grad_allreduce'}) with a plan this library can honour, or accelerator.tp_size: 1")


def translate_tp_plan(model: nn.Module, layers: list) -> Optional[TPPlanTranslation]:
    """The model's declared TP plan as a decoder-layer-relative plan (see the module docstring);
    None when the model declares none. Raises :class:`~.errors.CPConfigError` for a refused style."""
    declared, source = declared_tp_plan(model)
    if declared is None:
        return None
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    names = list(modules) + list(params)
    matches = {key: [n for n in names if n and fqn_glob(key).match(n)] for key in declared}
    experts = set()                       # FQNs of modules left replicated as a whole (MoE experts)
    for key, style in declared.items():
        if style in EXPERT_STYLES or style.startswith("ep_") or style == "grouped_gemm":
            for fqn in matches[key]:
                experts.add(fqn if fqn in modules else fqn.rpartition(".")[0])
    plan: dict = {}
    replicated: dict = {}
    for key, style in declared.items():
        for fqn in matches[key]:
            owner = fqn if fqn in modules else fqn.rpartition(".")[0]
            if any(owner == e or owner.startswith(e + ".") for e in experts):
                replicated[fqn] = (style, _WHY_EXPERTS)
                continue
            if style in REPLICATE_STYLES:
                replicated[fqn] = (style, "declared replicated")
                continue
            layer = _layer_of(fqn, layers)
            if layer is None:
                if style == "sequence_parallel":
                    raise _refuse(key, style, fqn, "CP already shards the sequence; sequence parallelism is not "
                                  "combined with it")
                replicated[fqn] = (style, _WHY_OUTSIDE)
                continue
            if style == "sequence_parallel":
                raise _refuse(key, style, fqn, "CP already shards the sequence; sequence parallelism is not "
                              "combined with it")
            if style not in TRANSLATED:
                raise _refuse(key, style, fqn, f"only {sorted(TRANSLATED)} are translated to "
                              "torch.distributed.tensor.parallel inside decoder layers")
            if fqn not in modules:
                raise _refuse(key, style, fqn, "it names a parameter, not a module (packed / fused weights outside "
                              "an expert module are not translated)")
            if style in ("colwise", "rowwise") and not isinstance(modules[fqn], nn.Linear):
                raise _refuse(key, style, fqn, f"the module is a {type(modules[fqn]).__name__}, and only plain "
                              "nn.Linear is sharded colwise/rowwise")
            rel = fqn[len(layer) + 1:]
            prev = plan.get(rel)
            if prev is not None and prev != TRANSLATED[style]:
                raise _refuse(key, style, fqn, f"another entry gives '{rel}' the style {prev!r}")
            plan[rel] = TRANSLATED[style]
    return TPPlanTranslation(plan, replicated, source)
