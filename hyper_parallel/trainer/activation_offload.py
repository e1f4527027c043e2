"""Activation offload (``schedule.activation_offload``): the checkpointed activations in host memory.

With activation checkpointing every decoder layer keeps, from its forward to its backward, only
the tensors its checkpoint saves at the boundary: the layer's positional tensor inputs (the
hidden states; ``torch.utils.checkpoint`` non-reentrant saves them as saved tensors *before* it
installs its own hooks, keyword arguments such as the rotary ``position_embeddings`` stay in its
closure and are shared by all layers). :func:`install_activation_offload` puts a
``torch.autograd.graph.saved_tensors_hooks`` context around each layer's checkpoint call, so
exactly those tensors pass through :class:`ActivationOffloader`:

* forward (pack): the tensor is copied into a new host buffer (pinned, on the copy stream of
  :class:`~hyper_parallel.platform.host_copy.HostCopier`) and the device tensor is released;
* backward (unpack, when layer ``i`` starts its recomputation): its tensors come back to the
  device (already prefetched, or copied now), and the copies of layer ``i - 1`` — the next one
  backward reaches — start on the copy stream, overlapping layer ``i``'s recompute and backward.

Exact by construction: the values are copied, never converted (same dtype, shape and strides).
On CPU the device is the host: the same code copies into a separate host buffer and back, so a
CPU run exercises packing, prefetch and unpacking (and proves the losses and gradients bit-equal).
Parameters (leaves that require grad) and tensors on another device are kept as they are.

Refused (:func:`check_activation_offload`): without ``schedule.activation_checkpointing`` (there is
no checkpoint boundary: every saved tensor of the layer would cross the host link) and with
``tp_size > 1`` (the layer inputs are DTensors; not supported yet). Local only: no collective.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch
import torch.nn as nn

from ..distributed.errors import CPConfigError
from ..distributed.tensor_parallel import find_decoder_layers
from ..platform.device import Platform
from ..platform.host_copy import HostCopier

__all__ = ["ActivationOffloader", "OffloadStats", "check_activation_offload", "install_activation_offload"]

FIELD = "schedule.activation_offload"


def check_activation_offload(schedule, tp_size: int = 1) -> None:
    """Raise the config error of ``schedule.activation_offload`` where it cannot work (module doc)."""
    if not schedule.activation_offload:
        return
    if not schedule.activation_checkpointing:
        raise CPConfigError(FIELD, "offloads the activations saved at activation-checkpoint boundaries, but "
                            "schedule.activation_checkpointing is false",
                            fix="set schedule.activation_checkpointing: true, or activation_offload: false")
    if tp_size > 1:
        raise CPConfigError(FIELD, f"not supported with tensor parallelism (accelerator.tp_size={tp_size})",
                            fix="set schedule.activation_offload: false, or tp_size: 1")


@dataclasses.dataclass
class OffloadStats:
    """Counters since construction: tensors (and bytes) copied to host, brought back by a
    prefetch or on demand, and kept as they are (parameters, other devices)."""
    packed: int = 0
    packed_bytes: int = 0
    prefetched: int = 0
    fetched_on_demand: int = 0
    kept: int = 0


class _Group:
    """The tensors one layer's forward saved; holds its entries weakly (autograd owns them)."""

    def __init__(self, index: int):
        self.index = index
        self.entries: list[weakref.ref] = []

    def live(self):
        return [e for e in (r() for r in self.entries) if e is not None]


class _Packed:
    """One offloaded tensor: its host buffer, the device it came from, and its device copy while
    fetched and not yet handed to autograd."""

    __slots__ = ("group", "host", "target", "fetched", "fetched_event", "handed", "__weakref__")

    def __init__(self, group: _Group, host: torch.Tensor, target: torch.device):
        self.group, self.host, self.target = group, host, target
        self.fetched, self.fetched_event, self.handed = None, None, False


class ActivationOffloader:
    """Saved-tensor hooks that keep each layer's saved tensors in host memory (module doc)."""

    def __init__(self, platform: Platform):
        self.copier = HostCopier(platform)
        self.device_type = platform.device_type
        self.stats = OffloadStats()
        self._groups: dict[int, weakref.ref] = {}   # layer index -> its latest forward's group

    @contextlib.contextmanager
    def layer(self, index: int):
        """Offload what is saved in the body as layer ``index``'s group."""
        group = _Group(index)
        self._groups[index] = weakref.ref(group)

        def pack(t: torch.Tensor):
            return self._pack(group, t)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _pack(self, group: _Group, t: torch.Tensor):
        if type(t) is not torch.Tensor or t.device.type != self.device_type or (t.requires_grad and t.is_leaf):
            self.stats.kept += 1
            return t
        host, _ = self.copier.to_host(t)     # a later to_device of it is ordered after this copy
        entry = _Packed(group, host, t.device)
        group.entries.append(weakref.ref(entry))
        self.stats.packed += 1
        self.stats.packed_bytes += t.numel() * t.element_size()
        return entry

    def _unpack(self, entry):
        if not isinstance(entry, _Packed):
            return entry
        if entry.fetched is not None:
            self.stats.prefetched += 1
        else:
            self._fetch(entry)
            self.stats.fetched_on_demand += 1
        out, event = entry.fetched, entry.fetched_event
        entry.fetched, entry.fetched_event, entry.handed = None, None, True   # autograd owns it now
        self.copier.ready(event)
        self._prefetch(entry.group.index - 1)
        return out

    def _fetch(self, entry: _Packed) -> None:
        entry.fetched, entry.fetched_event = self.copier.to_device(entry.host, entry.target)

    def _prefetch(self, index: int) -> None:
        """Start bringing back layer ``index``'s tensors (those not fetched or handed over yet)."""
        ref = self._groups.get(index)
        group = ref() if ref is not None else None
        if group is None:
            return
        for entry in group.live():
            if entry.fetched is None and not entry.handed:
                self._fetch(entry)


def install_activation_offload(model: nn.Module, platform: Platform) -> list[str]:
    """Put each activation-checkpointed decoder layer's checkpoint call inside an offload context
    of one :class:`ActivationOffloader` (attached as ``model._hp_activation_offload``); returns the
    layer names. Two ways a layer is checkpointed: transformers' gradient checkpointing (the
    layer's ``_gradient_checkpointing_func`` is wrapped) or a checkpointing ``forward`` installed
    on the layer (the sharding applier's; that forward is wrapped). Raises CPConfigError when no
    decoder layer is found."""
    layers = list(find_decoder_layers(model))
    if not layers:
        raise CPConfigError(FIELD, f"no decoder layers found in {type(model).__name__}",
                            fix="set schedule.activation_offload: false")
    offloader = ActivationOffloader(platform)
    for index, name in enumerate(layers):
        layer = model.get_submodule(name)
        if getattr(layer, "gradient_checkpointing", False) and callable(getattr(layer, "_gradient_checkpointing_func",
                                                                                 None)):
            layer._gradient_checkpointing_func = _wrapped(layer._gradient_checkpointing_func, offloader, index)
        else:
            layer.forward = _wrapped(layer.forward, offloader, index)
    model.__dict__["_hp_activation_offload"] = offloader
    return layers


def _wrapped(fn, offloader: ActivationOffloader, index: int):
    def call(*args, **kwargs):
        with offloader.layer(index):
            return fn(*args, **kwargs)

    call.__wrapped__ = fn
    return call
