"""Live tensor bytes for memory tests, read after a synchronisation point (never a time window)."""
from __future__ import annotations


def settled_tensor_bytes() -> int:
    """Live CPU tensor bytes (:func:`hyper_parallel.platform.host_memory.host_tensor_bytes`) once
    nothing but the program holds memory: the chain thread has dropped its finished chains
    (:func:`~hyper_parallel.platform.drain_chain_thread`) and the collective backend has dropped
    every finished collective (:func:`~hyper_parallel.platform.release.wait_backend_released`;
    the platform already freed their buffers at ``wait()``). Both are waits on a condition; their
    timeout only catches a hang. Needs tensor accounting on (``track_host_tensors``)."""
    from ..platform import default_timeout, drain_chain_thread
    from ..platform.host_memory import host_tensor_bytes
    from ..platform.release import wait_backend_released

    drain_chain_thread()
    wait_backend_released(default_timeout().total_seconds())
    return host_tensor_bytes()[0]
