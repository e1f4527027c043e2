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
    source: str = "sdpa"             # "sdpa" | "hf_interface"
    extra: dict = dataclasses.field(default_factory=dict)


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


def _hf_cp_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    scope = None
    for s in reversed(_TLS_STATE.scopes):
        if s.module is module:
            scope = s
            break
    if scope is None:
        raise CPInterceptionError(
            f"{type(module).__name__}: the '{HF_CP_INTERFACE}' attention interface was called outside a "
            "CP-wrapped forward (it exists only for modules wrapped by flex_hf* wrappers)"
        )
    call = AttentionCall(q=query, k=key, v=value, scale=scaling, attn_mask=attention_mask,
                         is_causal=bool(getattr(module, "is_causal", True)), dropout_p=float(dropout or 0.0),
                         enable_gqa=True, kv_groups=_kv_groups(module), source="hf_interface",
                         extra={k: v for k, v in kwargs.items() if v is not None})
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


def interceptor_for(primitive: str):
    if primitive == "sdpa":
        return intercept_sdpa
    if primitive == "hf_interface":
        return intercept_hf_interface
    raise ValueError(f"unknown attention primitive {primitive!r}")


# ------------------------------------------------------------------------- probing
def _param_sample(module: nn.Module):
    for p in module.parameters():
        return p
    return None


def hf_probe_inputs(module: nn.Module, seq: int = 2) -> Optional[dict]:
    """Tiny inputs for an HF ``forward(hidden_states, position_embeddings, attention_mask)``."""
    p = _param_sample(module)
    if p is None or p.device.type == "meta" or type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor"):
        return None
    cfg = getattr(module, "config", None)
    hidden = getattr(cfg, "hidden_size", None)
    if hidden is None:
        q_proj = getattr(module, "q_proj", None)
        hidden = getattr(q_proj, "in_features", None)
    head_dim = getattr(module, "head_dim", None)
    if hidden is None or head_dim is None:
        return None
    params = inspect.signature(module.forward).parameters
    kwargs: dict = {"hidden_states": torch.zeros(1, seq, hidden, dtype=p.dtype, device=p.device)}
    if "position_embeddings" in params:
        kwargs["position_embeddings"] = (torch.ones(1, seq, head_dim, dtype=p.dtype, device=p.device),
                                         torch.zeros(1, seq, head_dim, dtype=p.dtype, device=p.device))
    if "attention_mask" in params:
        kwargs["attention_mask"] = None
    return kwargs


def probe_attention_calls(module: nn.Module, primitive: str, owner: str = "") -> Optional[int]:
    """Run the module's *original* forward on tiny dummy inputs and count attention calls.

    The primitive is not computed (the probe handler returns zeros), nothing communicates.
    Returns None when the module cannot be probed (no HF signature, meta/DTensor parameters,
    or its forward raised for reasons unrelated to the attention call; the latter is logged as
    a WARNING naming the module and the exception).
    """
    kwargs = hf_probe_inputs(module)
    if kwargs is None:
        return None

    def zeros(call: AttentionCall) -> torch.Tensor:
        q, v = call.q, call.v
        return q.new_zeros(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])

    undo = None
    try:
        if primitive == "hf_interface":
            ensure_hf_interface_registered()
            undo = install_private_config(module)
        with torch.no_grad(), interceptor_for(primitive)(owner, module, zeros, max_calls=1 << 30,
                                                          check=False) as scope:
            module.forward(**kwargs)
        return scope.count
    except CPInterceptionError:
        raise
    except Exception as exc:  # noqa: BLE001 - not probeable; runtime detection still applies
        log.warning("%s: the probe forward of %s (primitive=%s) raised %s: %s; the misfire / "
                    "double-interception preflight check is skipped for this module (it is still "
                    "detected at the first real forward)", owner or "CP wrapper", type(module).__name__,
                    primitive, type(exc).__name__, exc)
        return None
    finally:
        if undo is not None:
            undo()
