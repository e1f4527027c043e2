"""Copies between a device tensor and host memory on a side stream (activation offload).

:class:`HostCopier` is the one place that knows how: on CUDA/NPU the host buffer is pinned, both
directions run ``non_blocking`` on one cached copy stream (so a host-to-device copy of a buffer is
ordered after the device-to-host copy that filled it) and completion is an event the compute
stream waits on; on CPU the device is the host, there is no stream, and both copies are ordinary
synchronous copies into a separate buffer — the same calls, so a CPU run exercises the same path.

Contracts:

* :meth:`HostCopier.to_host` returns ``(buffer, event)``: ``buffer`` has ``t``'s shape, dtype and
  strides (``empty_like``: a dense tensor keeps its strides) and holds ``t``'s values once
  ``event`` completed; ``t``'s memory is not reused by the allocator before that (``record_stream``).
* :meth:`HostCopier.to_device` returns ``(tensor, event)``: a new device tensor equal to
  ``buffer`` once ``event`` completed; :meth:`HostCopier.ready` makes the compute stream wait for
  such an event before the tensor is used there.
"""
from __future__ import annotations

import torch

from .device import Platform
from .streams import new_event, record_stream, stream_context

__all__ = ["HostCopier"]


class HostCopier:
    """Host <-> device copies of ``platform``'s tensors (module doc)."""

    def __init__(self, platform: Platform):
        self.platform = platform
        self._stream = None

    @property
    def device_type(self) -> str:
        return self.platform.device_type

    def _copy_stream(self):
        """The cached side stream for copies (None on CPU)."""
        mod = self.platform.device_module()
        if mod is None:
            return None
        if self._stream is None:
            self._stream = mod.Stream()
        return self._stream

    def _compute_stream(self):
        mod = self.platform.device_module()
        return None if mod is None else mod.current_stream()

    def to_host(self, t: torch.Tensor):
        """Start copying ``t`` into a new (pinned where the device has streams) host buffer."""
        side, main = self._copy_stream(), self._compute_stream()
        buf = torch.empty_like(t, device="cpu", pin_memory=self.platform.has_streams)
        if side is not None:
            side.wait_stream(main)           # t is produced on the compute stream
            record_stream(t, side)           # keep t's memory until the copy has read it
        with stream_context(side):
            buf.copy_(t, non_blocking=side is not None)
            event = new_event(self.device_type)
            event.record(side)
        return buf, event

    def to_device(self, buf: torch.Tensor, device: torch.device):
        """Start copying host ``buf`` into a new tensor on ``device`` (after its own ``to_host``)."""
        side, main = self._copy_stream(), self._compute_stream()
        out = torch.empty_like(buf, device=device)      # allocated on the compute stream
        if side is not None:
            side.wait_stream(main)
            record_stream(out, side)
        with stream_context(side):
            out.copy_(buf, non_blocking=side is not None)
            event = new_event(self.device_type)
            event.record(side)
        return out, event

    def ready(self, event) -> None:
        """The compute stream waits for ``event`` (a copy of :meth:`to_host` / :meth:`to_device`)."""
        event.wait(self._compute_stream())
