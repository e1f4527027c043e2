"""Model CP specs: which modules are attention boundaries for an architecture.

A spec only says *where* attention is (target FQN globs), how to prepare its batch, and which
wrappers are allowed; it never picks the CP method — that stays in YAML ``plan_overrides``.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Callable, Sequence

import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class CPModelSpec:
    architecture: str
    attention_targets: tuple
    batch_prepare_fn: Callable | None = None
    wrappers: tuple = ()


_SPECS: dict[str, CPModelSpec] = {}


def register_cp_model_spec(architecture: str, attention_targets: Sequence[str],
                           batch_prepare_fn: Callable | None = None,
                           wrappers: Sequence[str] = ()) -> CPModelSpec:
    """Record an architecture's attention targets and allowed wrapper names (registry names or
    ``_target_`` paths). Re-registering the same architecture replaces the spec.

    ``batch_prepare_fn``: the architecture's batch contract, called by the trainer for CP > 1
    instead of :func:`~hyper_parallel.distributed.context_parallel.batch.shard_batch_for_cp`
    with the same arguments ``(global_batch, cp_mesh, policy, *, ignore_index, pad_token_id)``
    and returning the same :class:`CPBatch` (local tensors, global positions, shifted labels,
    ``meta``). It never changes the CP method, which stays the YAML's.
    """
    if not attention_targets:
        raise ValueError(f"register_cp_model_spec({architecture!r}): attention_targets must not be empty")
    spec = CPModelSpec(architecture, tuple(attention_targets), batch_prepare_fn, tuple(wrappers))
    _SPECS[architecture] = spec
    return spec


def unregister_cp_model_spec(architecture: str) -> CPModelSpec | None:
    """Remove a registered spec (returns it, or None when none was registered)."""
    return _SPECS.pop(architecture, None)


def model_architecture(model: nn.Module) -> str | None:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "model_type", None) if cfg is not None else None


def get_cp_model_spec(model_or_arch) -> CPModelSpec | None:
    arch = model_or_arch if isinstance(model_or_arch, str) else model_architecture(model_or_arch)
    return _SPECS.get(arch) if arch else None


def is_attention_module(module: nn.Module) -> bool:
    """Default rule: a class named ``*Attention`` or a module flagged ``__hp_attention_boundary__``."""
    if getattr(module, "__hp_attention_boundary__", False):
        return True
    return type(module).__name__.endswith("Attention")


def find_attention_boundaries(model: nn.Module) -> list[str]:
    """FQNs of the outermost attention modules (a registered spec's globs take precedence)."""
    spec = get_cp_model_spec(model)
    names = [n for n, _ in model.named_modules() if n]
    if spec is not None:
        return [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in spec.attention_targets)]
    found: list[str] = []
    for name, mod in model.named_modules():
        if not name or any(name.startswith(f + ".") for f in found):
            continue
        if is_attention_module(mod):
            found.append(name)
    return found
