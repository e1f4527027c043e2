"""The balanced split of a packed row: one permutation of its token blocks over the CP ranks.

``solve(work, cp)`` takes the work of every block (:func:`.cost.block_work`: ``n = cp * m`` blocks
of ``block`` tokens) and returns ``blocks [n]``: rank r holds blocks ``blocks[r*m:(r+1)*m]``
(ascending inside a rank). Every rank gets exactly ``m`` blocks (equal tokens per rank); the
slowest rank's work is minimised by

1. LPT with a cardinality cap: blocks by decreasing work (stable), each to the least loaded rank
   that still has room (ties: lowest rank);
2. pairwise refinement: swap one block of the slowest rank with one of another rank when that
   lowers the larger of the two loads, best swap first, until no swap helps, slowest/mean is within
   ``tol`` (1e-4) of 1, or the round bound.

Deterministic (numpy, stable sorts, no randomness): every rank computes the same split from the
same batch, without communicating. :func:`token_permutation` expands blocks to a token
permutation ``perm [S]`` (slot i of the permuted row holds global token ``perm[i]``) and its
inverse. Cost: O(n log n + rounds * cp * m^2) numpy work, milliseconds at 128k tokens.
"""
from __future__ import annotations

import heapq

import numpy as np

__all__ = ["solve", "token_permutation", "inverse"]


def _lpt(work: np.ndarray, cp: int, m: int) -> list:
    order = np.argsort(-work, kind="stable")
    heap = [(0.0, r) for r in range(cp)]
    members: list = [[] for _ in range(cp)]
    for b in order:
        load, r = heapq.heappop(heap)
        members[r].append(int(b))
        if len(members[r]) < m:
            heapq.heappush(heap, (load + float(work[b]), r))
    return members


def _refine(work: np.ndarray, members: list, rounds: int, tol: float) -> list:
    idx = np.array(members, dtype=np.int64)             # [cp, m]
    w = work[idx]
    load = w.sum(axis=1)
    target = load.mean() * (1.0 + tol)
    for _ in range(rounds):
        top = int(np.argmax(load))
        if load[top] <= target:                          # balanced to within tol: no swap is worth its time
            break
        best = None
        for r in np.argsort(load, kind="stable"):
            r = int(r)
            if r == top:
                continue
            gap = load[top] - load[r]
            if gap <= 1e-9 * max(load[top], 1.0):
                break
            d = w[top][:, None] - w[r][None, :]          # moving d from top to r
            new = np.maximum(load[top] - d, load[r] + d)
            new = np.where(d > 0, new, np.inf)
            i, j = np.unravel_index(int(np.argmin(new)), new.shape)
            if new[i, j] < load[top] - 1e-3 * tol * target:      # a swap must gain a visible amount
                cand = (float(new[i, j]), r, int(i), int(j))
                if best is None or cand[0] < best[0]:
                    best = cand
        if best is None:
            break
        _, r, i, j = best
        idx[top, i], idx[r, j] = idx[r, j], idx[top, i]
        w[top, i], w[r, j] = w[r, j], w[top, i]
        load[top], load[r] = w[top].sum(), w[r].sum()
    return [sorted(int(b) for b in row) for row in idx]


def solve(work, cp: int, *, rounds: int | None = None, tol: float = 1e-4) -> np.ndarray:
    """Block order ``[n]`` (rank r: entries ``r*m .. (r+1)*m-1``, ascending) minimising the slowest
    rank's summed ``work``; ``len(work)`` must be a multiple of ``cp``. Refinement stops after
    ``rounds`` swaps (default ``4 n``) or once slowest/mean <= ``1 + tol``."""
    work = np.asarray(work, dtype=np.float64)
    n = work.size
    if cp < 1 or n % cp:
        raise ValueError(f"balance.solve: {n} blocks cannot be split evenly over cp={cp} ranks")
    if cp == 1:
        return np.arange(n, dtype=np.int64)
    m = n // cp
    members = _lpt(work, cp, m)
    members = _refine(work, members, rounds if rounds is not None else 4 * n, tol)
    members.sort(key=lambda row: row[0])                  # rank order: by first block (stable, deterministic)
    return np.array([b for row in members for b in row], dtype=np.int64)


def token_permutation(blocks, block: int) -> np.ndarray:
    """Token permutation ``[n * block]`` of a block order: slot i holds global token ``perm[i]``."""
    blocks = np.asarray(blocks, dtype=np.int64)
    return (blocks[:, None] * block + np.arange(block, dtype=np.int64)[None, :]).reshape(-1)


def inverse(perm) -> np.ndarray:
    """``inv`` with ``inv[perm[i]] == i``: where global token j sits in the permuted row."""
    perm = np.asarray(perm, dtype=np.int64)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=np.int64)
    return inv
