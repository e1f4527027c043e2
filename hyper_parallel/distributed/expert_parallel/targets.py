"""Which modules expert parallelism shards: the model's declared ``ep_dispatch_experts`` modules.

A transformers MoE model declares its EP plan (``config.base_model_ep_plan``, exposed with the
model's prefixes as ``model.ep_plan``): ``"layers.*.mlp.experts": "ep_dispatch_experts"`` names the
experts module that receives ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``
and holds every expert as one slice of 3-D parameters (``gate_up_proj [E, ...]``, ...).
:func:`find_ep_targets` reads that plan and checks each module can be sharded exactly (every
parameter indexed by expert, ``E`` divisible by ``ep_size``, no adapter inside); anything else is
refused naming the module, never guessed. Local only, the model is unchanged. docs/expert_parallel.md.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch.nn as nn

from ..errors import CPConfigError
from ..tp_plan_translation import fqn_glob

FIELD = "accelerator.ep_size"
DISPATCH_STYLE = "ep_dispatch_experts"


@dataclasses.dataclass(frozen=True)
class EPTarget:
    """One experts module: its FQN, its expert count, the parameters indexed by expert (dim 0) and the
    names of its forward's three inputs (hidden states, top-k index, top-k weights)."""

    fqn: str
    num_experts: int
    params: tuple
    args: tuple


def declared_ep_plan(model: nn.Module) -> dict | None:
    """``{glob FQN from the model root: style}``: ``model.ep_plan`` when transformers exposes it,
    else ``config.base_model_ep_plan`` under the base model's prefix; None when nothing is declared."""
    plan = getattr(model, "ep_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    cfg = getattr(model, "config", None)
    get_text = getattr(cfg, "get_text_config", None)
    text_cfg = get_text() if callable(get_text) else cfg
    base = getattr(text_cfg, "base_model_ep_plan", None) or getattr(cfg, "base_model_ep_plan", None)
    if not base:
        return None
    base_model = getattr(model, "base_model", None)
    prefix = ""
    if base_model is not None and base_model is not model:
        prefix = next((n for n, m in model.named_modules() if m is base_model), "")
    return {(f"{prefix}.{k}" if prefix else k): v for k, v in base.items()}


def _check_module(fqn: str, module: nn.Module, ep_size: int) -> EPTarget:
    n = getattr(module, "num_experts", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CPConfigError(FIELD, f"{type(module).__name__} has no integer num_experts, so its experts cannot "
                            "be split by expert", module=fqn, fix="accelerator.ep_size: 1")
    inner = [name for name, p in module.named_parameters() if "." in name]
    if inner:
        raise CPConfigError(FIELD, f"{type(module).__name__} holds parameters in sub-modules ({', '.join(inner[:3])}"
                            "): an adapter (LoRA) or a non-standard experts module, which expert parallelism "
                            "does not split exactly", module=fqn,
                            fix="train the experts without adapters (target_modules without the experts), or "
                                "accelerator.ep_size: 1")
    params = tuple(name for name, _ in module.named_parameters(recurse=False))
    if not params:
        raise CPConfigError(FIELD, f"{type(module).__name__} has no parameters to split", module=fqn,
                            fix="accelerator.ep_size: 1")
    for name in params:
        p = getattr(module, name)
        if p.dim() < 1 or p.shape[0] != n:
            raise CPConfigError(FIELD, f"parameter {name} of shape {tuple(p.shape)} is not indexed by expert "
                                f"(dim 0 != num_experts {n})", module=fqn, fix="accelerator.ep_size: 1")
    if n % ep_size:
        raise CPConfigError(FIELD, f"ep_size={ep_size} does not divide the {n} experts", module=fqn,
                            fix=f"choose an ep_size that divides {n}")
    try:
        positional = [p for p in inspect.signature(module.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        positional = []
    if len(positional) < 3:
        raise CPConfigError(FIELD, f"{type(module).__name__}.forward does not take (hidden_states, top_k_index, "
                            "top_k_weights)", module=fqn, fix="accelerator.ep_size: 1")
    return EPTarget(fqn, n, params, tuple(p.name for p in positional[:3]))


def find_ep_targets(model: nn.Module, ep_size: int) -> list[EPTarget]:
    """The experts modules to shard over ``ep_size`` ranks, in model order (``[]`` when ep_size is 1).
    Raises :class:`~..errors.CPConfigError` (field ``accelerator.ep_size``) when the model declares no
    ``ep_dispatch_experts`` module, or one cannot be split exactly."""
    if ep_size == 1:
        return []
    plan = declared_ep_plan(model)
    keys = [k for k, style in (plan or {}).items() if style == DISPATCH_STYLE]
    if not keys:
        raise CPConfigError(FIELD, f"ep_size={ep_size}, but {type(model).__name__} declares no "
                            f"'{DISPATCH_STYLE}' module in its base_model_ep_plan, so no experts module is known "
                            "to take routed tokens", fix="accelerator.ep_size: 1 (experts stay whole on every rank)")
    patterns = [fqn_glob(k) for k in keys]
    found = [_check_module(fqn, m, ep_size) for fqn, m in model.named_modules()
             if fqn and any(p.match(fqn) for p in patterns)]
    if not found:
        raise CPConfigError(FIELD, f"the ep plan's {keys} match no module of {type(model).__name__}",
                            fix="accelerator.ep_size: 1")
    return found
