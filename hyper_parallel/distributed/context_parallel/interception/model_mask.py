"""No model-level attention mask under CP for methods that never read it.

A transformers decoder builds its ``[B, 1, L, L]`` attention mask (``masking_utils``) in the base
model's forward, before the decoder layers. Some CP methods re-run the attention module's lines and
take causality, documents and padding from the CP batch meta only (DeepSeek sparse attention, Doge's
dynamic mask: their forward carries ``__hp_ignores_model_mask__``); for them that mask is O(L^2)
memory per rank that nothing reads (DSA and Doge even force it with ``allow_is_causal_skip=False``).

:func:`install_no_model_mask` wraps the forward of each base model (the module holding the decoder
layers' ``ModuleList``, with a ``config``) whose every CP-wrapped descendant ignores the mask: during
a CP forward (``cp_batch_context`` with ``cp_size > 1``) that forward sees, as ``self.config``, a shallow
copy naming :data:`HF_CP_INTERFACE` -- an attention interface with no mask function, for which
transformers' mask creation returns ``None`` before building anything. Nothing shared changes per call:
the module's class is, once at install, a subclass whose ``config`` property returns this thread's copy
while the thread is in that forward (a thread-local), else the module's own config; another thread, or
code outside the forward, sees the own config throughout.
Outside a CP forward (the preflight proof's reference, no meta) it runs unchanged. A model that also
has a module wrapped by a method that reads the mask keeps its mask. docs/wrappers.md, "Attentions
with a selection of their own".
"""
from __future__ import annotations

import copy
import functools
import logging
import threading
from typing import Callable, Optional

import torch.nn as nn

from .scope import HF_CP_INTERFACE

__all__ = ["IGNORES_MODEL_MASK", "install_no_model_mask", "mask_owner"]

log = logging.getLogger("hyper_parallel.apply")

#: attribute of an installed CP forward that takes nothing from the model's attention mask
IGNORES_MODEL_MASK = "__hp_ignores_model_mask__"


def mask_owner(model: nn.Module, fqn: str, names: Optional[dict] = None) -> Optional[str]:
    """FQN of the base model that builds the attention mask for the module at ``fqn``: the nearest
    ancestor with a ``config`` whose child on the path is a ``ModuleList`` (the decoder layers)."""
    names = dict(model.named_modules()) if names is None else names
    parts = fqn.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent, child = ".".join(parts[:i - 1]), ".".join(parts[:i])
        if isinstance(names.get(child), nn.ModuleList) and hasattr(names.get(parent), "config"):
            return parent
    return None


_ACTIVE = threading.local()     # .configs: {id(base model): its private config} of this thread's CP forwards
_CLASSES: dict = {}             # model class -> its subclass with the ``config`` property


def _config_get(self):
    private = getattr(_ACTIVE, "configs", {}).get(id(self))
    if private is not None:
        return private
    try:
        return self.__dict__["config"]
    except KeyError:
        raise AttributeError("config") from None


def _config_set(self, value):
    self.__dict__["config"] = value


def _with_config_property(module: nn.Module) -> None:
    """Give ``module`` (once) the subclass of its class whose ``config`` reads :data:`_ACTIVE` first."""
    cls = type(module)
    if cls.__dict__.get("__hp_private_config__"):
        return
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = _CLASSES[cls] = type(cls.__name__, (cls,), {
            "config": property(_config_get, _config_set), "__hp_private_config__": True,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    module.__class__ = sub


def _skipping_forward(module: nn.Module, original: Callable) -> Callable:
    from ..meta import current_cp_batch_meta

    _with_config_property(module)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        meta = current_cp_batch_meta(required=False)
        if meta is None or meta.cp_size == 1:
            return original(*args, **kwargs)
        private = copy.copy(module.__dict__["config"])
        # set the field directly: the property setter would recurse into *shared* sub-configs
        private.__dict__["_attn_implementation_internal"] = HF_CP_INTERFACE
        configs = _ACTIVE.__dict__.setdefault("configs", {})
        outer = configs.get(id(module))
        configs[id(module)] = private
        try:
            return original(*args, **kwargs)
        finally:
            if outer is None:
                configs.pop(id(module), None)
            else:
                configs[id(module)] = outer

    forward.__hp_no_model_mask__ = True
    return forward


def install_no_model_mask(model: nn.Module, replace_forward: Optional[Callable] = None) -> list[str]:
    """Wrap each base model whose CP-wrapped modules all ignore the model's mask (module doc);
    returns the wrapped FQNs. ``replace_forward(module, fn)``: the applier's undo-recording installer."""
    names = dict(model.named_modules())
    owners: dict = {}
    for fqn, mod in names.items():
        if "__hp_cp_wrapped__" not in mod.__dict__:
            continue
        owner = mask_owner(model, fqn, names)
        if owner is not None:
            owners.setdefault(owner, []).append(hasattr(mod.__dict__.get("forward"), IGNORES_MODEL_MASK))
    done: list = []
    if not owners:
        return done
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    if HF_CP_INTERFACE in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        return done     # a mask function under that name: transformers would build it; keep the model's mask
    for owner, ignores in owners.items():
        module = names[owner]
        if not all(ignores) or getattr(module.__dict__.get("forward"), "__hp_no_model_mask__", False):
            continue
        cfg = getattr(module, "config", None)
        if cfg is None or "_attn_implementation_internal" not in getattr(cfg, "__dict__", {}):
            continue        # not a transformers config: nothing to skip
        fn = _skipping_forward(module, module.forward)
        if replace_forward is None:
            module.forward = fn
        else:
            replace_forward(module, fn)
        done.append(owner)
        log.info("CP: %s (%s) builds no attention mask under CP (its CP methods read the batch meta)",
                 owner or "<root>", type(module).__name__)
    return done
