"""The per-method plan of an async attention (:class:`AsyncPlan`): its collectives on the cached
groups, the sync strategy that checks a call, and for Ulysses / Hybrid the plans per head layout.
Each method builds its own in ``methods/<method>/async_.py::async_plan`` (named by its catalogue
row's ``async_plan``); ``wrappers/async_pipeline.py::make_plan`` resolves the row and calls it.
docs/async_cp.md."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from .methods.ulysses.layout import ulysses_head_layout


@dataclasses.dataclass
class AsyncPlan:
    """One async attention's collectives; a method's ``async_plan(method, strategy_cls, mesh,
    cp_mesh, ulysses_degree)`` returns it (resolving its groups from the cached mesh, never creating one)."""

    method: str
    plans: Optional[dict]    # "q"/"k"/"v"/"out" -> (forward_comm, backward_comm); None: per head layout (build)
    checker: object          # the sync strategy of the method on the same groups (local checks only)
    out_group: object = None  # ulysses group of the output head->seq A2A (Ulysses/Hybrid)
    ulysses_degree: Optional[int] = None
    group: object = None     # cp group (Head-Tail combine)
    build: Optional[Callable] = None    # Ulysses/Hybrid: UlyssesHeadLayout -> plans
    by_heads: dict = dataclasses.field(default_factory=dict)

    def at_heads(self, num_q_heads: int, num_kv_heads: int, who: str) -> tuple:
        """``(plans, layout)`` for a forward with these local (TP-local) heads; ``layout`` is the
        :class:`UlyssesHeadLayout` of the Ulysses group (None for Colossal / Head-Tail). Cached per
        head counts; raises ValueError (no collective) when no exact split exists."""
        if self.build is None:
            return self.plans, None
        key = (num_q_heads, num_kv_heads)
        if key not in self.by_heads:
            u = self.ulysses_degree or self.checker.cp_size
            lay = ulysses_head_layout(num_q_heads, num_kv_heads, u, who=who,
                                      what="ulysses_degree" if self.ulysses_degree else "cp_size (ulysses_degree)")
            self.by_heads[key] = (self.build(lay), lay)
        return self.by_heads[key]


def group_of(cp_mesh):
    """The cp ProcessGroup of ``cp_mesh`` (a 1-D DeviceMesh or the group itself); ValueError when CP is off."""
    if cp_mesh is None:
        raise ValueError("async CP wrappers need an active cp mesh (accelerator.cp_size > 1)")
    return cp_mesh if not hasattr(cp_mesh, "get_group") else cp_mesh.get_group()
