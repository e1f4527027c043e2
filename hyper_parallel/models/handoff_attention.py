"""The async handoff protocol for transformers' Llama-family attentions (Llama, Qwen2, Qwen3,
Mistral, Qwen3-MoE), shared by their adapters.

These attentions compute ``q = q_proj -> [q_norm] -> RoPE``, the same for ``k``, ``v = v_proj``,
one attention-interface call and ``o_proj``; HF runs the Q branch first. Async CP needs the
reverse: K and V must be ready (and their collectives launched) *before* the Q branch so the
collectives overlap it, forward and backward. :func:`handoff_forward` is HF's forward in that
order with the four handoff calls inserted (docs/async_cp.md)::

    k = RoPE(k_norm?(k_proj(h)))    -> cp_k_handoff      (launch K)
    v = v_proj(h)                   -> cp_v_handoff      (launch V: overlaps nothing of K's
    q = RoPE(q_norm?(q_proj(h)))    -> cp_q_handoff       collective but the V projection)
    q, k, v = cp_attn_wait(q, k, v)                      (wait)
    attention_interface(self, q, k, v, mask, dropout, scaling[, sliding_window], **kwargs) -> o_proj

Every operation is the model's own: the module's projections and norms, the modeling file's
``apply_rotary_pos_emb`` and ``eager_attention_forward`` / ``ALL_ATTENTION_FUNCTIONS``, the same
``sliding_window`` the HF forward passes (Mistral: ``config.sliding_window``; Qwen2/Qwen3/
Qwen3-MoE: the layer's ``sliding_window``). Without a CP wrapper the result equals HF's forward
(the adapters' parity tests compare with the unmodified model). The forward is *reordered*, not
hooked: with HF's order the Q projection runs before K exists, so nothing could overlap it.

:func:`install_protocol` gives one attention instance the protocol (idempotent): four
parameter-free handoff submodules and ``get_async_cp_handoffs()``; the module's own ``forward``
is left alone (the async wrapper runs :func:`handoff_forward` inside its CP forward).
:func:`adapter_wrappers` builds a model's named async Targets on top of the generic installation
(:func:`hyper_parallel.distributed.context_parallel.wrappers.async_handoff.install_async`).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import sys
import types
from typing import Callable, Optional

import torch.nn as nn

from ..distributed.context_parallel import catalogue
from ..distributed.context_parallel.wrappers.async_handoff import AttnWait, HandoffPoint
from ..distributed.context_parallel.wrappers.factory import async_entry

__all__ = ["HFAttentionSpec", "handoff_forward", "install_protocol", "adapter_wrappers", "adapter_module",
           "target_names", "publish_adapter"]


@dataclasses.dataclass(frozen=True)
class HFAttentionSpec:
    """What differs between the Llama-family attentions (everything else is shared)."""

    arch: str                      # model_type
    title: str                     # words for messages
    modeling: str                  # transformers modeling module
    cls: str                       # attention class name in it
    qk_norm: bool                  # per-head RMSNorm on q and k before RoPE (Qwen3, Qwen3-MoE)
    window: Optional[Callable[[nn.Module], Optional[int]]] = None   # the sliding_window kwarg HF passes

    def module(self):
        return importlib.import_module(self.modeling)

    def attention_class(self):
        return getattr(self.module(), self.cls)


def _rope(modeling, x, cos, sin):
    """The model's own ``apply_rotary_pos_emb`` on one tensor (the second slot gets an empty view)."""
    return modeling.apply_rotary_pos_emb(x, x[:, :0], cos, sin)[0]


