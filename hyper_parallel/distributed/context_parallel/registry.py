"""``@inner_wrapper`` and the wrapper registry.

An inner wrapper is a callable ``fn(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, **named)``
that installs one CP method on ``target_module``: it either returns a replacement forward
(installed by the applier) or replaces ``target_module.forward`` in place and returns None.
The framework fills the mesh family (None for inactive axes) and the Target's named params
(e.g. ``ulysses_degree``). Undecorated callables and ``*args``/``**kwargs`` signatures are
rejected at resolution. The CP method is fixed by the wrapper, never by a global switch.

The method names and styles a wrapper may declare, and the modules that register the built-in
YAML names, come from :mod:`.catalogue`; this module imports no wrapper module statically (the
built-ins are imported by path on first lookup, like any ``_target_``).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable

from . import catalogue

MESH_PARAMS = ("target_module", "mesh", "tp_mesh", "cp_mesh", "ep_mesh")


def wrapper_methods() -> tuple:
    """The ``WrapperInfo.method`` values: every attention row of the catalogue (read now: a method
    registered at run time, ``context_parallel.extension``, counts) and ``"custom"``."""
    return catalogue.method_names("attention") + ("custom",)


STYLES = catalogue.wrapper_styles()                          # WrapperInfo.style values


@dataclasses.dataclass(frozen=True)
class WrapperInfo:
    """Metadata attached to an ``@inner_wrapper`` callable."""

    fn: Callable
    qualname: str
    method: str = "custom"            # which CP communication method the wrapper fixes
    style: str = "custom"             # attention calling convention it adapts
    is_async: bool = False            # launches collectives early and waits at the consumer
    communicates: bool = True         # issues CP collectives (=> region_dispatch must be false)
    # architecture(s) the wrapper is written for (async adapters): a model type, a tuple, or the generic
    # Targets' live list of registered adapters (catalogue.ADAPTER_ARCHS; left out of the hash)
    model_adapter: Any = dataclasses.field(default=None, hash=False)
    validate: Callable | None = None  # validate(target_module, *, cp_size, **named) -> None, raises
    # a token-mixer method (not attention): may be declared on a non-attention module (e.g. a Gated
    # DeltaNet / Mamba2 / short-conv layer), runs on the contiguous layout (the applier moves a permuted
    # batch there and back: context_parallel.mixers.layout.on_contiguous_layout)
    mixer: bool = False
    # a mixer's forward arguments -> the dim carrying the sequence (None: none), on top of the defaults
    # (context_parallel.mixers.layout.DEFAULT_SEQ_DIMS); what a permuted batch moves, the rest refused
    seq_dims: dict | None = None
    named_params: tuple = ()          # names after the five mesh-family parameters
    required_params: tuple = ()       # named params without a default
    # installed at cp_size 1 too (its ``when: cp`` entry is not skipped), where it runs its one-rank
    # computation: a method that fixes a choice transformers leaves unspecified (DSA's indexer top-k,
    # Doge's dynamic mask: ties) computes the same selection at every CP size, CP=1 included
    at_cp1: bool = False


class WrapperSignatureError(TypeError):
    pass


def _inspect(fn: Callable) -> tuple[tuple, tuple]:
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise WrapperSignatureError(
                f"inner wrapper {fn.__qualname__} uses *{p.name}/**{p.name}: declare every named "
                "parameter explicitly so YAML params can be checked"
            )
    names = [p.name for p in params]
    if tuple(names[:5]) != MESH_PARAMS:
        raise WrapperSignatureError(
            f"inner wrapper {fn.__qualname__} must start with parameters {MESH_PARAMS}, got {tuple(names[:5])}"
        )
    named = tuple(names[5:])
    required = tuple(p.name for p in params[5:] if p.default is p.empty)
    return named, required


def inner_wrapper(fn: Callable | None = None, *, method: str = "custom", style: str = "custom",
                  is_async: bool = False, communicates: bool = True, model_adapter: str | None = None,
                  validate: Callable | None = None, mixer: bool = False, seq_dims: dict | None = None,
                  at_cp1: bool = False):
    """Mark ``fn`` as an inner wrapper (usable bare or with keyword metadata)."""
    if seq_dims is not None and (not mixer or not isinstance(seq_dims, dict) or not all(
            isinstance(k, str) and (v is None or type(v) is int and v >= 0) for k, v in seq_dims.items())):
        raise ValueError(f"inner_wrapper seq_dims (mixer=True only) maps forward argument names to a sequence "
                         f"dim (int >= 0) or None, got {seq_dims!r} with mixer={mixer}")

    def deco(f: Callable) -> Callable:
        if method not in wrapper_methods():
            raise ValueError(f"inner_wrapper method must be one of {wrapper_methods()}, got {method!r}")
        if style not in STYLES:
            raise ValueError(f"inner_wrapper style must be one of {STYLES}, got {style!r}")
        named, required = _inspect(f)
        f.__hp_inner_wrapper__ = WrapperInfo(
            fn=f, qualname=f"{f.__module__}.{f.__qualname__}", method=method, style=style,
            is_async=is_async, communicates=communicates, model_adapter=model_adapter,
            validate=validate, mixer=mixer, seq_dims=seq_dims, named_params=named, required_params=required,
            at_cp1=at_cp1 and mixer,
        )
        return f

    return deco(fn) if fn is not None else deco


def wrapper_info(fn: Any) -> WrapperInfo | None:
    return getattr(fn, "__hp_inner_wrapper__", None)


_REGISTRY: dict[str, Callable] = {}
_BUILTINS_LOADED = False


def register_inner_wrapper(name: str, fn: Callable, *, overwrite: bool = False) -> Callable:
    """Register a decorated wrapper under a YAML-usable name."""
    if wrapper_info(fn) is None:
        raise WrapperSignatureError(f"{name!r}: {fn!r} is not decorated with @inner_wrapper")
    if name in _REGISTRY and _REGISTRY[name] is not fn and not overwrite:
        raise ValueError(f"inner wrapper name {name!r} is already registered to {_REGISTRY[name].__qualname__}")
    _REGISTRY[name] = fn
    return fn


def _load_builtins() -> None:
    """Import the modules that register the catalogue's built-in names (once)."""
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        for module in catalogue.builtin_modules():
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:  # a built-in module not installed in this build
                if exc.name != module:
                    raise


def registered_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_registered(name: str) -> Callable | None:
    _load_builtins()
    return _REGISTRY.get(name)


def import_target(path: str) -> Any:
    """Import ``package.module.attr`` (attr may be nested: ``module.Class.method``)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        mod_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(mod_name)
        except ModuleNotFoundError as exc:
            if exc.name and (mod_name == exc.name or mod_name.startswith(exc.name + ".")):
                continue
            raise
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                raise ImportError(f"module '{mod_name}' has no attribute '{'.'.join(parts[cut:])}'")
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot import any module prefix of '{path}'")
