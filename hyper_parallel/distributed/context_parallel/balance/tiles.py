"""Engine tiles per query block: the cost the CPU attention engine pays (docs/strategies/load_balance_packed.md).

The engine (``csrc/attention``) cuts queries and keys into ``block``-token tiles (64 = its key tile
and largest query tile) and computes every (query tile, key tile) pair it cannot skip from the
tiles' summaries (first / last real position, lowest / highest doc id): skipped when every key is
after every query (causal), before every query's window, or when the doc-id ranges do not
overlap; otherwise the whole tile is computed, masked or not (a masked tile costs the same within
a few %, measured). Under the balanced split, Head-Tail and the contiguous split every query tile
and key tile is one ``block`` of the original row, so a query block's tile count does not depend
on the split, and one count per block is exact for all three.

The count differs from the visible-pair count (:func:`.cost.block_work`) where a block straddles
documents: a block holding the last token of a long document and the head of the next one
computes every tile of the long document (its one query there sees them all). Documents are
maximal runs of one doc id (-1 = padding, no tiles), renumbered in row order, so the doc-id ranges
are monotone and each block's count is a closed form (two binary searches): O(S) per row, nothing
of size S^2. Chunked attention refines a document by its chunks (as the strategies pass the doc
ids); bidirectional keeps only the document test. Summed over rows and over the profile's layers.
"""
from __future__ import annotations

import numpy as np

from .cost import CAUSAL, AttentionProfile

__all__ = ["block_tiles"]

_BIG = np.int64(1) << 40


def _runs_ids(d: np.ndarray, chunk) -> np.ndarray:
    """Row-order run numbers of a ``[S]`` doc-id row (refined by ``chunk`` from each run's start); -1 kept."""
    S = d.size
    start = np.concatenate([[True], d[1:] != d[:-1]])
    run = np.cumsum(start) - 1
    ids = run.astype(np.int64)
    if chunk:
        first = np.flatnonzero(start)
        off = np.arange(S) - first[run]
        ids = ids * (S // chunk + 1) + off // chunk
    return np.where(d >= 0, ids, -1)


def _row_tiles(d: np.ndarray, block: int, kind) -> np.ndarray:
    ids = _runs_ids(d, kind.size if kind.kind == "chunked" else None).reshape(-1, block)
    real = ids >= 0
    pos = np.broadcast_to(np.arange(d.size, dtype=np.int64).reshape(-1, block), ids.shape)
    anyb = real.any(axis=1)
    out = np.zeros(ids.shape[0], dtype=np.float64)
    if not anyb.any():
        return out
    pmin = np.where(real, pos, _BIG).min(axis=1)
    pmax = np.where(real, pos, -_BIG).max(axis=1)
    dmin = np.where(real, ids, _BIG).min(axis=1)
    dmax = np.where(real, ids, -_BIG).max(axis=1)
    A = np.flatnonzero(anyb)                               # key tiles with a real token, in row order
    q = A
    lo = np.searchsorted(dmax[A], dmin[q], side="left")    # first key tile whose docs reach the query's
    if kind.kind == "bidirectional":
        hi = np.searchsorted(dmin[A], dmax[q], side="right")
    else:                                                  # causal: key tiles up to the query tile itself
        hi = np.searchsorted(A, q, side="right")
        if kind.kind == "window":                          # visible iff k_pos > q_pos - w
            lo = np.maximum(lo, np.searchsorted(pmax[A], pmin[q] - kind.size, side="right"))
    out[q] = np.maximum(hi - lo, 0)
    return out


def block_tiles(doc_ids, block: int, profile: AttentionProfile = CAUSAL) -> np.ndarray:
    """Engine tiles of every ``block``-token query block, summed over rows and layers: float64 ``[S // block]``.

    ``doc_ids``: ``[B, S]`` or ``[S]`` doc ids (-1 = padding), ``S % block == 0``; None = nothing to
    count (use :func:`.cost.block_work` with ``lengths``)."""
    d = np.asarray(doc_ids.cpu() if hasattr(doc_ids, "cpu") else doc_ids, dtype=np.int64)
    d = d.reshape(1, -1) if d.ndim == 1 else d
    if d.shape[1] % block:
        raise ValueError(f"block_tiles: row length {d.shape[1]} is not a multiple of block {block}")
    out = np.zeros(d.shape[1] // block, dtype=np.float64)
    for row in d:
        for kind in profile.kinds:
            out += kind.layers * _row_tiles(row, block, kind)
    return out
