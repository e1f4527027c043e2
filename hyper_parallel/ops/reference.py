"""Float64-capable math reference for the position-masked attention op.

TEST REFERENCE ONLY: it materializes the [B, H, Sq, Sk] visibility mask and score matrix,
which the CP path must never do. Production code calls :func:`hyper_parallel.ops.attention`.

Contract (identical to the engine):
  q [B, Hq, Sq, D], k/v [B, Hk, Sk, D], Hq % Hk == 0 (query head h uses kv head h // (Hq//Hk);
  or (h + kv_offset) // kv_group with a head map).
  q_pos [Sq] or [B, Sq], k_pos [Sk] or [B, Sk]: integer global sequence indices.
  q_doc / k_doc (optional, same shapes as the positions): document ids; a key with doc -1 is
  never attended; key j is visible to query i iff (not causal or k_pos[j] <= q_pos[i]) and
  (docs absent or q_doc[i] == k_doc[j] and k_doc[j] >= 0).
  Queries with no visible key return out = 0 and lse = -inf; their gradients are 0.
  window / softcap / sinks: see reference_attention. v may have its own head dim Dv (MLA).
  Returns out [B, Hq, Sq, Dv] (and lse [B, Hq, Sq] in float32/float64 when return_lse).
"""
from __future__ import annotations

import math

import torch


def _as_2d(x: torch.Tensor, batch: int) -> torch.Tensor:
    if x.dim() == 1:
        return x.unsqueeze(0).expand(batch, -1)
    return x


def visibility(q_pos, k_pos, causal: bool, q_doc=None, k_doc=None, batch: int = 1,
               window=None, q_block=None, k_block=None) -> torch.Tensor:
    """Boolean [B, 1, Sq, Sk] visibility (reference only: O(Sq*Sk) memory).

    ``window`` (int >= 1 or None): also require ``k_pos > q_pos - window`` (transformers'
    ``sliding_window_overlay``; with ``causal`` this is its ``sliding_window_causal_mask``).
    ``q_block`` / ``k_block``: with ``causal``, a key of the query's block (``>= 0``) is visible
    past the causal frontier (``window AND (causal OR block)``, transformers' Gemma 3 masks).
    """
    qp = _as_2d(q_pos, batch)[:, None, :, None]
    kp = _as_2d(k_pos, batch)[:, None, None, :]
    vis = torch.ones(qp.shape[0], 1, qp.shape[2], kp.shape[3], dtype=torch.bool, device=qp.device)
    if causal:
        past = kp <= qp
        if q_block is not None:
            qb = _as_2d(q_block, batch)[:, None, :, None]
            kb = _as_2d(k_block, batch)[:, None, None, :]
            past = past | ((qb == kb) & (qb >= 0))
        vis = vis & past
    if window is not None:
        vis = vis & (kp.to(torch.int64) > qp.to(torch.int64) - int(window))
    if (q_doc is None) != (k_doc is None):
        raise ValueError("q_doc and k_doc must be given together")
    if q_doc is not None:
        qd = _as_2d(q_doc, batch)[:, None, :, None]
        kd = _as_2d(k_doc, batch)[:, None, None, :]
        vis = vis & (qd == kd) & (kd >= 0)
    return vis


def reference_attention(q, k, v, *, q_pos, k_pos, causal=True, q_doc=None, k_doc=None,
                        scale=None, return_lse=False, window=None, softcap=None, sinks=None,
                        alibi_slopes=None, kv_group=None, kv_offset=0, q_block=None, k_block=None):
    """Math reference of :func:`hyper_parallel.ops.attention` (TESTS ONLY: O(Sq*Sk) memory).

    q ``[B, Hq, Sq, D]``, k ``[B, Hk, Sk, D]``, v ``[B, Hk, Sk, Dv]`` with ``Hq % Hk == 0`` (or a head map);
    ``q_pos`` ``[Sq]`` / ``[B, Sq]`` and ``k_pos`` ``[Sk]`` / ``[B, Sk]`` integer global
    positions; optional ``q_doc`` / ``k_doc`` (together) document ids, ``-1`` = never attended;
    ``scale`` defaults to ``1/sqrt(D)``; ``window`` keeps keys with ``k_pos > q_pos - window``;
    ``softcap`` maps the scaled score ``s`` to ``softcap * tanh(s / softcap)`` (before the
    mask, as transformers' eager attention of Gemma2); ``sinks`` ``[Hq]`` is one extra logit per
    head in every row's softmax denominator, with no value (gpt-oss ``s_aux``): the returned
    ``lse`` includes it; ``alibi_slopes`` ``[Hq]`` adds ``slope * (k_pos - q_pos)`` to every
    (scaled) score; ``kv_group`` / ``kv_offset``: query head ``h`` reads KV head
    ``(h + kv_offset) // kv_group`` (default ``h // (Hq // Hk)``); ``q_block`` / ``k_block``: see
    :func:`visibility`. Computes in float64 for float64 inputs, float32 otherwise,
    materializing the ``[B, Hq, Sq, Sk]`` scores and the ``[B, 1, Sq, Sk]`` visibility mask.
    Returns ``out`` ``[B, Hq, Sq, Dv]`` in q's dtype (plus ``lse`` ``[B, Hq, Sq]`` in the compute
    dtype when ``return_lse``); queries seeing no key get ``out = 0`` and ``lse = -inf`` (``lse =
    sink`` with sinks). Plain autograd through the dense math. Never called on the CP path
    (validate mode included): use :func:`hyper_parallel.ops.attention` there.
    """
    B, Hq, Sq, D = q.shape
    Hk = k.shape[1]
    if kv_group is None and Hq % Hk:
        raise ValueError(f"Hq={Hq} is not a multiple of Hk={Hk}")
    g = Hq // Hk if kv_group is None else kv_group
    scale = (1.0 / math.sqrt(D)) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    if kv_group is not None:
        idx = (torch.arange(Hq, device=q.device) + kv_offset) // kv_group
        kf, vf = kf.index_select(1, idx), vf.index_select(1, idx)
    elif g > 1:
        kf = kf.repeat_interleave(g, dim=1)
        vf = vf.repeat_interleave(g, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        rel = (_as_2d(k_pos, B)[:, None, None, :].to(torch.int64)
               - _as_2d(q_pos, B)[:, None, :, None].to(torch.int64)).to(acc)
        s = s + alibi_slopes.to(acc).view(1, Hq, 1, 1) * rel
    vis = visibility(q_pos, k_pos, causal, q_doc, k_doc, batch=B, window=window, q_block=q_block,
                     k_block=k_block)
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        sk = sinks.to(acc).reshape(1, Hq, 1, 1).expand(B, Hq, Sq, 1)
        lse = torch.logsumexp(torch.cat([s, sk], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    finite = torch.isfinite(lse)
    lse_safe = torch.where(finite, lse, torch.zeros_like(lse))
    p = torch.where(vis, torch.exp(s - lse_safe.unsqueeze(-1)), torch.zeros_like(s))
    out = torch.matmul(p, vf).to(q.dtype)
    if return_lse:
        return out, lse
    return out
