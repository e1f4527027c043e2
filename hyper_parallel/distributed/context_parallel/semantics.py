"""Refusal words: what a module computes that no CP method carries, and what to declare instead.

Local helpers (no collective, nothing modified) used where CP refuses a module, so the message
names the semantic it cannot carry rather than a generic mismatch:

* :func:`uncarried_attention_semantics` — attention inputs that live only in the model's mask
  or in the module's local sequence (Llama 4 chunked attention, temperature tuning on local
  positions): no built-in CP attention method computes them;
* :func:`mixer_methods_for` — the catalogue's token-mixer methods whose ``validate`` hook accepts a
  module (what to declare for a linear-attention / recurrent / convolution mixer);
* :func:`mixer_hint` — one sentence naming a module's class and those methods.
"""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from . import catalogue

__all__ = ["uncarried_attention_semantics", "mixer_methods_for", "mixer_hint", "is_token_mixer"]


def _layer_type(module: nn.Module, cfg) -> Optional[str]:
    types = getattr(cfg, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if isinstance(types, (list, tuple)) and isinstance(idx, int) and 0 <= idx < len(types):
        return types[idx]
    return None


def uncarried_attention_semantics(module: nn.Module) -> list:
    """Descriptions of what ``module`` (an attention) computes beyond causal + padding + documents +
    window/softcap/sinks/scale (what the CP attention carries); empty when nothing is known."""
    cfg = getattr(module, "config", None)
    found = []
    chunk = getattr(cfg, "attention_chunk_size", None) if cfg is not None else None
    if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0:
        lt = _layer_type(module, cfg)
        if lt is None or lt == "chunked_attention":
            found.append(f"chunked attention, attention_chunk_size={chunk} (each query sees only the keys of its "
                         "own chunk; the chunks exist only in the model's mask, which CP does not use)")
    if getattr(module, "attn_temperature_tuning", False) and getattr(module, "use_rope", True) is False:
        found.append("attention temperature tuning on positions counted from the module's local input "
                     "(attn_temperature_tuning=True on a NoPE layer: under CP every rank would restart them at 0)")
    return found


def mixer_methods_for(module: nn.Module, cp_size: int) -> list:
    """Registry names of the catalogue's token-mixer methods whose ``validate`` hook accepts ``module``."""
    from .registry import get_registered, wrapper_info

    names = []
    for row in catalogue.mixer_methods():
        for offer in row.offers:
            fn = get_registered(offer.registry_name) if offer.registry_name else None
            info = wrapper_info(fn) if fn is not None else None
            if info is None:
                continue
            try:
                if info.validate is not None:
                    info.validate(module, cp_size=cp_size)
            except (ValueError, TypeError):
                continue
            names.append(offer.registry_name)
    return names


def is_token_mixer(module: nn.Module) -> bool:
    """True when a probe forward of ``module`` runs and makes no softmax-attention call (SDPA or
    transformers' attention interface): a linear-attention / recurrent / convolution mixer."""
    from .interception import probe_module

    try:
        res = probe_module(module, "hf_any", owner=type(module).__name__)
    except Exception:  # noqa: BLE001 - a double call etc.: it does call attention
        return False
    return res is not None and res.count == 0


def mixer_hint(module: nn.Module, cp_size: int, fqn: Optional[str] = None) -> str:
    """What to declare for a module that makes no SDPA / attention-interface call, for a refusal."""
    methods = mixer_methods_for(module, cp_size) or [m.name for m in catalogue.mixer_methods()]
    where = f"'{fqn}' ({type(module).__name__})" if fqn else type(module).__name__
    return (f"if {where} is a token mixer (e.g. linear attention), not softmax attention, declare a token-mixer "
            f"method for it — inner_wrapper: {' | '.join(methods)} — with a match that selects only these "
            "modules (not the softmax-attention layers); an attention computed by its own matmuls needs a "
            "model-specific CP wrapper")
