"""The balanced split's async plans: Colossal's (or Hybrid's) exchanges and attention loops on the
permuted row (keys at ``meta.k_index`` = ``meta.perm``, queries at ``meta.q_index``), plus the
check that the batch is on that permutation. docs/async_cp.md."""
from __future__ import annotations

import dataclasses


def _permuted(plan):
    return dataclasses.replace(plan, check_meta=lambda meta, owner: plan.checker.check_permuted(meta))


def async_plan(method: str, strategy_cls, mesh, cp_mesh, ulysses_degree=None):
    """Colossal on the permuted row."""
    from ..colossal.async_ import async_plan as colossal

    return _permuted(colossal(method, strategy_cls, mesh, cp_mesh, ulysses_degree))


def hybrid_async_plan(method: str, strategy_cls, mesh, cp_mesh, ulysses_degree=None):
    """Hybrid on the permuted row."""
    from ..hybrid.async_ import async_plan as hybrid

    return _permuted(hybrid(method, strategy_cls, mesh, cp_mesh, ulysses_degree))
