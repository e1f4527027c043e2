"""Host (CPU) allocator policy of a training rank: glibc's mmap threshold.

PyTorch's CPU tensors come from ``malloc``. glibc serves a block of at least ``M_MMAP_THRESHOLD``
bytes with its own ``mmap`` (returned to the OS by ``free``), smaller ones from the heap (kept by
the process after ``free`` unless the top of the heap can be trimmed). The threshold starts at
128 KiB but is *dynamic*: every free of an mmapped block raises it to that block's size (up to
32 MiB on 64-bit). After the first training step has freed its large activations, most of them
come from the heap instead, where freed blocks of different sizes fragment it and the resident
set of step 2 grows above step 1 — by about a third at 32k tokens on a CP=4 rank (measured in
``benchmarks/memory_scaling.py``; see docs/performance.md).

:func:`configure_host_allocator` fixes the threshold (``mallopt(M_MMAP_THRESHOLD, n)``, which also
switches off the dynamic adjustment), so every large tensor buffer is mmapped and its pages go
back to the OS when it is freed: the peak resident set follows the live tensors.

Applied on CPU ranks only (device allocators have their own caches), on glibc only. Environment:
``HYPER_PARALLEL_MMAP_THRESHOLD`` = bytes (default 131072), ``0`` leaves glibc's dynamic policy;
a ``MALLOC_MMAP_THRESHOLD_`` set by the user is glibc's own switch and is left alone.

**Tensor accounting.** The resident set also holds the Python process, its libraries and free heap
pages, which a CUDA/NPU allocator's ``max_memory_allocated`` never counts. :func:`track_host_tensors`
installs the C++ counting CPU allocator (``csrc/memory/host_tensor_accounting.cpp``): it forwards every
CPU tensor allocation to the default allocator and keeps the live and peak bytes of tensor storage,
so a CPU rank can report the figure a device allocator would. Environment:
``HYPER_PARALLEL_TENSOR_ACCOUNTING=0`` leaves the default allocator alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform as _platform

__all__ = ["DEFAULT_MMAP_THRESHOLD", "configure_host_allocator", "track_host_tensors", "host_tensor_bytes",
           "reset_host_tensor_peak"]

DEFAULT_MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3          # glibc <malloc.h>
_ENV = "HYPER_PARALLEL_MMAP_THRESHOLD"
_applied: int | None = None


def configure_host_allocator(device_type: str) -> int | None:
    """Fix glibc's mmap threshold for a CPU rank; returns the threshold now in force (bytes), or
    None where nothing was changed (not CPU, not glibc, disabled by the environment, or the user
    set ``MALLOC_MMAP_THRESHOLD_``). Idempotent; local to this process, no collective.

    Raises ValueError when ``HYPER_PARALLEL_MMAP_THRESHOLD`` is not a non-negative integer.
    """
    global _applied
    if device_type != "cpu" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    raw = os.environ.get(_ENV, str(DEFAULT_MMAP_THRESHOLD)).strip()
    try:
        threshold = int(raw)
    except ValueError:
        threshold = -1
    if threshold < 0:
        raise ValueError(f"{_ENV}={raw!r} is not a number of bytes >= 0 (0 keeps glibc's dynamic "
                         f"mmap threshold; default {DEFAULT_MMAP_THRESHOLD})")
    if threshold == 0 or _platform.libc_ver()[0] != "glibc":
        return None
    if _applied == threshold:
        return threshold
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)) != 1:
        return None     # glibc refuses values above its maximum (32 MiB): keep its policy
    _applied = threshold
    return threshold


_ACCOUNTING_ENV = "HYPER_PARALLEL_TENSOR_ACCOUNTING"


def _accounting_off() -> bool:
    return os.environ.get(_ACCOUNTING_ENV, "1").strip() == "0"


def _ops():
    """torch.ops.hyper_parallel with the accounting ops, or None (no extension, or one built before
    they existed: rebuild with ``pip install --no-build-isolation -e .``)."""
    try:
        from hyper_parallel import _C  # noqa: F401  (registers torch.ops.hyper_parallel.*)
        import torch

        ops = torch.ops.hyper_parallel
        ops.host_tensor_bytes  # noqa: B018  (raises AttributeError on a stale build)
    except (ImportError, AttributeError, RuntimeError):
        return None
    return ops


def track_host_tensors(device_type: str) -> bool:
    """Install the counting CPU allocator on a CPU rank (before the model is built, so its weights
    count); returns whether it is in force. Not CPU, ``HYPER_PARALLEL_TENSOR_ACCOUNTING=0``, no C++
    extension, or another allocator without a raw deleter in place: nothing changes, False.
    Idempotent; local to this process, no collective. Blocks allocated before the call are never
    counted."""
    if device_type != "cpu" or _accounting_off():
        return False
    ops = _ops()
    return bool(ops is not None and ops.host_tensor_accounting(True))


def host_tensor_bytes() -> tuple[int, int] | None:
    """(live, peak) bytes of CPU tensor storage allocated since :func:`track_host_tensors`, or None
    when the accounting is not in force."""
    if _accounting_off():
        return None
    ops = _ops()
    if ops is None or not ops.host_tensor_accounting_enabled():
        return None
    live, peak = ops.host_tensor_bytes()
    return int(live), int(peak)


def reset_host_tensor_peak() -> None:
    """Lower the recorded peak to the live bytes now (a no-op without the accounting)."""
    ops = _ops()
    if ops is not None:
        ops.host_tensor_reset_peak()
