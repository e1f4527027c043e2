"""What one declared layer of a CP method costs per rank: the interface each catalogue row names
(``CPMethod.cost``) and ``hyper-train --explain`` reads (docs/trainer.md "--explain").

A :class:`CostModel` answers for one layer at one config (:class:`LayerShape`): the bytes it sends
per row, forward and backward, per exchange (:meth:`~CostModel.comm`); the bytes it keeps for
backward beyond what autograd's own saves count (:meth:`~CostModel.kept_for_backward`); the bytes
it holds only while it runs (:meth:`~CostModel.in_flight`); and what it saves beyond the module's
own forward (:meth:`~CostModel.extra_saved`). The base class is a custom wrapper's: nothing known
but the full gathered K/V while it runs. Pure arithmetic on shapes, no collective; the one probe that
runs tensors, :func:`saved_bytes`, runs them on whatever device its caller gives (meta for ``--explain``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

__all__ = ["LayerShape", "CostModel", "relayout_bytes", "saved_bytes"]


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One declared layer at one config. ``S``: the padded global row length; ``hq`` / ``hk``:
    query / KV heads on this rank's TP shard; ``d``: head dim; ``H``: hidden size; ``elem``: bytes
    per element; ``B``: rows per micro-batch; ``module`` / ``params``: the declared module and the
    declaration's parameters; ``recomputed``: activation checkpointing re-runs the forward (its
    exchanges included) before backward; ``permuted``: the batch is on the balanced split's
    permutation (token mixers move to the contiguous layout and back)."""

    S: int
    cp: int
    hq: int
    hk: int
    d: int
    H: int = 0
    elem: int = 4
    B: int = 1
    module: Any = None
    params: Mapping = dataclasses.field(default_factory=dict)
    recomputed: bool = False
    permuted: bool = False

    @property
    def local(self) -> float:
        """Tokens per rank: ``S / cp``."""
        return self.S / self.cp


class CostModel:
    """A custom wrapper's cost: exchanges not known ({} prints "not modelled"), the full gathered
    K/V ``[B, Hk, S, D]`` x 2 while the layer runs, nothing kept or saved beyond autograd's."""

    def comm(self, x: LayerShape) -> dict:
        """Bytes one rank sends for this layer and one row: ``{"fwd ...": bytes, "bwd ...": bytes}``."""
        return {}

    def kept_for_backward(self, x: LayerShape) -> float:
        """Bytes the layer keeps from forward to backward outside autograd's saved tensors."""
        return 0.0

    def in_flight(self, x: LayerShape) -> float:
        """Bytes the layer holds only while it runs (the largest over the layers counts once)."""
        return 2 * x.S * x.hk * x.d * x.elem * x.B

    def extra_saved(self, x: LayerShape) -> float:
        """Bytes saved beyond the module's own forward on the same tokens (the largest rank)."""
        return 0.0


def relayout_bytes(x: LayerShape) -> dict:
    """A token mixer next to the balanced split: its hidden states move to the contiguous layout and
    its output back (one all-to-all each; a rank sends the tokens that change rank, (cp-1)/cp of
    its ``S/cp`` on average), and the same two exchanges in backward."""
    one = (x.cp - 1) / x.cp * x.local * x.H * x.elem
    return {"fwd relayout All-to-All": 2 * one, "bwd relayout All-to-All": 2 * one}


def saved_bytes(run, exclude: frozenset = frozenset()) -> int:
    """Bytes of the storages autograd saves in ``run()`` (usually on meta tensors) that its graph still
    holds when it returns, each storage once; ``exclude``: storage ids (``untyped_storage()._cdata``) not
    to count (the parameters). Keyed by storage and read while ``run``'s result is alive: never by the
    id of a Python wrapper (``t._base`` may be a fresh one whose id a later one reuses), and a branch
    ``run`` computed and dropped (its saves freed with it) does not count."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    saved: list = []

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in exclude:
            saved.append((StorageWeakRef(st), st._cdata, st.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    held = {key: n for ref, key, n in saved if not ref.expired()}
    del out
    return sum(held.values())
