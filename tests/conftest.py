"""Session-wide fixtures: warm multi-rank pools (one spawn per world size per session)."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from hyper_parallel.testing import RankPool  # noqa: E402

_POOLS: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def ranks():
    """``ranks(n)`` -> a warm :class:`RankPool` of n gloo processes (re-spawned only if torn down)."""

    def get(n: int) -> RankPool:
        pool = _POOLS.get(n)
        if pool is None:
            pool = _POOLS[n] = RankPool(n)
        return pool

    yield get
    for pool in _POOLS.values():
        pool.shutdown()
    _POOLS.clear()
