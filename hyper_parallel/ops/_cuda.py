"""CUDA backend of :func:`hyper_parallel.ops.attention`: routed kernels, FlexAttention as the fallback.

:func:`cuda_attention` asks :func:`hyper_parallel.ops.cuda_routes.plan` which exact kernel a call
can use (SDPA flash / cuDNN with a lower-right causal bias, flash pieces merged by log-sum-exp,
the optional flash-attn package's window / softcap / varlen kernels; table in
docs/attention_engine.md, "CUDA routes") and runs it; everything else runs FlexAttention:

The visibility rule becomes a ``mask_mod`` closing over the ``[B, S]`` position / doc vectors;
``create_block_mask`` turns it into a sparse block mask, so fully invisible blocks are skipped and
nothing of size ``Sq x Sk`` is kept. Block masks are cached by (shapes, dtypes, causal, device) and
re-used only when the position / doc tensors are equal to the cached ones (one device compare).
FlexAttention itself is differentiable (also through the returned lse) and compiled once.

The mask / lse / cache logic is tested on CPU through FlexAttention's eager implementation
(tests/ops/test_device_backends_on_cpu.py); the compiled CUDA kernel and its backward only by
the tests marked skipif(not cuda), which this repository's CI (no GPU) does not run.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

_CACHE_SIZE = 8
_block_masks: "OrderedDict[tuple, tuple]" = OrderedDict()
_compiled = None


def _flex():
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


_compiled_builder = None


def _block_mask_builder(device):
    """``torch.compile(create_block_mask)`` on CUDA: the compiled builder evaluates the mask
    block by block, the eager one evaluates ``mask_mod`` over the whole ``Sq x Sk`` grid (an
    O(S^2) temporary). Eager elsewhere (CPU tests of this module's logic)."""
    global _compiled_builder
    from torch.nn.attention.flex_attention import create_block_mask

    if torch.device(device).type != "cuda":
        return create_block_mask
    if _compiled_builder is None:
        _compiled_builder = torch.compile(create_block_mask)
    return _compiled_builder


def _rows(t: torch.Tensor, batch: int) -> torch.Tensor:
    t = t.to(torch.int64)
    return t.unsqueeze(0).expand(batch, -1) if t.dim() == 1 else t.expand(batch, -1)


def _block_mask(q_pos, k_pos, causal, q_doc, k_doc, B, Sq, Sk, device, window=None):
    tensors = tuple(t for t in (q_pos, k_pos, q_doc, k_doc) if t is not None)
    key = (B, Sq, Sk, causal, window, str(device), q_doc is not None,
           tuple((tuple(t.shape), t.dtype) for t in tensors))
    hit = _block_masks.get(key)
    if hit is not None and all(torch.equal(a, b) for a, b in zip(hit[0], tensors)):
        _block_masks.move_to_end(key)
        return hit[1]
    qp, kp = _rows(q_pos, B), _rows(k_pos, B)
    qd = _rows(q_doc, B) if q_doc is not None else None
    kd = _rows(k_doc, B) if k_doc is not None else None

    def mask_mod(b, h, qi, ki):
        vis = kp[b, ki] <= qp[b, qi] if causal else qi >= 0
        if window is not None:  # left sliding window: k_pos > q_pos - window
            vis = vis & (kp[b, ki] > qp[b, qi] - window)
        if qd is not None:
            vis = vis & (qd[b, qi] == kd[b, ki]) & (kd[b, ki] >= 0)
        return vis

    bm = _block_mask_builder(device)(mask_mod, B, None, Sq, Sk, device=device)
    _block_masks[key] = (tuple(t.clone() for t in tensors), bm)
    while len(_block_masks) > _CACHE_SIZE:
        _block_masks.popitem(last=False)
    return bm


def apply_sinks(out, lse, sinks):
    """Add one valueless logit per head to the softmax denominator of a finished attention.

    ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')`` (exact, differentiable
    in out, lse and sinks; rows with ``lse = -inf`` give ``out' = 0``, ``lse' = sink``).
    """
    s = sinks.to(lse.dtype).view(1, -1, 1)
    new_lse = torch.logaddexp(lse, s.expand_as(lse))
    fin = torch.isfinite(new_lse)
    w = torch.exp(torch.where(fin, lse - torch.where(fin, new_lse, 0.0), float("-inf")))
    return (out.to(w.dtype) * w.unsqueeze(-1)).to(out.dtype), new_lse


def cuda_attention(q, k, v, q_pos, k_pos, causal, q_doc, k_doc, scale, *, window=None,
                   softcap=None, sinks=None, alibi_slopes=None, need_lse=True, flash_impl=None):
    """(out, lse) for CUDA tensors through the planned route; ``lse`` is None when the caller
    did not ask for it and the route has none. Same contract as hyper_parallel.ops.attention.
    ``flash_impl``: {name: function} stand-ins for the flash_attn package (tests on CPU)."""
    from . import _flash_attn, _sdpa_lse
    from .cuda_routes import describe, plan

    B, Hq, Sq, _ = q.shape
    Hk, Sk = k.shape[1], k.shape[2]
    if q.numel() == 0 or Sk == 0:
        return flex_attention_call(q, k, v, q_pos, k_pos, causal, q_doc, k_doc, scale, sinks=sinks)
    p = plan(describe(q, k, v, q_pos, k_pos, causal, q_doc, window, softcap, sinks, alibi_slopes,
                      need_lse, flash_attn=None if flash_impl is None else True))
    if p.route != "flex" and p.key_order is not None:
        idx = torch.cat([torch.arange(i, i + n, device=k.device) for i, n in p.key_order])
        kr, vr = k.index_select(2, idx), v.index_select(2, idx)
    else:
        kr, vr = k, v
    impl = flash_impl or {}
    out = None
    if p.route == "sdpa_full":
        out = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, scale=scale,
                                                               enable_gqa=Hq != Hk)
    elif p.route == "sdpa_lower_right":
        out = _sdpa_lse.lower_right_attention(q, kr, vr, p.pieces, scale, Hq != Hk)
    elif p.route == "flash_window":
        out = _flash_attn.window_attention(q, kr, vr, p.pieces, scale, window, softcap,
                                           impl.get("flash_attn_func"))
    elif p.route == "flash_varlen":
        out = _flash_attn.varlen_attention(q, kr, vr, p.pieces[0], q_doc, k_doc, scale, window,
                                           softcap, impl.get("flash_attn_varlen_func"))
    elif p.route == "sdpa_lse_merge":  # the flash kernels read GQA K/V in place (dk / dv per KV head)
        out, lse = _sdpa_lse.lse_merge_attention(q, kr, vr, p.pieces, scale)
        return apply_sinks(out, lse, sinks) if sinks is not None else (out, lse)
    if out is not None:
        return out.contiguous(), None
    return flex_attention_call(q, k, v, q_pos, k_pos, causal, q_doc, k_doc, scale, window=window,
                               softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)


