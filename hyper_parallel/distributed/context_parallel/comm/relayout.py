"""Move a rank's tokens between the permuted layout of the balanced split and the contiguous one.

Under the balanced split (``meta.perm``) rank r holds slots ``[r*L, (r+1)*L)`` of the permuted row,
i.e. global tokens ``perm[r*L:(r+1)*L]``; in the contiguous layout it holds global tokens
``[r*L, (r+1)*L)``. :class:`Relayout` is that exchange for one rank, computed from ``perm`` alone
(every rank derives the same send / receive counts, no extra collective):

* :meth:`Relayout.to_contiguous` ``x [B|1, L, ...]`` (permuted slots) -> ``[B|1, L, ...]``
  (contiguous chunk): ONE variable-split all-to-all along dim 1 (``AllToAllUneven``: pieces of one
  token), local gathers before and after it;
* :meth:`Relayout.to_permuted` the inverse exchange.

Both are differentiable; the backward of one is the other (the exchange is a bijection of tokens, so
its adjoint is its inverse). Bytes moved per call: the tokens that change rank, at most
``B*L*H*e`` per rank and direction. Memory O(L). docs/strategies/load_balance_packed.md, "Token mixers".
"""
from __future__ import annotations

import torch

from .primitives import AllToAllUneven, CPCollectiveError

__all__ = ["Relayout"]

_LAST: dict = {}          # the last step's Relayout (key holds the perm tensor itself, compared with ``is``)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The one host -> device copy of an index tensor (a seam: tests count its calls)."""
    return t.to(device)


class Relayout:
    """The exchange of rank ``rank`` of ``cp_size`` for the permutation ``perm [S]`` (slot i of the
    permuted row holds global token ``perm[i]``); ``group``: the CP group (None = one rank)."""

    def __init__(self, perm: torch.Tensor, rank: int, cp_size: int, group, tag: str = "cp.relayout"):
        perm = perm.detach().to("cpu", torch.int64)
        S = perm.numel()
        if perm.dim() != 1 or S % cp_size or not torch.equal(torch.sort(perm).values, torch.arange(S)):
            raise CPCollectiveError(f"Relayout: perm must be a permutation of range(S) with S % cp_size == 0, got "
                                    f"shape {tuple(perm.shape)} for cp_size={cp_size}")
        L = S // cp_size
        dest = perm // L                                         # contiguous owner of every slot's token
        mine = dest[rank * L:(rank + 1) * L]
        self.send_idx = torch.argsort(mine, stable=True)         # local slots, grouped by destination rank
        self.send_counts = torch.bincount(mine, minlength=cp_size).tolist()
        slots = (dest == rank).nonzero(as_tuple=True)[0]          # ascending: by source rank, then slot order
        self.recv_counts = torch.bincount(slots // L, minlength=cp_size).tolist()
        self.recv_pos = perm[slots] - rank * L                   # contiguous offset of every received token
        self.recv_inv = torch.argsort(self.recv_pos)
        self.send_inv = torch.argsort(self.send_idx)
        self.L, self.group, self.tag = L, group, tag
        self._on: dict = {}          # device -> (send_idx, recv_inv, recv_pos, send_inv) there

    def _indices(self, device: torch.device) -> tuple:
        """The four index tensors on ``device``, copied there once per Relayout (= once per step and
        device: :meth:`cached` keeps one Relayout per step's ``perm``)."""
        out = self._on.get(device)
        if out is None:
            out = self._on[device] = tuple(_to_device(t, device) for t in (self.send_idx, self.recv_inv,
                                                                             self.recv_pos, self.send_inv))
        return out

    @classmethod
    def cached(cls, perm: torch.Tensor, rank: int, cp_size: int, group, tag: str = "cp.relayout") -> "Relayout":
        """:class:`Relayout` for this step's ``perm`` (the same tensor object for every mixer layer of a
        step, and in recomputation): built once per step, reused by the next layers."""
        key = (perm, rank, cp_size, group, tag)
        last = _LAST.get("key")
        if last is None or last[0] is not perm or last[1:] != key[1:]:
            _LAST["key"], _LAST["value"] = key, cls(perm, rank, cp_size, group, tag)
        return _LAST["value"]

    def _check(self, x: torch.Tensor, what: str) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] != self.L:
            raise CPCollectiveError(f"Relayout.{what}: expected a [B, {self.L}, ...] tensor, got "
                                    f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")

    def to_contiguous(self, x: torch.Tensor) -> torch.Tensor:
        """Permuted slots -> this rank's contiguous chunk (dim 1)."""
        self._check(x, "to_contiguous")
        send_idx, recv_inv, _, _ = self._indices(x.device)
        send = x.index_select(1, send_idx)
        recv = AllToAllUneven.apply(send.contiguous(), self.group, self.send_counts, self.recv_counts, 1,
                                    self.tag)
        return recv.index_select(1, recv_inv)

    def to_permuted(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous chunk -> its permuted slots (the inverse of :meth:`to_contiguous`)."""
        self._check(y, "to_permuted")
        _, _, recv_pos, send_inv = self._indices(y.device)
        send = y.index_select(1, recv_pos)
        recv = AllToAllUneven.apply(send.contiguous(), self.group, self.recv_counts, self.send_counts, 1,
                                    self.tag + ".back")
        return recv.index_select(1, send_inv)
