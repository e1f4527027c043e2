"""Ulysses collectives: sequence <-> head all-to-all, even or with an uneven / replicated head
split (``heads``, see methods/ulysses/layout.py; backward sums a head's copies' gradients).

  ulysses_seq_to_head(x, group)   [B, H, S/C, D] -> [B, H/C, S, D]   bwd: head_to_seq
  ulysses_head_to_seq(x, group)   [B, H/C, S, D] -> [B, H, S/C, D]   bwd: seq_to_head
"""
from __future__ import annotations

import torch

from ..... import platform as P
from ...comm import CPCollectiveError, AllToAll, check_dim, check_divisible, group_desc, resolve_group

__all__ = ["ulysses_head_to_seq", "ulysses_seq_to_head"]


def check_exchange_heads(heads, world: int, num_heads: int, fn: str, group, cover: bool) -> list:
    """``heads`` as a list of ``world`` tuples of head indices in ``[0, num_heads)`` (each non-empty);
    ``cover``: disjoint and covering every head (the query / output split)."""
    try:
        heads = [tuple(int(h) for h in hs) for hs in heads]
    except TypeError:
        raise CPCollectiveError(f"{fn}: heads must be one sequence of head indices per rank, got {heads!r}") from None
    bad = len(heads) != world or any(not hs or any(not 0 <= h < num_heads for h in hs) for hs in heads)
    if not bad and cover:
        bad = sorted(h for hs in heads for h in hs) != list(range(num_heads))
    if bad:
        raise CPCollectiveError(
            f"{fn}: heads={heads} must give each of the {world} ranks of {group_desc(group)} a non-empty set of "
            f"head indices in [0, {num_heads})" + (", disjoint and covering every head" if cover else ""))
    return heads


def _heads_to_ranks(x: torch.Tensor, group, heads, tag: str) -> torch.Tensor:
    """``x`` ``[H, L, *]`` (all heads, this rank's chunk) -> ``[n_me, W*L, *]`` (heads ``heads[me]``,
    the group's whole sequence): one uneven all_to_all; rank j receives ``heads[j]`` from everyone."""
    world, me = P.group_size(group), P.group_rank(group)
    idx = torch.tensor([h for hs in heads for h in hs], dtype=torch.long, device=x.device)
    n_me, L = len(heads[me]), x.shape[1]
    got = P.all_to_all_uneven(x.index_select(0, idx), group, [len(hs) for hs in heads], [n_me] * world, 0,
                              tag=tag)                                         # [W*n_me, L, *] source-major
    got = got.reshape((world, n_me) + tuple(got.shape[1:])).transpose(0, 1)   # [n_me, W, L, *]
    return got.reshape((n_me, world * L) + tuple(got.shape[3:]))


def _ranks_to_heads(y: torch.Tensor, group, heads, num_heads: int, tag: str) -> torch.Tensor:
    """Adjoint of :func:`_heads_to_ranks`: ``y`` ``[n_me, W*L, *]`` -> ``[H, L, *]``; the pieces of a
    head that several ranks hold are summed (for disjoint ``heads`` this is the inverse permutation)."""
    world, me = P.group_size(group), P.group_rank(group)
    n_me = len(heads[me])
    L = y.shape[1] // world
    rest = tuple(y.shape[2:])
    x = y.reshape((n_me, world, L) + rest).transpose(0, 1).reshape((world * n_me, L) + rest)
    got = P.all_to_all_uneven(x.contiguous(), group, [n_me] * world, [len(hs) for hs in heads], 0, tag=tag)
    flat = [h for hs in heads for h in hs]
    if flat == list(range(num_heads)):
        return got
    idx = torch.tensor(flat, dtype=torch.long, device=got.device)
    return got.new_zeros((num_heads, L) + rest).index_add_(0, idx, got)


class _HeadExchange(torch.autograd.Function):
    """fwd ``to_ranks``: :func:`_heads_to_ranks` (seq -> head, heads may repeat over ranks), else
    :func:`_ranks_to_heads` (head -> seq); bwd: the other one (sums the gradients of repeated heads)."""

    @staticmethod
    def forward(ctx, x, group, heads, num_heads, to_ranks, tag):
        ctx.args = (group, heads, num_heads, to_ranks, tag + ".bwd")
        if to_ranks:
            return _heads_to_ranks(x, group, heads, tag)
        return _ranks_to_heads(x, group, heads, num_heads, tag)

    @staticmethod
    def backward(ctx, grad):
        group, heads, num_heads, to_ranks, tag = ctx.args
        grad = grad.contiguous()
        out = _ranks_to_heads(grad, group, heads, num_heads, tag) if to_ranks \
            else _heads_to_ranks(grad, group, heads, tag)
        return out, None, None, None, None, None