def handoff_forward(self, spec: HFAttentionSpec, hidden_states, position_embeddings=None, attention_mask=None,
                    cache=None, **kwargs):
    """HF's attention forward, K and V first, with the four handoff calls (see the module doc)."""
    if cache is not None or kwargs.get("past_key_values") is not None:
        raise ValueError(f"{spec.title} async CP: a KV cache is not supported in training; call the model with "
                         "use_cache=False")
    if position_embeddings is None:
        raise ValueError(f"{spec.title} async CP: position_embeddings (cos, sin) are required")
    M = spec.module()
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = position_embeddings

    k = self.k_proj(hidden_states).view(hidden_shape)
    if spec.qk_norm:
        k = self.k_norm(k)
    k = self.cp_k_handoff(_rope(M, k.transpose(1, 2), cos, sin))
    v = self.cp_v_handoff(self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2))
    q = self.q_proj(hidden_states).view(hidden_shape)
    if spec.qk_norm:
        q = self.q_norm(q)
    q = self.cp_q_handoff(_rope(M, q.transpose(1, 2), cos, sin))
    q, k, v = self.cp_attn_wait(q, k, v)

    attention_interface = M.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                  M.eager_attention_forward)
    extra = {} if spec.window is None else {"sliding_window": spec.window(self)}
    attn_output, attn_weights = attention_interface(
        self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling, **extra, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def check_adapter_target(module: nn.Module, spec: HFAttentionSpec, who: str) -> None:
    """Refuse a module that is not this model's attention (no fallback to another adapter)."""
    try:
        cls = spec.attention_class()
    except (ImportError, AttributeError) as exc:  # pragma: no cover - transformers without the model
        raise ValueError(f"{who}: transformers has no {spec.title} attention: {exc}") from exc
    if not isinstance(module, cls):
        raise ValueError(
            f"{who}: async CP wrapper is a {spec.title} model adapter but the target is {type(module).__name__}: "
            "async needs a model adapter with explicit handoffs; use that model's async adapter, the sync wrapper "
            "(e.g. sdpa_hf_cp_wrapper) or implement get_async_cp_handoffs() (docs/async_cp.md)")


def install_protocol(module: nn.Module, spec: HFAttentionSpec) -> Callable:
    """Give ``module`` the handoff protocol (idempotent); return its protocol forward (bound)."""
    fwd = module.__dict__.get("__hp_handoff_forward__")
    if fwd is not None:
        return fwd
    module.cp_q_handoff = HandoffPoint("q")
    module.cp_k_handoff = HandoffPoint("k")
    module.cp_v_handoff = HandoffPoint("v")
    module.cp_attn_wait = AttnWait()

    def get_async_cp_handoffs():
        return {"q": module.cp_q_handoff, "k": module.cp_k_handoff, "v": module.cp_v_handoff,
                "wait": module.cp_attn_wait}

    module.get_async_cp_handoffs = get_async_cp_handoffs

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        return handoff_forward(self, spec, hidden_states, position_embeddings, attention_mask, cache, **kwargs)

    fwd = types.MethodType(forward, module)
    module.__dict__["__hp_handoff_forward__"] = fwd
    return fwd


def adapter_module(arch: str) -> str:
    """The public module path of model ``arch``'s async adapter Targets (a ``_target_`` prefix; the code is
    in ``models/<arch>/async_cp.py``, made importable there by :func:`publish_adapter`)."""
    return f"{__package__}.{arch}.adapter.distributed.context_parallel_async"


def target_names(arch: str) -> list:
    """``<arch>_async_<method>_cp_wrapper`` for every async method, in catalogue order."""
    return [catalogue.async_entry_name(m.name, arch) for m in catalogue.async_methods()]


def adapter_wrappers(spec: HFAttentionSpec, module_name: str) -> dict:
    """The named async Targets of one model, ``{name: fn}`` (:func:`target_names`), made by
    :func:`~..distributed.context_parallel.wrappers.factory.async_entry`: each checks the target
    is this model's attention and installs the protocol, then runs the generic preflight /
    installation. ``module_name``: their ``__module__`` (the public path, :func:`publish_adapter`)."""
    def prepare(module, who):
        check_adapter_target(module, spec, who)
        return install_protocol(module, spec)

    subject = f"{spec.title} ({spec.cls}) through the handoff protocol (hyper_parallel.models.handoff_attention)"
    fns = [async_entry(m, module_name, arch=spec.arch, subject=subject, prepare=prepare)
           for m in catalogue.async_methods()]
    return {fn.__name__: fn for fn in fns}


def publish_adapter(spec: HFAttentionSpec, namespace: dict) -> list:
    """Publish a model's async Targets from its ``models/<model_type>/async_cp.py`` (``namespace``:
    that module's ``globals()``): the Targets go into the module, the module becomes importable at
    the design's public ``_target_`` path (:func:`adapter_module`:
    ``hyper_parallel.models.<model_type>.adapter.distributed.context_parallel_async``, also the
    Targets' ``__module__``) and the module's ``__all__`` is returned."""
    public = adapter_module(spec.arch)
    namespace.update(adapter_wrappers(spec, public))
    _alias_module(sys.modules[namespace["__name__"]], public)
    catalogue.add_async_adapter(spec.arch, public)
    return ["SPEC", *target_names(spec.arch)]


def _alias_module(module: types.ModuleType, public: str) -> None:
    """``sys.modules[public] = module``; each missing parent of ``public`` becomes an empty package
    (import-path only) up to the first one already imported (the model's package)."""
    sys.modules[public] = module
    child = public
    while True:
        parent, _, leaf = child.rpartition(".")
        pkg = sys.modules.get(parent)
        known = pkg is not None
        if not known:
            pkg = types.ModuleType(parent, f"Import path of {public} (the code: {module.__name__}).")
            pkg.__spec__ = importlib.machinery.ModuleSpec(parent, None, is_package=True)
            pkg.__path__ = []
            sys.modules[parent] = pkg
        setattr(pkg, leaf, sys.modules[child])
        if known:
            return
        child = parent
