"""Session-wide fixtures: warm multi-rank pools (one spawn per world size per session)."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from hyper_parallel.testing import RankPool  # noqa: E402
from hyper_parallel.testing.multirank import GROUP_LIMIT  # noqa: E402

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


@pytest.fixture(autouse=True)
def _free_idle_groups():
    """After each test, warm ranks (and this process) holding many idle process groups free them: an
    idle gloo group's transport thread wakes every 10 ms, and hundreds of them in warm ranks took most
    of the two cores by the end of the suite (hyper_parallel.platform.release_subgroups)."""
    yield
    for pool in _POOLS.values():
        pool.release_groups()
    from hyper_parallel.platform import release_subgroups

    release_subgroups(GROUP_LIMIT)


#: Session fixtures of launched runs: every file that uses one runs in one xdist group (one launch).
_SHARED_LAUNCHES = ("cli_run", "cli_saved")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Groups for ``pytest -n N --dist loadgroup`` (scripts/test.sh): a test file is one group, so its
    module fixtures (a trained checkpoint, the concurrent fault runs) run once on one worker; the
    files that read a shared launched run (``cli_run``) form one group. Without xdist the marks
    change nothing."""
    def path(item):
        return item.nodeid.split("::", 1)[0]

    shared = {path(i) for i in items if any(f in i.fixturenames for f in _SHARED_LAUNCHES)}
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("cli_run" if path(item) in shared else path(item)))
