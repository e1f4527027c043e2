"""Live tensor bytes for memory tests, read once the process's tensor count has settled."""
from __future__ import annotations

import time


def settled_tensor_bytes(max_reads: int = 40, interval_s: float = 0.005, stable: int = 8) -> int:
    """The least live CPU tensor bytes (:func:`hyper_parallel.platform.host_memory.host_tensor_bytes`)
    once the chain thread has dropped its finished chains (:func:`~hyper_parallel.platform.drain_chain_thread`),
    over up to ``max_reads`` reads ``interval_s`` apart, stopping once ``stable`` reads in a row agree:
    gloo may free a finished collective's buffer a moment after ``wait()`` returns, and such a buffer
    is not what a test of held memory means. ``max_reads`` and ``stable`` are multiplied by
    :func:`~hyper_parallel.testing.multirank.timeout_scale` (a loaded host schedules that free later).
    Needs tensor accounting on (``track_host_tensors``)."""
    from ..platform import drain_chain_thread
    from ..platform.host_memory import host_tensor_bytes
    from .multirank import timeout_scale

    drain_chain_thread()
    scale = timeout_scale()
    max_reads, stable = int(max_reads * scale), int(stable * scale)
    reads: list[int] = []
    for _ in range(max_reads):
        reads.append(host_tensor_bytes()[0])
        if len(reads) >= stable and len(set(reads[-stable:])) == 1:
            break
        time.sleep(interval_s)
    return min(reads)
