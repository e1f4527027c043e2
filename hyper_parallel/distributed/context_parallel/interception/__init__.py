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

Modules: :mod:`.scope` (scope, SDPA route), :mod:`.hf_interface` (HF route), :mod:`.apply_context`
(wrap-time context), :mod:`.probe` (probe forwards), :mod:`.model_mask` (no model-level mask under CP
for methods that ignore it: DSA, Doge).
"""
from __future__ import annotations

from .apply_context import ApplyContext, applying, current_apply_context
from .hf_interface import (HF_FALSY_KWARGS, HF_IGNORED_KWARGS, ensure_hf_interface_registered, hf_call,
                           install_private_config, intercept_hf_any, intercept_hf_interface, interceptor_for)
from .probe import ProbeResult, hf_probe_inputs, probe_module
from .scope import HF_CP_INTERFACE, SDPA, AttentionCall, CPInterceptionError, InterceptScope, in_handler, intercept_sdpa

__all__ = ["SDPA", "HF_CP_INTERFACE", "CPInterceptionError", "AttentionCall", "InterceptScope", "in_handler",
           "intercept_sdpa", "ApplyContext", "applying", "current_apply_context", "HF_IGNORED_KWARGS",
           "HF_FALSY_KWARGS", "hf_call", "ensure_hf_interface_registered", "install_private_config",
           "intercept_hf_interface", "intercept_hf_any", "interceptor_for", "ProbeResult", "hf_probe_inputs",
           "probe_module"]
