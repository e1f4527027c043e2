"""The interception scope of one forward (:class:`InterceptScope`: counts and dispatches the
calls, thread-local) and the SDPA route (:func:`intercept_sdpa`, a scoped ``TorchFunctionMode``)."""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

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
