"""build_strategy: pick one sync strategy for a wrapper from its fixed CP method.

``method`` is an attention method of :mod:`..catalogue` (name or alias): "colossal" (alias
"all_gather"), "ulysses", "hybrid", "load_balance" (alias "head_tail"); the row names the
strategy class and the degree rule. ``mesh`` may be a MeshContext
(preferred: groups come from its cached sub-meshes), a 1-D DeviceMesh or ProcessGroup (the CP
group), a 2-D (colossal, ulysses) DeviceMesh or a ``(colossal_group, ulysses_group)`` pair for
Hybrid, or None (cp 1). No process group is ever created here.
"""
from __future__ import annotations

import importlib

from torch.distributed.device_mesh import DeviceMesh

from .. import catalogue
from .base import ContextParallelStrategy

# the catalogue's ``strategy`` names -> classes, each read from ``methods/<strategy_module>/strategy.py``
STRATEGY_CLASSES = {m.strategy: getattr(importlib.import_module(f"{__package__}.{m.strategy_module}.strategy"), m.strategy)
                    for m in catalogue.attention_methods()}


def _is_mesh_context(obj) -> bool:
    return hasattr(obj, "cp_mesh") and hasattr(obj, "hybrid_groups")


def _cp_group(mesh):
    if _is_mesh_context(mesh):
        return mesh.cp_mesh
    if isinstance(mesh, (tuple, list)) or (isinstance(mesh, DeviceMesh) and mesh.ndim != 1):
        raise ValueError("expected the CP mesh/group (1-D), got hybrid (colossal, ulysses) groups")
    return mesh


def _hybrid_groups(mesh, u):
    if _is_mesh_context(mesh):
        return mesh.hybrid_groups(u)     # cached at set-up; raises for undeclared degrees
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 2:
        return mesh.get_group(0), mesh.get_group(1)
    if isinstance(mesh, (tuple, list)) and len(mesh) == 2:
        return tuple(mesh)
    raise ValueError("hybrid needs a MeshContext, a 2-D (colossal, ulysses) DeviceMesh or a "
                     f"(colossal_group, ulysses_group) pair, got {type(mesh).__name__}")


def build_strategy(method: str, mesh=None, *, ulysses_degree: int | None = None) -> ContextParallelStrategy:
    """Return the sync strategy for ``method``; raise ValueError for an illegal combination
    (the catalogue's degree rule, checked again against the built groups' size)."""
    row = catalogue.get_method(method)
    cls = STRATEGY_CLASSES[row.strategy]
    if row.degree == "param":
        catalogue.check_degree(row, None, ulysses_degree)         # present and an int
        colossal, ulysses = _hybrid_groups(mesh, ulysses_degree)
        strategy = cls(colossal, ulysses)
        if strategy.ulysses_degree != ulysses_degree:
            raise ValueError(f"hybrid groups have ulysses size {strategy.ulysses_degree}, but "
                             f"ulysses_degree={ulysses_degree} was requested")
        catalogue.check_degree(row, strategy.cp_size, ulysses_degree)
        return strategy
    catalogue.check_degree(row, None, ulysses_degree)             # "none": no degree at all
    strategy = cls(_cp_group(mesh))
    catalogue.check_degree(row, strategy.cp_size, ulysses_degree)  # "cp": degree == cp_size
    return strategy
