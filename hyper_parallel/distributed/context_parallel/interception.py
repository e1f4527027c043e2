"""Scoped interception of the attention primitive inside one module's forward.

The built-in HF wrappers reuse the model's own projections, norms and RoPE unchanged and
replace only the attention primitive:

* **SDPA** (``sdpa_hf*``, ``sdpa_qkv*``): a :class:`torch.overrides.TorchFunctionMode` is
  pushed for the duration of the wrapped module's forward only; it catches
  ``torch.nn.functional.scaled_dot_product_attention`` and hands ``q/k/v`` to the CP handler.
  Torch-function mode stacks are thread-local, every forward call gets its own mode and
  counter, and a thread-local depth counter makes SDPA calls issued *by a handler* (e.g. a
  strategy or engine that uses SDPA internally) pass through untouched, so nested or
  concurrent wrapped forwards never steal each other's calls. No global is patched.
* **HF FlexAttention** (``flex_hf*``): FlexAttention is a compiled higher-order op that a
  torch-function mode cannot intercept reliably, so the wrapped module gets a private
  shallow copy of its config whose ``_attn_implementation`` names an additional attention
  interface, :data:`HF_CP_INTERFACE`, registered once (additively) in transformers'
  ``AttentionInterface``. That interface routes the call to the handler of the active scope
  of *that* module (thread-local stack) and raises if it is reached outside a wrapped
  forward. The model's other modules keep the original config object.

Exactly one attention call per forward is expected: a forward that finishes with no
intercepted call raises (misfire: the module does not call the primitive the wrapper was
declared for), and a second call raises before any collective is issued for it.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import threading
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

SDPA = F.scaled_dot_product_attention
HF_CP_INTERFACE = "hyper_parallel_cp"


class CPInterceptionError(RuntimeError):
    """The wrapped module did not call its attention primitive exactly once."""


@dataclasses.dataclass
class AttentionCall:
    """One intercepted attention call, normalized to ``[B, H, S, D]`` q/k/v."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: Optional[float] = None
    attn_mask: Any = None            # the model's local mask: never trusted for CP
    is_causal: bool = False
    dropout_p: float = 0.0
    enable_gqa: bool = False         # SDPA: k/v carry Hk heads; else they may be repeat_kv'ed
    kv_groups: int = 1               # the module's num_key_value_groups (Hq // Hk before repeat)
    source: str = "sdpa"             # "sdpa" | "hf_interface" | "flex"
    extra: dict = dataclasses.field(default_factory=dict)   # kwargs not understood: refused by the handler
    # attention semantics read from the call (HF interface kwargs) and carried to the engine
    window: Optional[int] = None     # transformers' sliding_window: q - window < k <= q
    softcap: Optional[float] = None  # logit softcapping (Gemma2)
    sinks: Optional[torch.Tensor] = None   # [Hq] learned sink logits (gpt-oss s_aux)
    module_training: bool = False    # the module's training flag at the call (dropout is live)
    hf_kwargs: dict = dataclasses.field(default_factory=dict)   # the interface call's kwargs, as passed


class _TLS(threading.local):
    def __init__(self):
        self.handler_depth = 0
        self.scopes: list["InterceptScope"] = []


_TLS_STATE = _TLS()


def in_handler() -> bool:
    return _TLS_STATE.handler_depth > 0


class InterceptScope:
    """Counts and dispatches the attention calls of one forward of one module."""

    def __init__(self, owner: str, module: nn.Module, handler: Callable[[AttentionCall], torch.Tensor],
                 primitive: str, max_calls: int = 1):
        self.owner = owner
        self.module = module
        self.handler = handler
        self.primitive = primitive
        self.max_calls = max_calls
        self.count = 0

    def dispatch(self, call: AttentionCall) -> torch.Tensor:
        self.count += 1
        if self.count > self.max_calls:
            raise CPInterceptionError(
                f"module '{self.owner}': a second {self.primitive} call was intercepted in one forward; "
                f"the declared wrapper replaces exactly one attention call per forward. Use a model-specific "
                f"wrapper (or inner_target pointing at the single core attention) for this module"
            )
        _TLS_STATE.handler_depth += 1
        try:
            return self.handler(call)
        finally:
            _TLS_STATE.handler_depth -= 1

    def finish(self) -> None:
        if self.count == 0:
            raise CPInterceptionError(
                f"module '{self.owner}': its forward finished without calling {self.primitive}, so the "
                f"declared CP wrapper never ran (misfire). Check the model's attn_implementation and that "
                f"inner_target points at the module that performs the attention"
            )


def _kv_groups(module: nn.Module) -> int:
    g = getattr(module, "num_key_value_groups", 1)
    return int(g) if isinstance(g, int) and g > 0 else 1


