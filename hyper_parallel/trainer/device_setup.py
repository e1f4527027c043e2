"""Per-process device set-up before the process group starts (see :func:`bind_local_device`)."""
from __future__ import annotations

import os

from ..platform.host_memory import configure_host_allocator, reset_host_tensor_peak, track_host_tensors


def bind_local_device(platform) -> None:
    """CUDA/NPU: pin this process to its local device (LOCAL_RANK) before the process group
    starts, so NCCL/HCCL ranks do not all land on device 0. CPU: fix the host allocator's mmap
    threshold (:func:`~hyper_parallel.platform.host_memory.configure_host_allocator`) and count tensor
    storage (:func:`~hyper_parallel.platform.host_memory.track_host_tensors`, the step records'
    ``peak_tensor_gb_per_rank``: the peak since this call, also in a process that ran a trainer before)."""
    configure_host_allocator(platform.device_type)
    if track_host_tensors(platform.device_type):
        reset_host_tensor_peak()
    mod = platform.device_module()
    if mod is not None and hasattr(mod, "set_device"):
        mod.set_device(local_rank())


def local_rank() -> int:
    """This process's LOCAL_RANK (0 outside a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))
