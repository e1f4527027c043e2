"""The buffers a collective hands the backend: freed at ``wait()``, and a point after which the
backend holds none of them.

gloo runs a collective on a worker thread that keeps its ``Work`` (with every tensor the Work
references: the caller's input, the output) until that thread returns to its queue, a moment
after ``wait()`` returned on the caller's thread. So that host memory follows what the program
holds, and not the scheduling of that thread:

- :func:`release_temporaries` frees, once the result is built, the storage of the buffers the
  platform created for a collective (``untyped_storage().resize_(0)``, as FSDP2 frees unsharded
  parameters): the memory goes back at once whoever still references the tensor object;
- it keeps a weak reference to each, so :func:`wait_backend_released` can block until the backend
  has dropped every finished collective that had one (a Work drops all its tensors together):
  after that point no tensor of a finished collective is kept alive by the backend. A collective
  with no platform buffer (``all_reduce``, which returns the buffer the backend reduced in place)
  is not covered.

CPU tensors only: device allocators order frees on streams, and device backends keep no worker
thread between ``wait()`` and the caller. Thread-safe (the chain thread waits on collectives too).
"""
from __future__ import annotations

import threading
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["release_temporaries", "wait_backend_released"]

_LOCK = threading.Lock()
_HELD: list[StorageWeakRef] = []


def release_temporaries(temps, keep: torch.Tensor | None = None) -> None:
    """Free the CPU storage of every tensor in ``temps`` (buffers the platform allocated for one
    finished collective) except one sharing storage with ``keep`` (the result handed back), and
    remember each freed storage until the backend drops it."""
    keep_ptr = None if keep is None else keep.untyped_storage().data_ptr()
    freed = []
    for t in temps:
        if t is None or t.device.type != "cpu":
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() == keep_ptr:
            continue
        freed.append(StorageWeakRef(s))
        s.resize_(0)
    if freed:
        with _LOCK:
            _HELD[:] = [w for w in _HELD if not w.expired()] + freed


def wait_backend_released(timeout_s: float) -> None:
    """Block until the backend has dropped every finished collective's platform buffers (and with
    them the Work and all the tensors it referenced). Local to this process, no collective.
    ``timeout_s`` catches a backend that never lets go (raises TimeoutError); it is not a window
    that decides a result: the wait ends on the condition."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _LOCK:
            _HELD[:] = [w for w in _HELD if not w.expired()]
            left = len(_HELD)
        if not left:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the collective backend still holds {left} finished collective(s) "
                               f"after {timeout_s:.0f} s")
        time.sleep(0.001)
