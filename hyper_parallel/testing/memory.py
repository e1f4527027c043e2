"""Live tensor bytes for memory tests, read once the process's tensor count has settled."""
from __future__ import annotations

import time


def settled_tensor_bytes(max_reads: int = 40, interval_s: float = 0.005, stable: int = 8) -> int:
    """The least live CPU tensor bytes (:func:`hyper_parallel.platform.host_memory.host_tensor_bytes`)
    over up to ``max_reads`` reads ``interval_s`` apart, stopping once ``stable`` reads in a row agree:
    gloo may free a finished collective's buffer a moment after ``wait()`` returns, and such a buffer
    is not what a test of held memory means. Needs tensor accounting on (``track_host_tensors``)."""
    from ..platform.host_memory import host_tensor_bytes

    reads: list[int] = []
    for _ in range(max_reads):
        reads.append(host_tensor_bytes()[0])
        if len(reads) >= stable and len(set(reads[-stable:])) == 1:
            break
        time.sleep(interval_s)
    return min(reads)
