"""Benchmarks that compare sizes of a process group: each size on its own fresh gloo pool."""
from __future__ import annotations


def rows_of(jobs, timeout: float = 900) -> list:
    """``jobs``: ``[(world_size, fn, args)]``; -> every rank's result of every job, in order (each job on
    a new :class:`hyper_parallel.testing.RankPool`, shut down after it)."""
    from hyper_parallel.testing import RankPool

    rows = []
    for world, fn, args in jobs:
        pool = RankPool(world)
        try:
            rows += pool.run(fn, *args, timeout=timeout)
        finally:
            pool.shutdown()
    return rows
