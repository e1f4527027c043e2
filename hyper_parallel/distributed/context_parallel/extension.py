"""A CP method added from outside the package — a user's own module, a test — for the length of a
``with`` block: :func:`registered_method` adds its catalogue row, its strategy class and one sync
entry point per offered style (published in the caller's module, so ``<module>.<entry>`` is its
``_target_`` path, and registered under the row's YAML names), and removes all of it on exit.

The row is a :class:`~.catalogue.CPMethod` like the built-in ones (``Offer.module`` = the caller's
module name; ``cost`` may be ``"<module>:<attr>"`` of any importable module). Everything that reads
the catalogue — the resolver, the planner, the batch policy, ``--explain`` — then sees it. Built-in
names cannot be replaced. docs/architecture.md, Recipe 1.
"""
from __future__ import annotations

import contextlib

from . import catalogue
from .catalogue import rows as _rows
from .methods.base import ContextParallelStrategy

__all__ = ["registered_method"]


@contextlib.contextmanager
def registered_method(row: "catalogue.CPMethod", strategy: type, namespace: dict):
    """Add the attention method ``row`` computed by ``strategy`` (a ContextParallelStrategy class
    named ``row.strategy``), its entry points bound in ``namespace`` (the calling module's
    ``globals()``); yields their names. ValueError (nothing added) for a clash or a malformed row."""
    from .methods.factory import STRATEGY_CLASSES
    from .registry import _REGISTRY, register_inner_wrapper
    from .wrappers.factory import publish, sync_entry

    module = namespace.get("__name__")
    taken = [n for n in (row.name,) + row.aliases if n in _rows._ALIASES]
    if taken:
        raise ValueError(f"CP method {row.name!r}: name(s) {taken} are already in the catalogue")
    if row.kind != "attention" or not (isinstance(strategy, type) and issubclass(strategy, ContextParallelStrategy)):
        raise ValueError(f"CP method {row.name!r}: an attention row and a ContextParallelStrategy subclass are needed")
    if strategy.__name__ != row.strategy or row.strategy in STRATEGY_CLASSES:
        raise ValueError(f"CP method {row.name!r}: strategy {row.strategy!r} must name the new class "
                         f"{strategy.__name__!r} and not a built-in one")
    offered = [o for o in row.offers if o.entry]
    if any(o.module != module for o in offered) or any(o.registry_name in _REGISTRY for o in offered):
        raise ValueError(f"CP method {row.name!r}: every offer's module must be {module!r} and its YAML "
                         f"name new")
    _rows.METHODS[row.name] = row
    _rows._ALIASES.update({n: row.name for n in (row.name,) + row.aliases})
    STRATEGY_CLASSES[row.strategy] = strategy
    names: list = []
    try:
        names = publish(namespace, (sync_entry(row, o) for o in offered))
        for o in offered:
            if o.registry_name:
                register_inner_wrapper(o.registry_name, namespace[o.entry])
        yield names
    finally:
        for o in offered:
            _REGISTRY.pop(o.registry_name, None)
        for n in names:
            namespace.pop(n, None)
        STRATEGY_CLASSES.pop(row.strategy, None)
        for n in (row.name,) + row.aliases:
            _rows._ALIASES.pop(n, None)
        _rows.METHODS.pop(row.name, None)
