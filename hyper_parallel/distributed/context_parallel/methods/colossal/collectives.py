"""Colossal collectives: the K/V AllGather (bwd ReduceScatter), the sliding-window gather of only
the visible chunks, and their no-grad re-runs for :func:`.regather.regather_saved_kv`.

  flex_cp_allgather(k, v, cp_dim, cp_mesh)      [.., S/C, ..] -> [.., S, ..]   bwd: ReduceScatter(sum)
  window_chunk_ranges(world, local_len, window, causal) -> [(lo_r, hi_r)] per rank (no comm)
  flex_cp_window_gather(k, v, cp_dim, cp_mesh, ranges)   rank r receives chunks lo_r..hi_r only
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..... import platform as P
from ...comm import CPCollectiveError, KVAllGather, check_dim, group_desc, resolve_group

__all__ = ["flex_cp_allgather", "flex_cp_window_gather", "regather_allgather", "regather_window_gather",
           "window_chunk_ranges"]


def _check_kv_pair(k: torch.Tensor, v: torch.Tensor, cp_dim: int, fn: str) -> int:
    """The normalized ``cp_dim`` of a K/V pair that agrees in shape up to it (v's head dim may differ)."""
    dk = check_dim(k, cp_dim, "k", fn)
    dv = check_dim(v, cp_dim, "v", fn)
    if k.dim() != v.dim() or dk != dv or k.shape[:dk + 1] != v.shape[:dv + 1]:
        raise CPCollectiveError(
            f"{fn}: k {tuple(k.shape)} and v {tuple(v.shape)} must agree up to cp_dim {cp_dim}"
        )
    return dk


def regather_allgather(cp_dim: int, cp_mesh):
    """The no-grad re-run of :func:`flex_cp_allgather` for :func:`regather_saved_kv`."""
    group = resolve_group(cp_mesh)
    return lambda k, v: KVAllGather.gather(k, v, group, cp_dim % k.dim(), tag="cp.allgather.regather")


def regather_window_gather(cp_dim: int, cp_mesh, ranges: Sequence[tuple[int, int]]):
    """The no-grad re-run of :func:`flex_cp_window_gather` (same ranges) for :func:`regather_saved_kv`."""
    group = resolve_group(cp_mesh)
    send, recv = _window_counts([tuple(int(x) for x in rg) for rg in ranges], P.group_rank(group))
    return lambda k, v: _KVWindowGather.gather(k, v, group, cp_dim % k.dim(), send, recv,
                                               tag="cp.window_gather.regather")


def flex_cp_allgather(k: torch.Tensor, v: torch.Tensor, cp_dim: int, cp_mesh):
    """Gather the local K/V sequence shards of the CP group into the global sequence.

    ``k`` ``[.., S/C, ..]`` and ``v`` (same shape except possibly the last dim) are this rank's
    contiguous chunk along ``cp_dim``; returns ``(k_global, v_global)`` with ``cp_dim`` of size
    S in group-rank order. Backward: ReduceScatter(sum) — every rank's partial dK/dV (from its
    own queries) is summed and each rank keeps the gradient of its own chunk.
    ``cp_mesh``: 1-D DeviceMesh, ProcessGroup, or None (identity, no collective).
    """
    fn = "flex_cp_allgather"
    group = resolve_group(cp_mesh)
    dk = _check_kv_pair(k, v, cp_dim, fn)
    if P.group_size(group) == 1:
        return k, v
    return KVAllGather.apply(k, v, group, dk)


def window_chunk_ranges(world: int, local_len: int, window: int, causal: bool = True) -> list[tuple[int, int]]:
    """The contiguous chunk range ``(lo_r, hi_r)`` (inclusive) each rank's queries can see.

    Contiguous layout: rank r holds global indices ``[r*L, (r+1)*L)`` (``L = local_len``). With
    a left sliding window ``w`` (key j visible to query i only if ``i - w < j``; transformers'
    ``sliding_window``), the earliest key any query of chunk r sees is ``r*L - w + 1``, so
    ``lo_r = max(0, r - ceil((w - 1) / L))``; ``hi_r = r`` when ``causal`` (keys after the last
    query are invisible), else ``world - 1`` (the window is left-only). Pure arithmetic on
    values every rank shares (no communication); docs/padding are not used to trim further.
    """
    for name, val in (("world", world), ("local_len", local_len), ("window", window)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise CPCollectiveError(f"window_chunk_ranges: {name} must be an int >= 1, got {val!r}")
    back = -(-(window - 1) // local_len)          # ceil((w - 1) / L): previous chunks reached
    return [(max(0, r - back), r if causal else world - 1) for r in range(world)]


def _window_counts(ranges, me: int):
    world = len(ranges)
    send = [1 if lo <= me <= hi else 0 for lo, hi in ranges]
    lo, hi = ranges[me]
    recv = [1 if lo <= s <= hi else 0 for s in range(world)]
    return send, recv


class _KVWindowGather(torch.autograd.Function):
    """fwd: one uneven all_to_all per tensor (K and V both launched before either is waited):
    this rank's chunk goes to every rank whose range contains it, and rank r receives its range
    in source order. bwd: the inverse exchange of dK/dV; the copies of this rank's chunk that
    came back (one per receiver, itself included) are summed."""

    @staticmethod
    def gather(k, v, group, dim, send, recv, tag="cp.window_gather"):
        n = sum(send)
        hk = P.all_to_all_uneven(torch.cat([k] * n, dim=dim), group, send, recv, dim, async_op=True,
                                 tag=tag + "_k")
        hv = P.all_to_all_uneven(torch.cat([v] * n, dim=dim), group, send, recv, dim, async_op=True,
                                 tag=tag + "_v")
        return hk.wait(), hv.wait()

    @staticmethod
    def forward(ctx, k, v, group, dim, send, recv):
        ctx.group, ctx.dim, ctx.send, ctx.recv = group, dim, send, recv
        return _KVWindowGather.gather(k, v, group, dim, send, recv)

    @staticmethod
    def backward(ctx, gk, gv):
        g, d, send, recv = ctx.group, ctx.dim, ctx.send, ctx.recv
        hk = P.all_to_all_uneven(gk.contiguous(), g, recv, send, d, async_op=True, tag="cp.window_gather_k.bwd")
        hv = P.all_to_all_uneven(gv.contiguous(), g, recv, send, d, async_op=True, tag="cp.window_gather_v.bwd")
        n = sum(send)
        dk = torch.stack(hk.wait().chunk(n, dim=d), 0).sum(0)
        dv = torch.stack(hv.wait().chunk(n, dim=d), 0).sum(0)
        return dk, dv, None, None, None, None


def flex_cp_window_gather(k: torch.Tensor, v: torch.Tensor, cp_dim: int, cp_mesh,
                          ranges: Sequence[tuple[int, int]]):
    """Gather only the K/V chunks a rank can see: rank r gets chunks ``ranges[r] = (lo, hi)``.

    ``k`` ``[.., L, ..]`` / ``v`` (same shape up to ``cp_dim``) are this rank's contiguous chunk
    along ``cp_dim``; ``ranges`` (one inclusive ``(lo, hi)`` per group rank, identical on every
    rank, e.g. :func:`window_chunk_ranges`; each must contain its own rank) says which chunks each
    rank receives. Returns ``(k_vis, v_vis)`` ``[.., (hi-lo+1)*L, ..]`` = global indices
    ``[lo*L, (hi+1)*L)`` in order: bit-identical to that slice of :func:`flex_cp_allgather`'s
    output. One uneven all_to_all per tensor on the group (``platform.all_to_all_uneven``:
    gloo, NCCL, HCCL); a rank sends its chunk only to the ranks whose range contains it.
    When every range is the rank alone (window 1), nothing is communicated.
    Backward: the gradient of each received chunk goes back to its owner, which sums the
    copies from every receiver (itself included) — the sum a ReduceScatter of the full
    gather would give, restricted to the ranks that can see the chunk.
    """
    fn = "flex_cp_window_gather"
    group = resolve_group(cp_mesh)
    dk = _check_kv_pair(k, v, cp_dim, fn)
    world, me = P.group_size(group), P.group_rank(group)
    ranges = [tuple(int(x) for x in rg) for rg in ranges]
    if len(ranges) != world or any(not (0 <= lo <= r <= hi < world) for r, (lo, hi) in enumerate(ranges)):
        raise CPCollectiveError(
            f"{fn}: ranges must give one (lo, hi) per rank of {group_desc(group)} with lo <= rank <= hi, "
            f"got {ranges}"
        )
    if all(lo == hi for lo, hi in ranges):           # every rank sees only its own chunk
        return k, v
    send, recv = _window_counts(ranges, me)
    return _KVWindowGather.apply(k, v, group, dk, send, recv)
