"""Routes ``flash_window`` and ``flash_varlen``: the ``flash_attn`` package's kernels where it is
installed, else torch's own flash kernel (:class:`_TorchFlash`; no softcap).

Both take ``[B, H, S, D]`` tensors (the package wants ``[B, S, H, D]`` / ``[T, H, D]``; the
transposes are views, the varlen gathers are O(S·D) copies) and a query run ``(q0, q1, k0, k1)``
whose keys ``k0..k1`` end at the run's last position, so flash-attn's causal rule (aligned to
the bottom-right corner) is the CP offset; ``window_size = (window - 1, 0)`` is our
``q - window < k <= q``; ``softcap`` is applied to the scaled score, as ours. GQA is native.
Backward: flash-attn's own (autograd) or ``aten::_flash_attention_backward``, plus the gathers' /
scatters'. No lse (not differentiable
there): the planner only picks these routes when the caller does not need it.
"""
from __future__ import annotations

import torch


def _window(window):
    return (-1, -1) if window is None else (int(window) - 1, 0)


class _TorchFlash(torch.autograd.Function):
    """torch's own flash kernel (``aten::_flash_attention_forward`` / ``_backward``: bottom-right
    causal, ``window_size_left/right``, varlen through ``cum_seq``), for CUDA fp16 / bf16 when the
    flash-attn package is absent. No softcap (the planner asks for the package then)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, left):
        o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale,
            window_size_left=left, window_size_right=0)
        ctx.save_for_backward(q, k, v, o, lse, rng, unused, *(() if cu_q is None else (cu_q, cu_k)))
        ctx.args = (max_q, max_k, scale, left, cu_q is not None)
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse, rng, unused, *cu = ctx.saved_tensors
        max_q, max_k, scale, left, varlen = ctx.args
        cu_q, cu_k = cu if varlen else (None, None)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, o, lse, cu_q, cu_k, max_q, max_k, 0.0, True, rng, unused,
            scale=scale, window_size_left=left, window_size_right=0)
        return dq, dk, dv, None, None, None, None, None, None


def torch_flash_attn_func(q, k, v, softmax_scale, causal, window_size, softcap):
    """``flash_attn_func``'s signature on :class:`_TorchFlash` ([B, S, H, D]; causal, softcap 0)."""
    assert causal and not softcap, "the planner routes softcap to the flash-attn package"
    left = None if window_size[0] < 0 else window_size[0]
    return _TorchFlash.apply(q, k, v, None, None, q.shape[1], k.shape[1], softmax_scale, left)


def torch_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, softcap):
    """``flash_attn_varlen_func``'s signature on :class:`_TorchFlash` ([T, H, D] + cu_seqlens)."""
    assert causal and not softcap, "the planner routes softcap to the flash-attn package"
    left = None if window_size[0] < 0 else window_size[0]
    return _TorchFlash.apply(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, left)


_TORCH = {"flash_attn_func": torch_flash_attn_func, "flash_attn_varlen_func": torch_flash_attn_varlen_func}


def _fn(name, impl):
    if impl is not None:
        return impl
    from .cuda_routes import flash_attn_installed

    if not flash_attn_installed():
        return _TORCH[name]
    import flash_attn

    return getattr(flash_attn, name)


def window_attention(q, k, v, calls, scale, window, softcap, impl=None):
    """One ``flash_attn_func`` per query run; outputs concatenated along the sequence."""
    f = _fn("flash_attn_func", impl)
    outs = []
    for q0, q1, k0, k1 in calls:
        o = f(q[:, :, q0:q1].transpose(1, 2), k[:, :, k0:k1].transpose(1, 2),
              v[:, :, k0:k1].transpose(1, 2), softmax_scale=scale, causal=True,
              window_size=_window(window), softcap=float(softcap or 0.0))
        outs.append(o.transpose(1, 2))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).contiguous()


def _doc_runs(d: torch.Tensor):
    """[(start, end, doc)] of equal consecutive values of a 1-D tensor (one host copy of the
    run boundaries, not of the tensor)."""
    if d.numel() == 0:
        return []
    starts = [0] + (torch.nonzero(d[1:] != d[:-1]).flatten() + 1).tolist()
    docs = d[starts].tolist()
    return list(zip(starts, starts[1:] + [d.numel()], docs))


def varlen_segments(q_doc, k_doc, call, batch):
    """Flat gather indices and cu_seqlens of the document segments of one query run.

    Returns ``(q_idx, k_idx, cu_q, cu_k, max_q, max_k)`` (index tensors over the ``[B*Sq]`` /
    ``[B*Sk]`` flattened tokens, cu_seqlens as lists), or None when the key docs at the queries'
    positions differ from the query docs (then the docs are not one packing and the caller falls
    back to FlexAttention). Query segments with doc < 0 (padding) get no keys: ``out = 0``.
    """
    q0, q1, k0, k1 = call
    qd = (q_doc if q_doc.dim() == 2 else q_doc[None]).expand(batch, -1)
    kd = (k_doc if k_doc.dim() == 2 else k_doc[None]).expand(batch, -1)
    Sq, Sk = qd.shape[1], kd.shape[1]
    shift = k1 - q1  # key index of the query at index i: i + shift
    if not torch.equal(kd[:, q0 + shift:q1 + shift], qd[:, q0:q1]):
        return None
    qi, ki, cq, ck, mq, mk = [], [], [0], [0], 0, 0
    for b in range(batch):
        kstarts = [r[0] for r in _doc_runs(kd[b, k0:k1])]
        for s, e, doc in _doc_runs(qd[b, q0:q1]):
            if doc < 0:
                continue
            x = s + q0 + shift - k0  # the segment's first query, as a key index in k0..k1
            ks = max(t for t in kstarts if t <= x) + k0
            ke = e + q0 + shift
            qi.append((b * Sq + q0 + s, b * Sq + q0 + e))
            ki.append((b * Sk + ks, b * Sk + ke))
            cq.append(cq[-1] + e - s)
            ck.append(ck[-1] + ke - ks)
            mq, mk = max(mq, e - s), max(mk, ke - ks)
    dev = qd.device
    idx = lambda spans: torch.cat([torch.arange(a, z, device=dev) for a, z in spans]) if spans \
        else torch.zeros(0, dtype=torch.long, device=dev)  # noqa: E731
    return idx(qi), idx(ki), cq, ck, mq, mk


def varlen_attention(q, k, v, call, q_doc, k_doc, scale, window, softcap, impl=None):
    """``flash_attn_varlen_func`` over the document segments of one query run; None when
    :func:`varlen_segments` refuses (the caller then runs FlexAttention)."""
    B, H, Sq, D = q.shape
    seg = varlen_segments(q_doc, k_doc, call, B)
    if seg is None:
        return None
    qi, ki, cq, ck, mq, mk = seg
    if qi.numel() == 0:  # only padding queries
        return q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    cu = [torch.tensor(c, device=q.device, dtype=torch.int32) for c in (cq, ck)]
    flat = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])  # noqa: E731
    o = _fn("flash_attn_varlen_func", impl)(
        flat(q).index_select(0, qi), flat(k).index_select(0, ki), flat(v).index_select(0, ki),
        cu[0], cu[1], mq, mk, softmax_scale=scale, causal=True, window_size=_window(window),
        softcap=float(softcap or 0.0))
    out = q.new_zeros(B * Sq, H, v.shape[-1]).index_copy(0, qi, o)
    return out.view(B, Sq, H, -1).transpose(1, 2).contiguous()
