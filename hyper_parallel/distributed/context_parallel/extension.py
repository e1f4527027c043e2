"""A CP method added from outside the package — a user's own module, a test — for the length of a
``with`` block: :func:`registered_method` adds its catalogue row and, for an attention method, its
strategy class, one sync entry point per offered style and, when the row names an async plan, its
generic async Target (all published in the caller's module, so ``<module>.<entry>`` is the
``_target_`` path), registers the row's YAML names, and removes all of it on exit. A token-mixer method brings its own entry function; the classes a generic mixer core
accepts are added with that core's registry (``mixers.families.FamilyRegistry.registered``).

The row is a :class:`~.catalogue.CPMethod` like the built-in ones (``Offer.module`` = the caller's
module name; ``cost`` may be ``"<module>:<attr>"`` of any importable module). Everything that reads
the catalogue — the resolver, the planner, the batch policy, ``--explain`` — then sees it. Built-in
names cannot be replaced. docs/architecture.md, Recipes 1 and 2.
"""
from __future__ import annotations

import contextlib
from typing import Optional

from . import catalogue
from .catalogue import rows as _rows
from .methods.base import ContextParallelStrategy

__all__ = ["registered_method"]


@contextlib.contextmanager
def registered_method(row: "catalogue.CPMethod", strategy: Optional[type], namespace: dict):
    """Add the method ``row`` with its entry points bound in ``namespace`` (the calling module's
    ``globals()``); yields their names. An attention row: ``strategy`` is the ContextParallelStrategy
    class named ``row.strategy`` and the sync entry points are generated into ``namespace``. A
    token-mixer row (``kind="mixer"``): ``strategy`` None and each offer's entry is the caller's own
    ``@inner_wrapper(mixer=True)`` function already in ``namespace``. ValueError (nothing added) for a
    clash or a malformed row. An async row (``async_plan`` = ``"<module>:<builder>"`` returning an
    :class:`~.async_plan.AsyncPlan`) names its one generic Target in ``async_targets``:
    ``<caller's module>.async_<name>_cp_wrapper``, generated into ``namespace`` too (the model
    adapters' named Targets are made when an adapter is imported, so they cover built-in rows only)."""
    from .methods.factory import STRATEGY_CLASSES
    from .registry import _REGISTRY, register_inner_wrapper, wrapper_info
    from .wrappers.factory import async_entry, publish, sync_entry

    module = namespace.get("__name__")
    taken = [n for n in (row.name,) + row.aliases if n in catalogue.METHODS or _rows._ALIASES.get(n)]
    if taken:
        raise ValueError(f"CP method {row.name!r}: name(s) {taken} are already in the catalogue")
    offered = [o for o in row.offers if o.entry]
    if row.kind == "attention":
        if not (isinstance(strategy, type) and issubclass(strategy, ContextParallelStrategy)):
            raise ValueError(f"CP method {row.name!r}: an attention row needs a ContextParallelStrategy subclass")
        if strategy.__name__ != row.strategy or row.strategy in STRATEGY_CLASSES:
            raise ValueError(f"CP method {row.name!r}: strategy {row.strategy!r} must name the new class "
                             f"{strategy.__name__!r} and not a built-in one")
    elif row.kind == "mixer":
        info = [wrapper_info(namespace.get(o.entry)) for o in offered]
        if strategy is not None or not offered or any(i is None or not i.mixer for i in info):
            raise ValueError(f"CP method {row.name!r}: a token-mixer row takes no strategy, and each offer names "
                             f"an @inner_wrapper(mixer=True) function of {module!r}")
    else:
        raise ValueError(f"CP method {row.name!r}: kind must be 'attention' or 'mixer', got {row.kind!r}")
    generic = f"{module}.{catalogue.async_entry_name(row.name)}"
    if (row.async_targets or row.async_plan) and (row.kind != "attention" or not row.async_plan
                                                  or tuple(row.async_targets) != (generic,)):
        raise ValueError(f"CP method {row.name!r}: an async row is an attention row naming both its async_plan "
                         f"('<module>:<builder>') and its one generic Target async_targets=({generic!r},)")
    if any(o.module != module for o in offered) or any(o.registry_name in _REGISTRY for o in offered):
        raise ValueError(f"CP method {row.name!r}: every offer's module must be {module!r} and its YAML "
                         f"name new")
    catalogue.add_rows(row)
    if strategy is not None:
        STRATEGY_CLASSES[row.strategy] = strategy
    names: list = []
    try:
        if row.kind == "attention":
            names = publish(namespace, [*(sync_entry(row, o) for o in offered),
                                        *([async_entry(row, module)] if row.async_targets else [])])
        for o in offered:
            if o.registry_name:
                register_inner_wrapper(o.registry_name, namespace[o.entry])
        yield names or [o.entry for o in offered]
    finally:
        for o in offered:
            _REGISTRY.pop(o.registry_name, None)
        for n in names:
            namespace.pop(n, None)
        if strategy is not None:
            STRATEGY_CLASSES.pop(row.strategy, None)
        catalogue.remove_row(row.name)
