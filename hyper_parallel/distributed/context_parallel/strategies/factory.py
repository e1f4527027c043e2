"""build_strategy: pick one sync strategy for a wrapper from its fixed CP method.

``method`` is the wrapper's method name (registry METHODS): "colossal" (alias "all_gather"),
"ulysses", "hybrid", "load_balance" (alias "head_tail"). ``mesh`` may be a MeshContext
(preferred: groups come from its cached sub-meshes), a 1-D DeviceMesh or ProcessGroup (the CP
group), a 2-D (colossal, ulysses) DeviceMesh or a ``(colossal_group, ulysses_group)`` pair for
Hybrid, or None (cp 1). No process group is ever created here.
"""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from .all_gather import AllGatherStrategy
from .base import ContextParallelStrategy
from .head_tail import HeadTailStrategy
from .hybrid import HybridStrategy
from .ulysses import UlyssesStrategy

_ALIASES = {"colossal": "colossal", "all_gather": "colossal", "ulysses": "ulysses", "hybrid": "hybrid",
            "load_balance": "load_balance", "head_tail": "load_balance"}


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
    """Return the sync strategy for ``method``; raise ValueError for an illegal combination."""
    key = _ALIASES.get(method)
    if key is None:
        raise ValueError(f"unknown CP method {method!r}; expected one of {sorted(_ALIASES)}")
    if key in ("colossal", "load_balance"):
        if ulysses_degree not in (None, 1):
            what = "Head-Tail load balance" if key == "load_balance" else "colossal (AllGather)"
            raise ValueError(
                f"{what} CP takes no ulysses_degree (got ulysses_degree={ulysses_degree}): Ulysses or Hybrid "
                "combined with Head-Tail is not supported; pick one wrapper per attention"
            )
        cls = HeadTailStrategy if key == "load_balance" else AllGatherStrategy
        return cls(_cp_group(mesh))
    if key == "ulysses":
        strategy = UlyssesStrategy(_cp_group(mesh))
        if ulysses_degree is not None and ulysses_degree != strategy.cp_size:
            raise ValueError(f"pure Ulysses uses ulysses_degree == cp_size={strategy.cp_size}, got "
                             f"ulysses_degree={ulysses_degree}; use method='hybrid' for a smaller degree")
        return strategy
    if ulysses_degree is None:
        raise ValueError("method='hybrid' needs ulysses_degree (1 < ulysses_degree < cp_size)")
    colossal, ulysses = _hybrid_groups(mesh, ulysses_degree)
    strategy = HybridStrategy(colossal, ulysses)
    if strategy.ulysses_degree != ulysses_degree:
        raise ValueError(f"hybrid groups have ulysses size {strategy.ulysses_degree}, but "
                         f"ulysses_degree={ulysses_degree} was requested")
    return strategy
