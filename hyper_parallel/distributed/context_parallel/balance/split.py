"""The batch side of the balanced split (batch policy ``balanced``, docs/strategies/load_balance_packed.md).

:class:`BalancedSplit` is the policy object the planner hands the batch contract: its ``name``
("balanced"), the model's :class:`~.cost.AttentionProfile`, the ``block`` (tokens, default 64 =
the CPU engine's key tile) and the ``cost`` it balances: ``"tiles"`` (default: the engine tiles each
block computes, :func:`.tiles.block_tiles`, what the engine pays) or ``"pairs"`` (visible pairs,
:func:`.cost.block_work`). ``shard_batch_for_cp`` pads the row to a multiple of ``block * cp``
(:meth:`BalancedSplit.padding_multiple`), then calls :func:`balanced_permutation` on the global key
doc ids: one permutation of the padded row for the whole micro-batch (block work summed over its
rows, so the rank total is what is balanced), ``perm [S]`` int64 with slot i holding global token
``perm[i]``. Every sequence field is permuted and rank r keeps slots ``[r*L, (r+1)*L)`` — the
contiguous chunk of the permuted row; positions, doc ids and shifted labels travel with their
tokens. Deterministic, local, no collective: every rank computes the same ``perm``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np
import torch

from .. import catalogue
from .cost import CAUSAL, AttentionProfile, block_work, rank_work, spread
from .solver import solve, token_permutation
from .tiles import block_tiles

__all__ = ["BalancedSplit", "DEFAULT_BLOCK", "balanced_permutation", "local_counts", "split_report"]

DEFAULT_BLOCK = 64
COSTS = {"tiles": block_tiles, "pairs": block_work}


@dataclasses.dataclass(frozen=True)
class BalancedSplit:
    """Batch policy ``balanced`` with the model's attention profile (a plan's ``batch_policy``)."""

    profile: AttentionProfile = CAUSAL
    block: int = DEFAULT_BLOCK
    name: str = catalogue.BALANCED     # the batch policy of the rows on this layout
    cost: str = "tiles"

    def __post_init__(self):
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"BalancedSplit: block must be an int >= 1 (tokens), got {self.block!r}")
        if self.cost not in COSTS:
            raise ValueError(f"BalancedSplit: cost must be one of {sorted(COSTS)}, got {self.cost!r}")

    def work(self, doc: np.ndarray) -> np.ndarray:
        """Cost of every block of ``doc [B, S]`` (doc ids, -1 padding), summed over rows: ``[S // block]``."""
        return COSTS[self.cost](doc, self.block, self.profile)

    def padding_multiple(self, cp_size: int) -> int:
        return self.block * cp_size

    def __str__(self) -> str:
        return f"balanced (block {self.block}, {self.cost}; {self.profile.describe()})"


def _policy(policy) -> BalancedSplit:
    return policy if isinstance(policy, BalancedSplit) else BalancedSplit()


def balanced_permutation(key_doc: Optional[torch.Tensor], batch: int, seq_len: int, cp_size: int,
                         policy=None) -> torch.Tensor:
    """``perm [seq_len]`` int64 (CPU) for global doc ids ``key_doc [B, S]`` (-1 = padding; None = one
    document per row) under ``policy`` (a :class:`BalancedSplit`, or the string: defaults)."""
    pol = _policy(policy)
    if seq_len % (pol.block * cp_size):
        raise ValueError(f"balanced split: padded length {seq_len} is not a multiple of block {pol.block} x "
                         f"cp {cp_size}; shard the batch with the 'balanced' policy")
    doc = np.zeros((batch, seq_len), np.int64) if key_doc is None else key_doc.detach().cpu().numpy()
    work = pol.work(doc)
    return torch.from_numpy(token_permutation(solve(work, cp_size), pol.block))


def local_counts(perm: torch.Tensor, lo: int, hi: int, start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Tokens of every slot ``[start, start + length)`` ([B, n]) that sit in permuted slots ``[lo, hi)``."""
    inside = torch.zeros(perm.numel() + 1, dtype=torch.int64)
    inside[1:][perm[lo:hi]] = 1
    c = inside.cumsum(0).to(start.device)
    S = perm.numel()
    a, b = start.clamp(0, S), (start + length).clamp(0, S)
    return c[b] - c[a]


def split_report(key_doc: Optional[torch.Tensor], batch: int, seq_len: int, cp_size: int, policy=None,
                 perm: Optional[torch.Tensor] = None) -> dict:
    """Attention work per rank of one micro-batch: ``{"max_over_mean", "contiguous", "seconds"}`` —
    the spread of ``perm`` (computed here when None, timed) and of the contiguous split."""
    pol = _policy(policy)
    doc = np.zeros((batch, seq_len), np.int64) if key_doc is None else key_doc.detach().cpu().numpy()
    t0 = time.perf_counter()
    work = pol.work(doc)
    blocks = (solve(work, cp_size) if perm is None
              else perm.reshape(-1, pol.block)[:, 0].cpu().numpy() // pol.block)
    secs = time.perf_counter() - t0
    n = work.size
    return {"max_over_mean": spread(rank_work(work, blocks, cp_size)),
            "contiguous": spread(rank_work(work, np.arange(n), cp_size)), "seconds": secs}


def _whole_blocks(S: int, C: int, layout: str, perm, blk: int) -> bool:
    """Every rank's tokens are whole ``blk``-token blocks of the row (chunk edges on block edges)."""
    if S % ((2 * C if layout == catalogue.HEAD_TAIL else C) * blk):
        return False
    if perm is None:
        return True
    rows = perm.reshape(-1, blk)
    return bool((rows[:, 0] % blk == 0).all() and (rows - rows[:, :1] == np.arange(blk)).all())


def step_work_spread(metas: list, profile: Optional[AttentionProfile] = None) -> Optional[float]:
    """Slowest / mean attention work per CP rank of one step (its micro-batches' metas, summed), for
    the token splits it knows: contiguous (policy ``all_gather``), Head-Tail (``load_balance``: rank r
    computes chunks r and 2C-1-r) and the balanced split (``meta.perm``). None for other policies
    (Ulysses / Hybrid split heads) or without CP. Work = engine tiles (:func:`.tiles.block_tiles`,
    64-token blocks) when every chunk edge falls on a block edge, else visible pairs. Every rank
    computes the same number from the batch (no collective); O(B*S) per micro-batch."""
    loads = None
    for meta in metas:
        layout = None if meta is None else catalogue.token_layout(meta.policy)
        if meta is None or meta.cp_size < 2 or layout is None:
            return None
        C, S = meta.cp_size, meta.global_seq_len
        B = 1 if meta.key_doc is None else meta.key_doc.shape[0]
        doc = np.zeros((B, S), np.int64) if meta.key_doc is None else meta.key_doc.detach().cpu().numpy()
        perm = None if meta.perm is None else meta.perm.cpu().numpy()
        blk = DEFAULT_BLOCK if _whole_blocks(S, C, layout, perm, DEFAULT_BLOCK) else 1
        tok = (block_tiles(doc, blk, profile or CAUSAL) if blk > 1    # per-block (else per-token) work
               else block_work(doc, 1, profile or CAUSAL))
        if perm is not None:
            per = tok[perm[::blk] // blk].reshape(C, -1).sum(1)
        elif layout == catalogue.HEAD_TAIL:
            ch = tok.reshape(2 * C, -1).sum(1)
            per = ch[:C] + ch[::-1][:C]
        else:
            per = tok.reshape(C, -1).sum(1)
        loads = per if loads is None else loads + per
    return None if loads is None else spread(loads)
