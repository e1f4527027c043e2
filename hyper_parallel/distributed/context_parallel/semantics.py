"""Refusal words: what a module computes that no CP method carries, and what to declare instead.

Local helpers (no collective, nothing modified) used where CP refuses a module, so the message
names the semantic it cannot carry rather than a generic mismatch:

* :func:`uncarried_attention_semantics` — attention inputs that live only in the model's mask
  or in the module's local sequence that CP cannot recover (chunked attention on a layer whose
  type is unknown, temperature tuning without Llama 4's ``floor_scale`` / ``attn_scale``;
  what a model family registers (:func:`register_uncarried`: an attention that needs the family's
  own method, e.g. a sparse-attention indexer or a dynamic mask);
* :func:`attention_chunk_size` / :func:`query_position_rescale` — the two such semantics CP
  does carry (Llama 4 text): the layer's chunk size, folded into the batch meta's documents, and
  the temperature tuning recomputed on global positions; read by the attention handlers only;
* :func:`mixer_methods_for` — the catalogue's token-mixer methods whose ``validate`` hook accepts a
  module (what to declare for a linear-attention / recurrent / convolution mixer);
* :func:`mixer_hint` — one sentence naming a module's class and those methods.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from . import catalogue

__all__ = ["uncarried_attention_semantics", "register_uncarried", "attention_chunk_size", "query_position_rescale",
           "mixer_methods_for", "mixer_hint", "is_token_mixer"]


def _layer_type(module: nn.Module, cfg) -> Optional[str]:
    types = getattr(cfg, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if isinstance(types, (list, tuple)) and isinstance(idx, int) and 0 <= idx < len(types):
        return types[idx]
    return None


def _config_chunk(cfg) -> Optional[int]:
    chunk = getattr(cfg, "attention_chunk_size", None) if cfg is not None else None
    return chunk if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0 else None


def attention_chunk_size(module: nn.Module) -> Optional[int]:
    """The chunk size of ``module``'s chunked attention, or None: the config's
    ``attention_chunk_size`` when ``config.layer_types[module.layer_idx] == "chunked_attention"``
    (the layers transformers gives a chunked mask, Llama 4). Its attention-interface call does not
    pass it, so the CP handlers read it here, once per call."""
    cfg = getattr(module, "config", None)
    chunk = _config_chunk(cfg)
    return chunk if chunk is not None and _layer_type(module, cfg) == "chunked_attention" else None


def _temperature_params(module: nn.Module):
    if not getattr(module, "attn_temperature_tuning", False) or bool(getattr(module, "use_rope", True)):
        return None
    fs, sc = getattr(module, "floor_scale", None), getattr(module, "attn_scale", None)
    if isinstance(fs, (int, float)) and isinstance(sc, (int, float)) and fs > 0:
        return float(fs), float(sc)
    return "unknown"


def query_position_rescale(module: nn.Module, local_index: torch.Tensor, global_index: torch.Tensor):
    """Float32 factors (broadcast of the two index tensors, e.g. ``[B, L]``) turning the query of a
    Llama 4 NoPE layer with ``attn_temperature_tuning``, scaled by
    ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` at its *local* row index ``p`` (what the
    module computes from its local input), into the same query scaled at its *global* position;
    None when ``module`` does no such tuning. Exact up to one
    rounding of the product (the tuning is >= 1, never divides by 0)."""
    par = _temperature_params(module)
    if par is None or par == "unknown":
        return None
    fs, sc = par

    def tune(p):
        return torch.log1p(torch.floor((p.float() + 1.0) / fs)) * sc + 1.0

    return tune(global_index) / tune(local_index)


#: what a model family's attention computes that only its own CP method carries: functions
#: ``module -> description (naming the method to declare) | None``, registered from
#: ``models/<model_type>/`` (:func:`register_uncarried`), asked in registration order
_UNCARRIED: list = []


def register_uncarried(detect: Callable[[nn.Module], Optional[str]]) -> Callable:
    """Add a family's detector to :func:`uncarried_attention_semantics` (idempotent); returns it."""
    if detect not in _UNCARRIED:
        _UNCARRIED.append(detect)
    return detect


def uncarried_attention_semantics(module: nn.Module) -> list:
    """Descriptions of what ``module`` (an attention) computes beyond causal + padding + documents +
    window/softcap/sinks/scale + Llama 4 chunks / temperature tuning (what the CP attention
    carries), then what each family's registered detector finds; empty when nothing is known."""
    cfg = getattr(module, "config", None)
    found = []
    chunk = _config_chunk(cfg)
    if chunk is not None and _layer_type(module, cfg) is None:
        found.append(f"chunked attention, attention_chunk_size={chunk} on a layer without a config.layer_types "
                     "entry (CP carries the chunks only on layers listed as 'chunked_attention'; here the chunks "
                     "exist only in the model's mask, which CP does not use)")
    if _temperature_params(module) == "unknown":
        found.append("attention temperature tuning on positions counted from the module's local input "
                     "(attn_temperature_tuning=True on a NoPE layer without Llama 4's floor_scale / attn_scale: "
                     "under CP every rank would restart them at 0)")
    found.extend(d for d in (detect(module) for detect in _UNCARRIED) if d)
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