def _bind_sdpa(args, kwargs) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    for key, val in kwargs.items():
        if key in bound:
            raise TypeError(f"scaled_dot_product_attention got multiple values for {key!r}")
        bound[key] = val
    unknown = sorted(set(bound) - set(names))
    if unknown:
        raise TypeError(f"scaled_dot_product_attention got unexpected argument(s) {unknown}")
    return bound


class _SDPAMode(TorchFunctionMode):
    def __init__(self, scope: InterceptScope):
        super().__init__()
        self.scope = scope

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SDPA and not in_handler():
            b = _bind_sdpa(args, kwargs)
            call = AttentionCall(
                q=b["query"], k=b["key"], v=b["value"], scale=b.get("scale"), attn_mask=b.get("attn_mask"),
                is_causal=bool(b.get("is_causal", False)), dropout_p=float(b.get("dropout_p", 0.0) or 0.0),
                enable_gqa=bool(b.get("enable_gqa", False)), kv_groups=_kv_groups(self.scope.module),
                source="sdpa",
            )
            return self.scope.dispatch(call)
        return func(*args, **kwargs)


@contextlib.contextmanager
def intercept_sdpa(owner: str, module: nn.Module, handler: Callable[[AttentionCall], torch.Tensor],
                   *, max_calls: int = 1, check: bool = True):
    """Route the SDPA calls made inside the body to ``handler`` (this thread only)."""
    scope = InterceptScope(owner, module, handler, "torch.nn.functional.scaled_dot_product_attention",
                           max_calls)
    with _SDPAMode(scope):
        yield scope
    if check:
        scope.finish()


# ------------------------------------------------------------------ apply context
@dataclasses.dataclass(frozen=True)
class ApplyContext:
    """What the applier tells a wrapper while it is being installed (read at wrap time)."""

    fqn: Optional[str] = None          # FQN of the module the wrapper is installed on
    mode: str = "production"           # "production" | "validate"


class _ApplyTLS(threading.local):
    def __init__(self):
        self.stack: list[ApplyContext] = []


_APPLY_TLS = _ApplyTLS()


@contextlib.contextmanager
def applying(fqn: Optional[str], mode: str = "production"):
    """Set the :class:`ApplyContext` seen by wrappers installed in the body (this thread)."""
    if mode not in ("production", "validate"):
        raise ValueError(f"mode must be 'production' or 'validate', got {mode!r}")
    _APPLY_TLS.stack.append(ApplyContext(fqn, mode))
    try:
        yield _APPLY_TLS.stack[-1]
    finally:
        _APPLY_TLS.stack.pop()


def current_apply_context() -> ApplyContext:
    return _APPLY_TLS.stack[-1] if _APPLY_TLS.stack else ApplyContext()


# ------------------------------------------------------------------ HF attention interface
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


# ------------------------------------------------------------------------- probing
def _param_sample(module: nn.Module):
    for p in module.parameters():
        return p
    return None


