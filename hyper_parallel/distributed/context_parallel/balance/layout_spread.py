"""Attention work per CP rank of one batch under each layout the batch layer applies (contiguous
chunks, Head-Tail's head r + tail 2C-1-r, the balanced split's own permutation): visible (query,
key) pairs, documents kept apart (``position_ids`` restart at every document). What
``hyper-train --explain`` prints for the first batch; local, no collective."""
from __future__ import annotations

import torch

from .. import catalogue


def layout_chunks(layout: str, S: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The query positions ``[start, end)`` rank ``rank`` computes attention for."""
    if layout == catalogue.HEAD_TAIL:
        w = S // (2 * cp)
        return [(rank * w, (rank + 1) * w), ((2 * cp - 1 - rank) * w, (2 * cp - rank) * w)]
    w = S // cp
    return [(rank * w, (rank + 1) * w)]


def work_spread(batch: dict, layout: str, cp: int, heads_split: bool = False) -> list[int]:
    """Visible (query, key) pairs per CP rank for ``batch`` (``position_ids`` restart at every
    document: a query at position p sees p + 1 keys; padding queries see none). ``heads_split``
    (Ulysses): every rank computes every query for its share of the heads."""
    ids = batch["input_ids"]
    B, S = ids.shape
    pos = batch.get("position_ids")
    pos = torch.arange(S).expand(B, S) if pos is None else pos
    if pos.dim() == 3:      # multimodal [3|4, B, S]: row 0 is the text position (transformers' 4-row layout)
        pos = pos[0].expand(B, S)
    valid = batch.get("attention_mask")
    visible = (pos + 1) * (valid if valid is not None else 1)
    per_token = visible.sum(0)
    if layout == catalogue.BALANCED:    # the balanced split's own permutation of this batch (blocks of 64)
        return _balanced_spread(pos, valid, per_token, cp)
    pad = (-S) % (2 * cp)
    per_token = torch.cat([per_token, per_token.new_zeros(pad)])
    if heads_split:
        total = int(per_token.sum())
        return [total // cp] * cp
    return [int(sum(int(per_token[a:b].sum()) for a, b in layout_chunks(layout, S + pad, cp, r))) for r in range(cp)]


def _balanced_spread(pos: torch.Tensor, valid, per_token: torch.Tensor, cp: int) -> list[int]:
    """Visible pairs per rank under :func:`~.split.balanced_permutation`
    of the batch's documents (a document starts where ``pos`` is 0; padding = -1)."""
    from .split import DEFAULT_BLOCK, balanced_permutation

    B, S = pos.shape
    doc = (pos == 0).long().cumsum(1) - 1
    if valid is not None:
        doc = torch.where(valid.bool(), doc, torch.full_like(doc, -1))
    pad = (-S) % (DEFAULT_BLOCK * cp)
    doc = torch.cat([doc, doc.new_full((B, pad), -1)], 1)
    per_token = torch.cat([per_token, per_token.new_zeros(pad)])
    perm = balanced_permutation(doc, B, S + pad, cp)
    return [int(x) for x in per_token[perm].reshape(cp, -1).sum(1)]
