"""Head-Tail collectives: rank r computes sub-chunks r and 2C-1-r of the 2C-way split; the query
dispatch sends each sub-chunk to the rank that computes it and the combine returns the outputs to
the contiguous owners (each one sparse all-to-all; backward the inverse). docs/strategies/head_tail.md.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..... import platform as P
from ...comm import CPCollectiveError, AllToAllUneven, check_dim, group_desc, resolve_group

__all__ = ["head_tail_combine", "head_tail_dispatch", "head_tail_sub_chunks"]


def head_tail_sub_chunks(rank: int, world: int) -> tuple[int, int]:
    """(head, tail) sub-chunk ids computed by ``rank`` in the 2*world split: (r, 2C-1-r)."""
    return rank, 2 * world - 1 - rank


def _head_tail_owner(sub: int) -> int:
    return sub // 2          # rank r holds sub-chunks 2r and 2r+1 of the contiguous layout


def _head_tail_computer(sub: int, world: int) -> int:
    return sub if sub < world else 2 * world - 1 - sub


def _route(pieces: Sequence[torch.Tensor], ids: Sequence[int], dest_of, want: Sequence[int],
           src_of, group, seq_dim: int, tag: str) -> list[torch.Tensor]:
    """Send sub-chunk ``ids[i]`` (tensor ``pieces[i]``) to rank ``dest_of(id)`` and return the
    sub-chunks ``want`` (each held by ``src_of(id)``), through one differentiable sparse
    all-to-all (``platform.all_to_all_uneven``): each rank moves only the sub-chunks another
    rank needs (at most 2), nothing zero-filled. Backward is the inverse permutation.
    """
    world, me = P.group_size(group), P.group_rank(group)
    by_id = dict(zip(ids, pieces))
    send = [sorted(i for i in ids if dest_of(i) == d) for d in range(world)]
    recv = [sorted(i for i in range(2 * world) if src_of(i) == s and dest_of(i) == me) for s in range(world)]
    x = torch.cat([by_id[i] for d in range(world) for i in send[d]], dim=seq_dim)
    got = AllToAllUneven.apply(x, group, [len(s) for s in send], [len(r) for r in recv], seq_dim, tag)
    order = [i for r in recv for i in r]
    parts = got.chunk(len(order), dim=seq_dim)
    return [parts[order.index(i)] for i in want]


def head_tail_dispatch(q: torch.Tensor, group, *, seq_dim: int = 2):
    """Head-Tail Q exchange: contiguous local shard -> this rank's (head, tail) sub-chunks.

    With C = group size and the sequence split into 2C sub-chunks, rank r holds sub-chunks
    (2r, 2r+1) on input and returns ``(q_head, q_tail)`` = sub-chunks (r, 2C-1-r), each
    ``[B, H, S/(2C), D]``. One all_to_all on ``group``; backward is the inverse exchange.
    Requires the local sequence length to be even.
    """
    fn = "head_tail_dispatch"
    group = resolve_group(group)
    sd = check_dim(q, seq_dim, "q", fn)
    world = P.group_size(group)
    if q.shape[sd] % 2:
        raise CPCollectiveError(
            f"{fn}: q sequence dim {sd} of size {q.shape[sd]} must be even (2*cp_size sub-chunks) on "
            f"{group_desc(group)}; shard the batch with policy='load_balance'"
        )
    lo, hi = q.chunk(2, dim=sd)
    if world == 1:
        return lo, hi
    me = P.group_rank(group)
    return tuple(_route([lo, hi], [2 * me, 2 * me + 1], lambda i: _head_tail_computer(i, world),
                        head_tail_sub_chunks(me, world), _head_tail_owner, group, sd,
                        "cp.head_tail_dispatch"))


def head_tail_combine(o_head: torch.Tensor, o_tail: torch.Tensor, group, *, seq_dim: int = 2) -> torch.Tensor:
    """Inverse of :func:`head_tail_dispatch`: (head, tail) outputs -> contiguous local shard.

    ``o_head``/``o_tail`` ``[B, H, S/(2C), D]`` are sub-chunks (r, 2C-1-r); returns
    ``[B, H, S/C, D]`` = sub-chunks (2r, 2r+1). Backward: the dispatch exchange of the gradient.
    """
    fn = "head_tail_combine"
    group = resolve_group(group)
    sd = check_dim(o_head, seq_dim, "o_head", fn)
    if o_head.shape != o_tail.shape:
        raise CPCollectiveError(f"{fn}: head {tuple(o_head.shape)} and tail {tuple(o_tail.shape)} differ")
    world = P.group_size(group)
    if world == 1:
        return torch.cat([o_head, o_tail], dim=sd)
    me = P.group_rank(group)
    lo, hi = _route([o_head, o_tail], list(head_tail_sub_chunks(me, world)), _head_tail_owner,
                    [2 * me, 2 * me + 1], lambda i: _head_tail_computer(i, world), group, sd,
                    "cp.head_tail_combine")
    return torch.cat([lo, hi], dim=sd)