def flex_attention_call(q, k, v, q_pos, k_pos, causal, q_doc, k_doc, scale, *, window=None,
                        softcap=None, sinks=None, alibi_slopes=None):
    """Route ``flex``: (out, lse float32) through FlexAttention.

    ``window`` joins the ``mask_mod`` (blocks outside every window are skipped by the block
    mask); ``softcap`` is a ``score_mod`` (``softcap * tanh(score / softcap)``, differentiated
    by FlexAttention); ``alibi_slopes`` is a ``score_mod`` adding
    ``slope[h] * (k_pos - q_pos)``; ``sinks`` are applied to FlexAttention's (out, lse) by
    :func:`apply_sinks` (differentiable through FlexAttention's lse).
    """
    from torch.nn.attention.flex_attention import AuxRequest

    B, Hq, Sq, D = q.shape
    Hk, Sk = k.shape[1], k.shape[2]
    if q.numel() == 0 or Sk == 0:
        lse = torch.full((B, Hq, Sq), float("-inf"), device=q.device, dtype=torch.float32)
        out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
        return apply_sinks(out, lse, sinks) if sinks is not None else (out, lse)
    block_mask = None
    if causal or q_doc is not None or window is not None:
        block_mask = _block_mask(q_pos, k_pos, causal, q_doc, k_doc, B, Sq, Sk, q.device,
                                 window=window)
    score_mod = None
    if softcap is not None:
        cap = float(softcap)

        def score_mod(score, b, h, qi, ki):
            return cap * torch.tanh(score / cap)
    elif alibi_slopes is not None:
        slopes = alibi_slopes.to(torch.float32)
        qpr, kpr = _rows(q_pos, B), _rows(k_pos, B)

        def score_mod(score, b, h, qi, ki):
            return score + slopes[h] * (kpr[b, ki] - qpr[b, qi]).to(torch.float32)

    out, aux = _flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                       enable_gqa=Hq != Hk, return_aux=AuxRequest(lse=True))
    lse = aux.lse.to(torch.float32 if q.dtype != torch.float64 else torch.float64)
    if sinks is not None:
        return apply_sinks(out, lse, sinks)
    return out, lse
