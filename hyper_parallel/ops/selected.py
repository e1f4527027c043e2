"""Attention of each query over its own selected keys (sparse attentions: Doge's dynamic mask).

``selected_attention(q, k, v, select, width, scale)``: query ``i`` of query head ``h`` attends only to
the keys ``sel[b, g, i, :]`` of KV head ``g = h // (Hq // Hk)`` that ``ok`` marks, in the order
``sel`` lists them, where ``(sel, ok) = select(l0, l1)`` is made per query block. Keys are gathered
per query block (``[B, Hk, Lb, width, D]`` at a time, sized to a budget of elements) and each block
(its selection included) runs under activation checkpointing, so at most one block's selection and
gathered rows are alive in forward and backward and no ``[L, S]`` tensor exists. Per query the result
depends only on that query's row, its selected rows of ``k`` / ``v`` and their order, so the same
selection gives the same numbers at
every CP size. Local, no collective; differentiable in ``q``, ``k``, ``v``.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["selected_attention"]

BUDGET = 1 << 24          # elements of one query block's gathered K/V rows


def _block(q, k, v, select, l0, l1, scale):
    with torch.no_grad():
        sel, ok = select(l0, l1)
    B, Hk, Lb, kk = sel.shape
    Hq, Dq, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    if Hq % Hk or Lb != q.shape[2] or ok.shape != sel.shape:
        raise ValueError(f"selected_attention: queries {tuple(q.shape)}, keys {tuple(k.shape)}, selection "
                         f"{tuple(sel.shape)} / {tuple(ok.shape)} do not fit")
    G = Hq // Hk
    gi = sel.reshape(B, Hk, Lb * kk, 1)
    ks = k.gather(2, gi.expand(-1, -1, -1, Dq)).view(B, Hk, Lb, kk, Dq)
    vs = v.gather(2, gi.expand(-1, -1, -1, Dv)).view(B, Hk, Lb, kk, Dv)
    qg = q.reshape(B, Hk, G, Lb, Dq)
    s = torch.einsum("bhgld,bhlkd->bhglk", qg, ks) * scale
    s = s.masked_fill(~ok[:, :, None], torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.einsum("bhglk,bhlkd->bhgld", p, vs)
    o = o * ok.any(-1)[:, :, None, :, None].to(o.dtype)            # a query that sees no key outputs 0
    return o.reshape(B, Hq, Lb, Dv)


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, select: Callable, width: int,
                       scale: float, budget: int = BUDGET) -> torch.Tensor:
    """Softmax attention of ``q [B, Hq, L, Dq]`` over selected keys (module docstring).

    ``k [B, Hk, S, Dq]``, ``v [B, Hk, S, Dv]`` (``Hq % Hk == 0``). ``select(l0, l1)`` -> ``(sel, ok)``
    for queries ``l0:l1``: ``sel [B, Hk, l1 - l0, width]`` int64 key indices into ``S``, ``ok`` (same
    shape, bool) which of them count — the others get no weight, a query with none outputs 0. It
    runs under ``no_grad`` inside the block (again in backward: the block is recomputed), so no
    whole-``L`` selection is kept. Scores ``scale * q.k``, softmax in float32, output in ``q``'s
    dtype ``[B, Hq, L, Dv]``."""
    B, Hq, L, Dq = q.shape
    Hk = k.shape[1]
    per_q = max(1, B * Hk * max(1, width) * (Dq + v.shape[-1]))
    lb = max(1, min(L, budget // per_q))
    outs = []
    for l0 in range(0, L, lb):
        l1 = min(L, l0 + lb)
        args = (q[:, :, l0:l1], k, v, select, l0, l1, scale)
        outs.append(checkpoint(_block, *args, use_reentrant=False) if torch.is_grad_enabled() else _block(*args))
    return torch.cat(outs, dim=2)
