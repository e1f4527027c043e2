"""Attention work of a packed row, per token block, for every attention kind of a model (docs/strategies/load_balance_packed.md).

Work = visible (query, key) pairs, the count the engine's tile skipping follows. A query at offset
``t`` (0-based) inside its document of ``n`` real tokens sees:

* ``causal``: ``t + 1`` keys;      * ``window`` w: ``min(t + 1, w)`` (transformers' sliding window);
* ``chunked`` c: ``t % c + 1`` (Llama 4 chunks, counted from the document start);
* ``bidirectional``: ``n``.

Padding (doc id -1) does no work. A model's cost is the sum over its attention layers
(:class:`AttentionProfile`: ``(kind, size, layers)`` terms; layers without attention — linear
attention, Mamba — cost the same per token on every rank and are left out). Block work is exact
and closed form: prefix sums ``F(x) = sum_{t<x} f(t)`` evaluated at the block/document boundaries
(O(S) index work per row, nothing of size S^2). Pure numpy/torch on CPU; no collective.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import numpy as np

__all__ = ["AttentionKind", "AttentionProfile", "CAUSAL", "profile_from_config", "doc_runs", "block_work",
           "rank_work", "spread"]

KINDS = ("causal", "window", "chunked", "bidirectional")


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """``layers`` attention layers of one mask kind; ``size`` = window w / chunk c (None otherwise)."""

    kind: str
    size: Optional[int] = None
    layers: int = 1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"AttentionKind: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in ("window", "chunked") and (not isinstance(self.size, int) or self.size < 1):
            raise ValueError(f"AttentionKind: {self.kind} needs an int size >= 1, got {self.size!r}")

    def prefix(self, x: np.ndarray, n: np.ndarray) -> np.ndarray:
        """``F(x) = sum_{t < x} f(t)`` for offsets ``x`` inside documents of real length ``n`` (float64)."""
        x = x.astype(np.float64)
        if self.kind == "causal":
            return x * (x + 1) / 2
        if self.kind == "window":
            w = float(self.size)
            head = np.minimum(x, w)
            return head * (head + 1) / 2 + np.maximum(x - w, 0) * w
        if self.kind == "chunked":
            c = float(self.size)
            q, r = np.floor(x / c), np.mod(x, c)
            return q * c * (c + 1) / 2 + r * (r + 1) / 2
        return x * n.astype(np.float64)


@dataclasses.dataclass(frozen=True)
class AttentionProfile:
    """The attention kinds of a model's layers, summed: ``cost = sum(layers * pairs(kind))``."""

    kinds: tuple = (AttentionKind("causal"),)

    def describe(self) -> str:
        return ", ".join(f"{k.layers}x {k.kind}{'' if k.size is None else ' ' + str(k.size)}" for k in self.kinds)


CAUSAL = AttentionProfile()


def profile_from_config(config) -> AttentionProfile:
    """The profile of a transformers config: ``layer_types`` (``full_attention`` / ``sliding_attention``
    / ``chunked_attention``; other types are not attention) with ``sliding_window`` and
    ``attention_chunk_size``; without ``layer_types``, ``num_hidden_layers`` causal layers (sliding
    ones when ``sliding_window`` is set and ``use_sliding_window`` is not False)."""
    cfg = getattr(config, "get_text_config", lambda: config)()
    n = int(getattr(cfg, "num_hidden_layers", 1) or 1)
    window = getattr(cfg, "sliding_window", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    types = getattr(cfg, "layer_types", None)
    counts: dict = {}
    if types:
        for t in types:
            counts[t] = counts.get(t, 0) + 1
    elif window and getattr(cfg, "use_sliding_window", True) is not False:
        counts["sliding_attention"] = n
    else:
        counts["full_attention"] = n
    kinds = []
    for t, c in counts.items():
        if t == "full_attention":
            kinds.append(AttentionKind("causal", None, c))
        elif t == "sliding_attention" and window:
            kinds.append(AttentionKind("window", int(window), c))
        elif t == "sliding_attention":
            kinds.append(AttentionKind("causal", None, c))
        elif t == "chunked_attention" and chunk:
            kinds.append(AttentionKind("chunked", int(chunk), c))
    return AttentionProfile(tuple(kinds) or CAUSAL.kinds)


def doc_runs(doc_row) -> tuple:
    """(start, length) int64 arrays of the maximal runs of one doc id >= 0 in a ``[S]`` row of doc ids."""
    d = np.asarray(doc_row, dtype=np.int64)
    if d.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    change = np.flatnonzero(np.diff(d) != 0) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [d.size]])
    keep = d[starts] >= 0
    return starts[keep], (ends - starts)[keep]


def block_work(doc_ids, block: int, profile: AttentionProfile = CAUSAL, lengths: Optional[Iterable] = None):
    """Work of every ``block``-token query block, summed over rows: float64 ``[S // block]``.

    ``doc_ids``: ``[B, S]`` or ``[S]`` doc ids (-1 = padding; a document is a maximal run of one id,
    as in ``CPBatchMeta.key_doc``), or None with ``lengths`` = document lengths packed from token 0
    (the rest of the row padding; then S = ``block * ceil(sum / block)``). ``S % block == 0``.
    """
    rows = []
    if doc_ids is None:
        lens = np.asarray(list(lengths), dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]) if lens.size else lens
        S = int(-(-int(lens.sum()) // block) * block)
        rows.append((starts, lens))
    else:
        d = np.asarray(doc_ids.cpu() if hasattr(doc_ids, "cpu") else doc_ids)
        d = d.reshape(1, -1) if d.ndim == 1 else d
        S = d.shape[1]
        rows.extend(doc_runs(r) for r in d)
    if S % block:
        raise ValueError(f"block_work: row length {S} is not a multiple of block {block}")
    out = np.zeros(S // block, dtype=np.float64)
    edges = np.arange(0, S + 1, block, dtype=np.int64)
    for starts, lens in rows:
        if not lens.size:
            continue
        # every (document, block) piece: cut each document at the block edges inside it
        first = starts // block
        last = (starts + lens - 1) // block
        npieces = last - first + 1
        doc = np.repeat(np.arange(lens.size), npieces)
        blk = np.repeat(first, npieces) + (np.arange(npieces.sum()) - np.repeat(np.cumsum(npieces) - npieces, npieces))
        lo = np.maximum(edges[blk], starts[doc]) - starts[doc]
        hi = np.minimum(edges[blk + 1], starts[doc] + lens[doc]) - starts[doc]
        n = lens[doc]
        w = np.zeros(lo.size, dtype=np.float64)
        for k in profile.kinds:
            w += k.layers * (k.prefix(hi, n) - k.prefix(lo, n))
        np.add.at(out, blk, w)
    return out


def rank_work(work, perm_blocks, cp: int) -> np.ndarray:
    """Per-rank total work ``[cp]`` when rank r holds blocks ``perm_blocks[r*m:(r+1)*m]``."""
    w = np.asarray(work, dtype=np.float64)[np.asarray(perm_blocks)]
    return w.reshape(cp, -1).sum(axis=1)


def spread(loads) -> float:
    """Slowest / mean of per-rank loads (1.0 when there is no work)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean() if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0
