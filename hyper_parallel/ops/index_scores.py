"""The lightning indexer's scores (DeepSeek sparse attention) on the engine: a thin front over
``torch.ops.hyper_parallel.index_scores`` (csrc/indexer/index_scores.cpp).

``index_scores(q [B, L, H, D], w [B, L, H], k [B, n, D], scale) -> [B, L, n]`` float32,
``sum_h w[h] * relu(scale * q[h].k)`` with one fixed float32 reduction order per (query, key) pair:
the same bits whatever the call's batch of queries and keys (every CP size) and the CPU. CPU only
(a tensor elsewhere is the caller's business); forward only (no autograd: the indexer selects
under ``no_grad``). docs/wrappers.md, "Attentions with a selection of their own".
"""
from __future__ import annotations

import torch

from .attention import _require_extension

__all__ = ["index_scores"]


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """The engine's indexer scores (module doc); ImportError naming the build step without the engine."""
    _require_extension()
    if q.requires_grad or w.requires_grad or k.requires_grad:
        raise ValueError("ops.index_scores has no backward: call it under torch.no_grad() or on detached tensors")
    return torch.ops.hyper_parallel.index_scores(q, w, k, float(scale))
