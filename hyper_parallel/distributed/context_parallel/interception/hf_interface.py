"""The HF attention-interface route: :data:`HF_CP_INTERFACE` registered additively in
transformers' ``AttentionInterface``, a private config per wrapped module, the call normalised
to an :class:`AttentionCall` (:func:`hf_call`); :func:`intercept_hf_any` and :func:`interceptor_for`."""
from __future__ import annotations

import contextlib
import copy
import threading
from typing import Callable

import torch
import torch.nn as nn

from .scope import (_SDPAMode, _TLS_STATE, HF_CP_INTERFACE, AttentionCall, CPInterceptionError, InterceptScope,
                    _kv_groups, intercept_sdpa)

_REGISTER_LOCK = threading.Lock()


# HF attention-interface kwargs that carry no attention semantics (bookkeeping the model threads
# through every layer); anything else that is not None is refused by the handler, naming it.
HF_IGNORED_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_router_logits",
                               "output_hidden_states", "return_dict", "layer_idx", "past_key_values",
                               "cache", "token_type_ids"})
HF_FALSY_KWARGS = frozenset({"output_attentions"})


def hf_call(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs) -> AttentionCall:
    """Normalize one HF attention-interface call into an :class:`AttentionCall`.

    ``sliding_window`` / ``softcap`` / ``s_aux`` (sinks) become explicit fields; ``is_causal``
    (default ``module.is_causal``) becomes ``is_causal``; bookkeeping kwargs
    (:data:`HF_IGNORED_KWARGS`, falsy :data:`HF_FALSY_KWARGS`) are dropped; every other kwarg
    that is not None lands in ``extra`` (the handler refuses it by name).
    """
    raw = dict(kwargs)
    window = kwargs.pop("sliding_window", None)
    softcap = kwargs.pop("softcap", None)
    sinks = kwargs.pop("s_aux", None)
    if sinks is None:
        sinks = kwargs.pop("sinks", None)
    is_causal = kwargs.pop("is_causal", None)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    extra = {}
    for k, v in kwargs.items():
        if k in HF_IGNORED_KWARGS or v is None or (k in HF_FALSY_KWARGS and not v):
            continue
        extra[k] = v
    return AttentionCall(q=query, k=key, v=value, scale=scaling, attn_mask=attention_mask,
                         is_causal=bool(is_causal), dropout_p=float(dropout or 0.0), enable_gqa=True,
                         kv_groups=_kv_groups(module), source="hf_interface", extra=extra,
                         window=window, softcap=softcap, sinks=sinks,
                         module_training=bool(getattr(module, "training", False)), hf_kwargs=raw)


def _hf_cp_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    scope = None
    for s in reversed(_TLS_STATE.scopes):
        if s.module is module:
            scope = s
            break
    if scope is None:
        raise CPInterceptionError(
            f"{type(module).__name__}: the '{HF_CP_INTERFACE}' attention interface was called outside a "
            "CP-wrapped forward (it exists only for modules wrapped by the built-in *_hf wrappers)"
        )
    call = hf_call(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    out = scope.dispatch(call)
    # HF attention interfaces return [B, S, H, D] plus optional weights
    return out.transpose(1, 2).contiguous(), None


def ensure_hf_interface_registered() -> None:
    """Register :data:`HF_CP_INTERFACE` in transformers' AttentionInterface (idempotent, additive)."""
    from transformers.modeling_utils import AttentionInterface

    with _REGISTER_LOCK:
        if AttentionInterface._global_mapping.get(HF_CP_INTERFACE) is not _hf_cp_attention:
            AttentionInterface.register(HF_CP_INTERFACE, _hf_cp_attention)


def install_private_config(module: nn.Module, attn_implementation: str = HF_CP_INTERFACE) -> Callable[[], None]:
    """Give ``module`` a shallow config copy naming ``attn_implementation``; returns an undo."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise CPInterceptionError(f"{type(module).__name__} has no .config to route its attention interface")
    private = copy.copy(cfg)
    # set the field directly: the property setter would recurse into *shared* sub-configs
    private.__dict__["_attn_implementation_internal"] = attn_implementation
    if getattr(private, "_attn_implementation", None) != attn_implementation:
        raise CPInterceptionError(
            f"{type(module).__name__}: could not route its attention interface (this transformers version "
            "stores _attn_implementation differently)")
    module.config = private

    def undo() -> None:
        module.config = cfg

    return undo


@contextlib.contextmanager
def intercept_hf_interface(owner: str, module: nn.Module, handler: Callable[[AttentionCall], torch.Tensor],
                           *, max_calls: int = 1, check: bool = True):
    """Route the module's HF attention-interface call (private config) to ``handler``."""
    scope = InterceptScope(owner, module, handler, f"its attention interface ('{HF_CP_INTERFACE}')", max_calls)
    _TLS_STATE.scopes.append(scope)
    try:
        yield scope
    finally:
        _TLS_STATE.scopes.remove(scope)
    if check:
        scope.finish()


@contextlib.contextmanager
def intercept_hf_any(owner: str, module: nn.Module, handler: Callable[[AttentionCall], torch.Tensor],
                     *, max_calls: int = 1, check: bool = True):
    """Both routes at once, one shared call count: the module's HF attention-interface call (when
    its private config names :data:`HF_CP_INTERFACE`) and any direct SDPA call."""
    scope = InterceptScope(owner, module, handler, "torch.nn.functional.scaled_dot_product_attention "
                           f"nor its HF attention interface ('{HF_CP_INTERFACE}')", max_calls)
    _TLS_STATE.scopes.append(scope)
    try:
        with _SDPAMode(scope):
            yield scope
    finally:
        _TLS_STATE.scopes.remove(scope)
    if check:
        scope.finish()


def interceptor_for(primitive: str):
    if primitive == "sdpa":
        return intercept_sdpa
    if primitive == "hf_interface":
        return intercept_hf_interface
    if primitive == "hf_any":
        return intercept_hf_any
    raise ValueError(f"unknown attention primitive {primitive!r}")