def _even_heads(heads, num_heads: int, world: int) -> bool:
    n = num_heads // world
    return num_heads % world == 0 and [tuple(h) for h in heads] == [tuple(range(i * n, (i + 1) * n))
                                                                      for i in range(world)]


def ulysses_seq_to_head(x: torch.Tensor, group, *, seq_dim: int = 2, head_dim: int = 1,
                        tag: str = "cp.ulysses_s2h", heads=None) -> torch.Tensor:
    """Sequence shard -> head shard on ``group`` (size W).

    ``[B, H, S/W, D]`` (this rank's sequence chunk, all heads) ->
    ``[B, H/W, S, D]`` (heads ``[i*H/W, (i+1)*H/W)`` for group rank i, the group's full sequence
    in rank order). Backward: :func:`ulysses_head_to_seq` of the gradient. Requires H % W == 0.

    ``heads`` (one sequence of head indices per group rank, identical on every rank; e.g.
    :attr:`~.layout.UlyssesHeadLayout.q_heads` / ``kv_heads``): rank i gets
    ``[B, len(heads[i]), S, D]``, heads ``heads[i]`` in that order — uneven counts, and a head
    may go to several ranks (replicated GQA/MQA KV heads: each rank that needs it receives one
    copy, nobody else). One uneven all_to_all (``platform.all_to_all_uneven``). Backward: the
    inverse exchange, and the gradients of a head's copies are **summed** into that head on the
    rank owning the chunk. The even split takes the plain all_to_all.
    """
    fn = "ulysses_seq_to_head"
    group = resolve_group(group)
    sd, hd = check_dim(x, seq_dim, "x", fn), check_dim(x, head_dim, "x", fn)
    world = P.group_size(group)
    if heads is not None:
        heads = check_exchange_heads(heads, world, x.shape[hd], fn, group, cover=False)
        if not _even_heads(heads, x.shape[hd], world):
            y = _HeadExchange.apply(x.movedim((hd, sd), (0, 1)), group, heads, x.shape[hd], True, tag)
            return y.movedim((0, 1), (hd, sd))
    if world == 1:
        return x
    check_divisible(x, hd, world, "x", "head", group, fn)
    return AllToAll.apply(x, group, hd, sd, tag)


def ulysses_head_to_seq(x: torch.Tensor, group, *, seq_dim: int = 2, head_dim: int = 1,
                        tag: str = "cp.ulysses_h2s", heads=None, num_heads=None) -> torch.Tensor:
    """Head shard -> sequence shard on ``group`` (inverse of :func:`ulysses_seq_to_head`).

    ``[B, H/W, S, D]`` -> ``[B, H, S/W, D]``. Backward: :func:`ulysses_seq_to_head`. Requires S % W == 0.
    ``heads``: the query split of :func:`ulysses_seq_to_head` (disjoint, covering every head,
    possibly uneven): rank i holds heads ``heads[i]``; the result has all ``H`` heads in order.
    With ``num_heads`` given, ``heads`` may overlap (the replicated KV split): the pieces of a
    head that several ranks hold are **summed** — the adjoint of the replicating
    :func:`ulysses_seq_to_head`, i.e. what a hand-written backward of the K/V exchange (the
    async wrappers) returns as dK/dV.
    """
    fn = "ulysses_head_to_seq"
    group = resolve_group(group)
    sd, hd = check_dim(x, seq_dim, "x", fn), check_dim(x, head_dim, "x", fn)
    world = P.group_size(group)
    if heads is not None:
        num = sum(len(h) for h in heads) if num_heads is None else int(num_heads)
        heads = check_exchange_heads(heads, world, num, fn, group, cover=num_heads is None)
        me = P.group_rank(group)
        if x.shape[hd] != len(heads[me]):
            raise CPCollectiveError(f"{fn}: x has {x.shape[hd]} heads (shape {tuple(x.shape)}) but heads[{me}] "
                                    f"gives this rank {len(heads[me])}")
        if not _even_heads(heads, num, world):
            check_divisible(x, sd, world, "x", "sequence", group, fn)
            y = _HeadExchange.apply(x.movedim((hd, sd), (0, 1)), group, heads, num, False, tag)
            return y.movedim((0, 1), (hd, sd))
    if world == 1:
        return x
    check_divisible(x, sd, world, "x", "sequence", group, fn)
    return AllToAll.apply(x, group, sd, hd, tag)