def _rotary_dims(module: nn.Module, head_dim: int) -> list:
    """Candidate cos/sin widths: the head dim, then a partial rotary width (Phi, StableLM, ...)."""
    dims = [head_dim]
    cfg = getattr(module, "config", None)
    for attr in ("rotary_ndims", "rotary_dim", "rotary_emb_dim"):
        v = getattr(module, attr, None)
        if isinstance(v, int) and v > 0:
            dims.append(v)
    qk_rope = getattr(cfg, "qk_rope_head_dim", None) if cfg is not None else None
    if isinstance(qk_rope, int) and qk_rope > 0:
        dims.append(qk_rope)
    rope = getattr(cfg, "rope_parameters", None) if cfg is not None else None
    frac = getattr(cfg, "partial_rotary_factor", None) if cfg is not None else None
    if frac is None and isinstance(rope, dict):
        frac = rope.get("partial_rotary_factor")
    if isinstance(frac, (int, float)) and 0 < frac < 1:
        dims.append(int(head_dim * frac))
    dims.append(head_dim // 2)       # rotate-half layouts that pass half-width cos/sin (gpt-oss)
    return list(dict.fromkeys(d for d in dims if d > 0))


def hf_probe_inputs(module: nn.Module, seq: int = 2, rot_dim: Optional[int] = None) -> Optional[dict]:
    """Tiny inputs for an HF ``forward(hidden_states, position_embeddings, attention_mask, ...)``.

    Required parameters the probe cannot know (e.g. Falcon's ``alibi``, ``layer_past``) get None.
    """
    p = _param_sample(module)
    if p is None or p.device.type == "meta" or type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor"):
        return None
    cfg = getattr(module, "config", None)
    hidden = getattr(cfg, "hidden_size", None)
    if hidden is None:
        q_proj = getattr(module, "q_proj", None)
        hidden = getattr(q_proj, "in_features", None)
    if hidden is None:      # no config / q_proj (e.g. a linear attention): its own width, else its first Linear's
        hidden = getattr(module, "hidden_size", None) or next(
            (m.in_features for m in module.children() if isinstance(m, nn.Linear)), None)
    head_dim = getattr(module, "head_dim", None)
    if head_dim is None and cfg is not None and getattr(cfg, "qk_rope_head_dim", None):
        head_dim = cfg.qk_rope_head_dim
    if head_dim is None and cfg is not None:      # e.g. a linear attention keeping no head_dim of its own
        heads = getattr(cfg, "num_attention_heads", None)
        head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if hidden is None or head_dim is None:
        return None
    rot = rot_dim or head_dim
    params = inspect.signature(module.forward).parameters
    kwargs: dict = {"hidden_states": torch.zeros(1, seq, hidden, dtype=p.dtype, device=p.device)}
    if "position_embeddings" in params:
        kwargs["position_embeddings"] = (torch.ones(1, seq, rot, dtype=p.dtype, device=p.device),
                                         torch.zeros(1, seq, rot, dtype=p.dtype, device=p.device))
    if "attention_mask" in params:
        kwargs["attention_mask"] = None
    if "position_ids" in params:
        kwargs["position_ids"] = torch.arange(seq, device=p.device)[None]
    for name, par in params.items():
        if name not in kwargs and par.default is inspect.Parameter.empty and par.kind in (
                par.POSITIONAL_OR_KEYWORD, par.KEYWORD_ONLY):
            kwargs[name] = None
    return kwargs


@dataclasses.dataclass
class ProbeResult:
    """What a probe forward of a module's original forward did (nothing computed, nothing sent)."""

    count: int                           # attention calls intercepted
    route: str                           # "hf_interface" | "sdpa" | "none"
    calls: list = dataclasses.field(default_factory=list)    # AttentionCall (train mode)


def _probe_once(module: nn.Module, primitive: str, owner: str, rot_dim):
    kwargs = hf_probe_inputs(module, rot_dim=rot_dim)
    if kwargs is None:
        return None
    calls: list = []

    def zeros(call: AttentionCall) -> torch.Tensor:
        calls.append(call)
        q, v = call.q, call.v
        return q.new_zeros(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])

    undo = None
    was_training = module.training
    try:
        if primitive in ("hf_interface",):
            ensure_hf_interface_registered()
            try:
                undo = install_private_config(module)
            except CPInterceptionError:
                return 0, []          # no HF config to route: the interface route sees no call
        module.train(True)     # the dropout the module passes in training is what CP must honour
        with torch.no_grad(), interceptor_for(primitive)(owner, module, zeros, max_calls=1 << 30,
                                                          check=False) as scope:
            module.forward(**kwargs)
        return scope.count, calls
    finally:
        module.train(was_training)
        if undo is not None:
            undo()


def probe_module(module: nn.Module, primitive: str, owner: str = "") -> Optional[ProbeResult]:
    """Run the module's *original* forward on tiny dummy inputs (train mode) and record its calls.

    ``primitive`` "hf_any" tries the HF attention-interface route first (private config naming
    :data:`HF_CP_INTERFACE`: the call carries mask, scaling, dropout, sliding_window, softcap,
    sinks) and falls back to direct SDPA calls (the module's own config, e.g. Falcon's
    ``_attn_implementation == "sdpa"`` branch); the route that saw calls is returned.
    Returns None when the module cannot be probed (no HF signature, meta/DTensor parameters,
    or its forward raised for reasons unrelated to the attention call; logged as a WARNING).
    """
    head_dim = getattr(module, "head_dim", None)
    dims = _rotary_dims(module, head_dim) if isinstance(head_dim, int) else [None]
    routes = ["hf_interface", "sdpa"] if primitive == "hf_any" else [primitive]
    if primitive == "hf_any" and getattr(module, "config", None) is None:
        routes = ["sdpa"]
    last_exc = None
    for route in routes:
        for rot in dims:
            try:
                res = _probe_once(module, route, owner, rot)
            except CPInterceptionError:
                raise
            except Exception as exc:  # noqa: BLE001 - try the next rotary width / route
                last_exc = exc
                continue
            if res is None:
                return None
            count, calls = res
            if count:
                return ProbeResult(count, route, calls)
            break     # ran without a call: try the next route
    if last_exc is not None:
        log.warning("%s: the probe forward of %s (primitive=%s) raised %s: %s; the misfire / "
                    "double-interception preflight check is skipped for this module (it is still "
                    "detected at the first real forward)", owner or "CP wrapper", type(module).__name__,
                    primitive, type(last_exc).__name__, last_exc)
        return None
    return ProbeResult(0, "none", [])
