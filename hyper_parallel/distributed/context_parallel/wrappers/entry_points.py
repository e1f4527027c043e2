"""The built-in attention wrappers: one public entry point per offered catalogue cell.

Each function fixes one CP method and one calling style — the row and column of
:mod:`..catalogue` that offers it (``entry``); method, style, registry name and the ``validate``
hook all come from there, and every offered entry is defined here (a test checks both ways).
Public path: ``hyper_parallel.distributed.context_parallel.wrappers.<name>`` (the functions'
``__module__`` is the package, which re-exports them). The mesh family follows
:mod:`..registry`'s contract; Hybrid takes the named parameter ``ulysses_degree``.
"""
from __future__ import annotations

from typing import Callable

from .. import catalogue
from ..registry import inner_wrapper, register_inner_wrapper
from .preflight import make_validate
from .routes import install

__all__ = [
    "sdpa_hf_cp_wrapper", "sdpa_hf_ulysses_cp_wrapper", "sdpa_hf_hybrid_cp_wrapper", "sdpa_hf_load_balance_cp_wrapper",
    "sdpa_qkv_cp_wrapper", "sdpa_qkv_ulysses_cp_wrapper", "sdpa_qkv_hybrid_cp_wrapper",
    "sdpa_qkv_load_balance_cp_wrapper", "flex_hf_cp_wrapper", "flex_hf_ulysses_cp_wrapper", "flex_qkv_cp_wrapper",
    "flex_qkv_ulysses_cp_wrapper", "BUILTIN_NAMES",
]


def _meta(entry: str) -> dict:
    """``@inner_wrapper`` metadata of entry point ``entry`` from its catalogue row and style."""
    e = catalogue.entry_meta(entry)
    return dict(method=e["method"].name, style=e["style"].registry_style, is_async=False, communicates=True,
                validate=make_validate(entry, e["method"].name, e["style"].name))


def _public(fn: Callable) -> Callable:
    """Give an entry point its public home (the package) before ``@inner_wrapper`` records its qualname."""
    fn.__module__ = catalogue.WRAPPERS_MODULE
    return fn


def _install(entry: str, target_module, mesh, cp_mesh, ulysses_degree=None) -> Callable:
    e = catalogue.entry_meta(entry)
    return install(entry, e["method"].name, e["style"].name, target_module, mesh, cp_mesh, ulysses_degree)


@inner_wrapper(**_meta("sdpa_hf_cp_wrapper"))
@_public
def sdpa_hf_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal (K/V AllGather) for HF ``forward(hidden_states)`` + SDPA attention."""
    return _install("sdpa_hf_cp_wrapper", target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("sdpa_hf_ulysses_cp_wrapper"))
@_public
def sdpa_hf_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Pure Ulysses (ulysses_degree == cp_size) for HF SDPA attention."""
    return _install("sdpa_hf_ulysses_cp_wrapper", target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("sdpa_hf_hybrid_cp_wrapper"))
@_public
def sdpa_hf_hybrid_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, ulysses_degree):
    """Sync Hybrid (Ulysses A2A in groups of ``ulysses_degree`` + Colossal K/V AllGather) for HF SDPA."""
    return _install("sdpa_hf_hybrid_cp_wrapper", target_module, mesh, cp_mesh, ulysses_degree)


@inner_wrapper(**_meta("sdpa_hf_load_balance_cp_wrapper"))
@_public
def sdpa_hf_load_balance_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal with Head-Tail load balance for HF SDPA (batch policy 'load_balance')."""
    return _install("sdpa_hf_load_balance_cp_wrapper", target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("sdpa_qkv_cp_wrapper"))
@_public
def sdpa_qkv_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal for ``forward(q, k, v, ...)`` core attention calling SDPA."""
    return _install("sdpa_qkv_cp_wrapper", target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("sdpa_qkv_ulysses_cp_wrapper"))
@_public
def sdpa_qkv_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Pure Ulysses for ``forward(q, k, v, ...)`` core attention calling SDPA."""
    return _install("sdpa_qkv_ulysses_cp_wrapper", target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("sdpa_qkv_hybrid_cp_wrapper"))
@_public
def sdpa_qkv_hybrid_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, ulysses_degree):
    """Sync Hybrid for ``forward(q, k, v, ...)`` core attention calling SDPA."""
    return _install("sdpa_qkv_hybrid_cp_wrapper", target_module, mesh, cp_mesh, ulysses_degree)


@inner_wrapper(**_meta("sdpa_qkv_load_balance_cp_wrapper"))
@_public
def sdpa_qkv_load_balance_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal Head-Tail load balance for ``forward(q, k, v, ...)`` core attention calling SDPA."""
    return _install("sdpa_qkv_load_balance_cp_wrapper", target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("flex_hf_cp_wrapper"))
@_public
def flex_hf_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal for HF attention built with attn_implementation='flex_attention'."""
    return _install("flex_hf_cp_wrapper", target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("flex_hf_ulysses_cp_wrapper"))
@_public
def flex_hf_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Pure Ulysses for HF FlexAttention attention."""
    return _install("flex_hf_ulysses_cp_wrapper", target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("flex_qkv_cp_wrapper"))
@_public
def flex_qkv_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Colossal for a ``forward(q, k, v, block_mask=None, scale=None)`` FlexAttention core module."""
    return _install("flex_qkv_cp_wrapper", target_module, mesh, cp_mesh)


@inner_wrapper(**_meta("flex_qkv_ulysses_cp_wrapper"))
@_public
def flex_qkv_ulysses_cp_wrapper(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    """Sync Pure Ulysses for a FlexAttention core module."""
    return _install("flex_qkv_ulysses_cp_wrapper", target_module, mesh, cp_mesh)


# registry name -> function, for every entry point with a YAML short name in the catalogue
BUILTIN_NAMES = {reg: globals()[target.rsplit(".", 1)[1]]
                 for reg, target in catalogue.builtin_names("attention").items()}
for _reg, _fn in BUILTIN_NAMES.items():
    register_inner_wrapper(_reg, _fn)
del _reg, _fn
