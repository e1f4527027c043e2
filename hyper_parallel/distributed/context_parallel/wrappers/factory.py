"""One factory makes every built-in attention entry point from its catalogue row.

A sync entry point is one ``(method, style)`` cell of :mod:`..catalogue` (:func:`sync_entry`); an
async one is a method's generic Target or a model adapter's named Target (:func:`async_entry`).
Each is an ``@inner_wrapper`` with an explicit signature — the five mesh parameters, then the
row's degree parameter (required) and, async, its pipeline depth (default None) — whose
arguments are bound against that signature (an unknown name is a TypeError, as for a written
function). Its docstring is generated from the row; its ``__module__`` is the public home it is
published in, so ``<module>.<name>`` is its ``_target_`` path. docs/architecture.md, Recipe 1.
"""
from __future__ import annotations

import inspect
from typing import Callable, Iterable, Optional

from .. import catalogue
from ..registry import MESH_PARAMS, inner_wrapper
from .async_handoff import check_kv_chunks, check_q_chunks, install_async, validate_async
from .preflight import make_validate
from .routes import install

__all__ = ["sync_entry", "async_entry", "publish"]

_P = inspect.Parameter
_CHUNK_CHECKS = {"q_chunks": check_q_chunks, "kv_chunks": check_kv_chunks}


def _signature(lead: tuple, required: tuple, optional: tuple, kind=_P.POSITIONAL_OR_KEYWORD) -> inspect.Signature:
    head = [_P(n, _P.POSITIONAL_OR_KEYWORD) for n in lead]
    return inspect.Signature(head + [_P(n, kind) for n in required] + [_P(n, kind, default=None) for n in optional])


def _function(name: str, module: str, sig: inspect.Signature, body: Callable, doc: str) -> Callable:
    """A function ``name`` with signature ``sig`` that calls ``body(**bound arguments)``."""
    def fn(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return body(**bound.arguments)

    fn.__signature__ = sig
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = module
    fn.__doc__ = doc
    return fn


def _params_doc(method: catalogue.CPMethod, is_async: bool) -> str:
    required, optional = catalogue.entry_params(method, is_async)
    names = [f"``{n}`` (required)" for n in required] + [f"``{n}`` (default None: the library's)" for n in optional]
    return f" Named parameters: {', '.join(names)}." if names else ""


def sync_entry(method: catalogue.CPMethod, offer: catalogue.Offer) -> Callable:
    """The sync entry point of one offered catalogue cell, public at ``offer.target``."""
    style = catalogue.STYLES[offer.style]
    required, optional = catalogue.entry_params(method, False)
    degree = required[0] if required else None

    def body(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, **named):
        return install(offer.entry, method.name, style.name, target_module, mesh, cp_mesh,
                       named.get(degree) if degree else None)

    doc = (f"Sync {method.title} CP for {style.description}. Heads: {method.head_doc}; degree: "
           f"{method.degree_doc}.{_params_doc(method, False)} Catalogue row ``{method.name}`` x style "
           f"``{style.name}`` (docs/wrappers.md).")
    fn = _function(offer.entry, offer.module, _signature(MESH_PARAMS, required, optional), body, doc)
    return inner_wrapper(method=method.name, style=style.registry_style, is_async=False, communicates=True,
                         validate=make_validate(offer.entry, method.name, style.name))(fn)


def async_entry(method: catalogue.CPMethod, module: str, *, arch: Optional[str] = None,
                subject: str = "any attention implementing the handoff protocol",
                prepare: Optional[Callable] = None) -> Callable:
    """An async Target of ``method``: the generic one (``arch`` None, for every handoff-protocol
    adapter of the catalogue) or model ``arch``'s, public at ``<module>.<name>``.

    ``prepare(target_module, name) -> forward`` (adapters) checks the module is the model's attention and
    gives it the protocol, before validation and installation; the generic Target runs the
    module's own forward. Validation: the pipeline depth, then :func:`.async_handoff.validate_async`
    (protocol, probe, features, heads / degree); no collective."""
    name = catalogue.async_entry_name(method.name, arch)
    required, optional = catalogue.entry_params(method, True)

    def forward_of(target_module):
        return prepare(target_module, name) if prepare is not None else None

    def body(target_module, mesh, tp_mesh, cp_mesh, ep_mesh, **params):
        fwd = forward_of(target_module)
        return install_async(method.name, target_module, mesh, cp_mesh, name, forward=fwd, **params)

    def check(target_module, cp_size, tp_size=1, probe=True, **params):
        if method.async_param:
            _CHUNK_CHECKS[method.async_param](params.get(method.async_param), name)
        fwd = forward_of(target_module)
        validate_async(target_module, method.name, name, cp_size=cp_size, tp_size=tp_size,
                       ulysses_degree=params.get(method.degree_param) if method.degree_param else None,
                       probe=probe, forward=fwd)

    vsig = _signature(("target_module",), (), (), kind=_P.KEYWORD_ONLY)
    vsig = vsig.replace(parameters=[*vsig.parameters.values(), _P("cp_size", _P.KEYWORD_ONLY),
                                    _P("tp_size", _P.KEYWORD_ONLY, default=1),
                                    _P("probe", _P.KEYWORD_ONLY, default=True),
                                    *_signature((), required, optional, kind=_P.KEYWORD_ONLY).parameters.values()])
    validate = _function(f"validate[{name}]", module, vsig, check, f"Preflight of {name} (no collective).")
    doc = (f"Async {method.title} CP for {subject}: {method.async_doc}.{_params_doc(method, True)} "
           "Launch / wait order, forward and backward: docs/async_cp.md.")
    fn = _function(name, module, _signature(MESH_PARAMS, required, optional), body, doc)
    adapters = arch if arch else catalogue.ADAPTER_ARCHS     # the generic Target: every registered adapter, live
    return inner_wrapper(method=method.name, style="model", is_async=True, model_adapter=adapters,
                         validate=validate)(fn)


def publish(namespace: dict, entries: Iterable[Callable]) -> list:
    """Bind each entry point under its name in ``namespace`` (a module's globals); return the names."""
    names = []
    for fn in entries:
        namespace[fn.__name__] = fn
        names.append(fn.__name__)
    return names
