"""Merging partial attention results computed over disjoint key sets.

Strategies that split the key range (ring / chunked attention) compute, per key block ``X``,
``out_X = softmax(s_X) v_X`` and ``lse_X = logsumexp(s_X)``. The attention over the union is::

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

Attention sinks (``attention(..., sinks=...)``): the engine's lse *includes* the sink, which acts
as one extra key with a zero value. Pass the sinks to exactly one of the partial attentions
being merged (e.g. the block of local keys); the merge is then exact and counts the sink once.
"""
from __future__ import annotations

import torch


def merge_partial_attention(out_a, lse_a, out_b, lse_b):
    """Merge two partial attentions of the same queries over disjoint key sets.

    Args:
        out_a, out_b: ``[B, H, S, D]`` partial outputs (same shape and dtype).
        lse_a, lse_b: ``[B, H, S]`` natural-log logsumexp of each part (``-inf`` where that part
            had no visible key, in which case its ``out`` must be 0 as the engine returns).

    Returns:
        ``(out, lse)``: ``out`` in ``out_a``'s dtype, ``lse`` in the lse dtype. Differentiable
        (pure torch) and NaN-free, including rows where one or both sides are ``-inf`` (both:
        ``out = 0``, ``lse = -inf``, zero gradients).
    """
    if out_a.shape != out_b.shape:
        raise ValueError(f"merge_partial_attention: out_a {list(out_a.shape)} and out_b "
                         f"{list(out_b.shape)} differ")
    if lse_a.shape != lse_b.shape or tuple(lse_a.shape) != tuple(out_a.shape[:-1]):
        raise ValueError(f"merge_partial_attention: lse shapes {list(lse_a.shape)} / "
                         f"{list(lse_b.shape)} must equal out's leading dims "
                         f"{list(out_a.shape[:-1])}")
    acc = torch.promote_types(torch.promote_types(lse_a.dtype, lse_b.dtype), torch.float32)
    la, lb = lse_a.to(acc), lse_b.to(acc)
    m = torch.maximum(la, lb).detach()  # stabiliser only: it cancels out mathematically
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp(la - m)  # exp(-inf) = 0, and its gradient is 0
    wb = torch.exp(lb - m)
    s = wa + wb
    seen = s > 0
    s_safe = torch.where(seen, s, torch.ones_like(s))
    lse = torch.where(seen, m + torch.log(s_safe), torch.full_like(s, float("-inf")))
    ca = (wa / s_safe).unsqueeze(-1)
    cb = (wb / s_safe).unsqueeze(-1)
    out = ca * out_a.to(acc) + cb * out_b.to(acc)
    return out.to(out_a.dtype), lse.to(torch.promote_types(lse_a.dtype, lse_b.dtype))
