"""Device type and collective backend: the one place that maps hardware to a backend.

cpu -> gloo, cuda -> nccl, npu -> hccl (through ``torch_npu`` when importable).
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib
import os

import torch
import torch.distributed as dist

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class PlatformError(RuntimeError):
    """Raised when the requested device/backend cannot be provided on this machine."""


@dataclasses.dataclass(frozen=True)
class Platform:
    device_type: str
    backend: str

    def device(self, local_rank: int = 0) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, local_rank)

    @property
    def has_streams(self) -> bool:
        return self.device_type in ("cuda", "npu")

    def group_options(self, timeout: datetime.timedelta):
        """Backend options that give a new process group ``timeout`` (for DeviceMesh's
        ``backend_override``), or None where this torch build has no options class for the
        backend (the group then gets torch's default timeout)."""
        cls = None
        if self.backend == "gloo":
            cls = getattr(getattr(dist, "ProcessGroupGloo", None), "_Options", None)
        elif self.backend == "nccl":
            cls = getattr(getattr(dist, "ProcessGroupNCCL", None), "Options", None)
        elif self.backend == "hccl":
            try:
                import torch_npu  # noqa: F401

                cls = getattr(getattr(torch_npu._C._distributed_c10d, "ProcessGroupHCCL", None),
                              "Options", None)
            except (ImportError, AttributeError):
                cls = None
        if cls is None:
            return None
        opts = cls()
        opts._timeout = timeout
        return opts

    def device_module(self):
        """torch.cuda / torch.npu, or None on CPU."""
        if self.device_type == "cpu":
            return None
        return getattr(torch, self.device_type)

    def peak_memory_bytes(self) -> int:
        """This process's peak memory so far: the device allocator's peak on CUDA/NPU
        (``max_memory_allocated``), the resident set's high-water mark on CPU (``ru_maxrss``)."""
        mod = self.device_module()
        if mod is not None:
            return int(mod.max_memory_allocated())
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss) if sys.platform == "darwin" else int(rss) * 1024     # Linux reports KiB

    def peak_tensor_bytes(self) -> int | None:
        """Peak bytes of tensor storage so far: the device allocator's peak on CUDA/NPU (the same as
        :meth:`peak_memory_bytes`), on CPU the counting allocator's peak
        (:func:`~hyper_parallel.platform.host_memory.track_host_tensors`), None where it is not
        installed. Excludes the process, its libraries and free heap pages, as a device's does."""
        mod = self.device_module()
        if mod is not None:
            return int(mod.max_memory_allocated())
        from .host_memory import host_tensor_bytes

        counted = host_tensor_bytes()
        return None if counted is None else counted[1]


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return hasattr(torch, "npu") and torch.npu.is_available()


def detect_device_type() -> str:
    """npu if torch_npu works, else cuda if available, else cpu. ``HYPER_PARALLEL_DEVICE`` overrides."""
    forced = os.environ.get("HYPER_PARALLEL_DEVICE")
    if forced:
        return forced
    if _npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def get_platform(device_type: str | None = None) -> Platform:
    """Resolve the platform for ``device_type`` (auto-detected when None); fails clearly if absent."""
    device_type = device_type or detect_device_type()
    if device_type not in _BACKENDS:
        raise PlatformError(
            f"accelerator.device_type={device_type!r} is not supported; choose one of {sorted(_BACKENDS)}"
        )
    if device_type == "npu" and not _npu_available():
        raise PlatformError(
            "device_type 'npu' requested but torch_npu is not importable or no NPU is visible; "
            "install torch_npu (Ascend) or use device_type 'cpu'/'cuda'"
        )
    if device_type == "cuda" and not torch.cuda.is_available():
        raise PlatformError("device_type 'cuda' requested but torch.cuda.is_available() is False")
    return Platform(device_type=device_type, backend=_BACKENDS[device_type])
