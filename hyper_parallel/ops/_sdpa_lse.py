"""Route ``sdpa_lse_merge``: pieces of attention on flash kernels with logsumexp, merged exactly.

``lse_merge_attention(q, k, v, pieces, scale)`` -> ``(out [B, H, Sq, D], lse [B, H, Sq] fp32/fp64)``
for ``q`` ``[B, Hq, Sq, D]`` and ``k``/``v`` ``[B, Hk, Sk, D]``, ``Hq % Hk == 0`` (the flash kernels
read GQA K/V in place and return dk / dv per KV head). Each :class:`~hyper_parallel.ops.cuda_routes.Piece` runs the aten flash kernel
(CPU: ``_scaled_dot_product_flash_attention_for_cpu``; CUDA: ``_scaled_dot_product_flash_attention``)
on slices (views, no copies) and is folded into the running ``(out, lse)`` of its query rows.
Rows no piece covers give ``out = 0``, ``lse = -inf``.

Backward is exact without differentiating the kernels' lse: the softmax of the union restricted
to a piece is ``exp(s - lse_merged)``, so each piece's kernel backward is called with the *merged*
out and lse (``dS = P (dP - rowsum(dO * out))``). A gradient ``dlse`` of the returned lse adds
``P * dlse`` to ``dS``; it is folded in by one padded call per piece: q, k padded with zero
columns, ``v' = [v, 1, 0..]``, ``out' = [out, 0, 0..]``, ``dout' = [dout, dlse, 0..]``
gives ``dP' - delta' = dP + dlse - rowsum(dO * out)`` (the padding keeps the scores unchanged).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _kernel_fwd(q, k, v, causal, scale):
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse, None
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1], res[2:8]


def _kernel_bwd(dout, q, k, v, out, lse, causal, scale, extra):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


def _fold(acc_out, acc_lse, out, lse):
    """In place: (acc_out, acc_lse) <- log-sum-exp merge with (out, lse); lse of a piece is finite."""
    new = torch.logaddexp(acc_lse, lse)
    a = torch.exp(acc_lse - new).unsqueeze(-1)
    b = torch.exp(lse - new).unsqueeze(-1)
    acc_out.copy_(a * acc_out + b * out.to(acc_out.dtype))
    acc_lse.copy_(new)


def _pad(t, width, fill_col=None):
    pad = t.new_zeros(t.shape[:-1] + (width - t.shape[-1],))
    if fill_col is not None:
        pad[..., 0] = fill_col
    return torch.cat([t, pad], dim=-1)


class _LseMerge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pieces, scale):
        B, H, Sq, D = q.shape
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(B, H, Sq, v.shape[-1], device=q.device, dtype=acc)
        lse = torch.full((B, H, Sq), float("-inf"), device=q.device, dtype=acc)
        extras = []
        for p in pieces:
            o, l, extra = _kernel_fwd(q[:, :, p.q0:p.q1], k[:, :, p.k0:p.k1], v[:, :, p.k0:p.k1],
                                      p.causal, scale)
            extras.append(extra)
            _fold(out[:, :, p.q0:p.q1], lse[:, :, p.q0:p.q1], o, l.to(acc))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pieces, ctx.scale, ctx.extras = pieces, scale, extras
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # pieces summed in fp32
        dq, dk, dv = (torch.zeros(t.shape, device=t.device, dtype=acc) for t in (q, k, v))
        if dout is None:
            dout = torch.zeros_like(out)
        width = None
        if dlse is not None:
            width = (q.shape[-1] // 8 + 1) * 8  # room for the ones column, flash-friendly width
        for p, extra in zip(ctx.pieces, ctx.extras):
            qs, ks, vs = q[:, :, p.q0:p.q1], k[:, :, p.k0:p.k1], v[:, :, p.k0:p.k1]
            os_, gs = out[:, :, p.q0:p.q1].contiguous(), dout[:, :, p.q0:p.q1].contiguous()
            ls = lse[:, :, p.q0:p.q1]
            kl = (ls.to(torch.float32) if q.dtype != torch.float64 else ls).contiguous()
            if width is None:
                g = _kernel_bwd(gs, qs, ks, vs, os_, kl, p.causal, ctx.scale, extra)
            else:
                ds = dlse[:, :, p.q0:p.q1].to(q.dtype)
                g = _kernel_bwd(_pad(gs, width, ds), _pad(qs, width), _pad(ks, width),
                                _pad(vs, width, 1.0), _pad(os_, width), kl, p.causal, ctx.scale, extra)
                g = tuple(t[..., :q.shape[-1]] for t in g)
            dq[:, :, p.q0:p.q1] += g[0]
            dk[:, :, p.k0:p.k1] += g[1]
            dv[:, :, p.k0:p.k1] += g[2]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def lse_merge_attention(q, k, v, pieces, scale):
    """``(out, lse)`` of ``q`` over the union of the pieces' keys (module docstring)."""
    return _LseMerge.apply(q, k, v, tuple(pieces), float(scale))


def lower_right_attention(q, k, v, calls, scale, gqa):
    """Route ``sdpa_lower_right``: one SDPA call with a lower-right causal bias per query run
    ``(q0, q1, k0, k1)`` (keys ``k0..k1`` end at the run's last position), outputs concatenated."""
    from torch.nn.attention.bias import causal_lower_right

    outs = []
    for q0, q1, k0, k1 in calls:
        mask = causal_lower_right(q1 - q0, k1 - k0)
        outs.append(F.scaled_dot_product_attention(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1],
                                                   attn_mask=mask, scale=scale, enable_gqa=gqa))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
