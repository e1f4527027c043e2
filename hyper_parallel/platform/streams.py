"""Side streams and events for overlapping communication with compute.

On CUDA/NPU these are the device's real streams/events; on CPU they are no-ops so the same
strategy code runs everywhere (gloo collectives run on their own threads on CPU anyway).
"""
from __future__ import annotations

import contextlib

import torch

from .device import get_platform


class _NullEvent:
    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None


def new_event(device_type: str | None = None):
    plat = get_platform(device_type)
    mod = plat.device_module()
    return mod.Event() if mod is not None else _NullEvent()


_COMM_STREAMS: dict = {}


def comm_stream(device_type: str | None = None):
    """A cached side stream for collectives (None on CPU)."""
    plat = get_platform(device_type)
    mod = plat.device_module()
    if mod is None:
        return None
    key = (plat.device_type, mod.current_device())
    if key not in _COMM_STREAMS:
        _COMM_STREAMS[key] = mod.Stream()
    return _COMM_STREAMS[key]


@contextlib.contextmanager
def stream_context(stream):
    """Run the body on ``stream`` (no-op when stream is None)."""
    if stream is None:
        yield
        return
    mod = getattr(torch, stream.device.type)
    with mod.stream(stream):
        yield


def record_stream(tensor: torch.Tensor, stream) -> None:
    if stream is not None and tensor.device.type != "cpu":
        tensor.record_stream(stream)
