"""NPU backend of :func:`hyper_parallel.ops.attention` through ``torch_npu.npu_fusion_attention``.

Code path only: no NPU is available to this repository's CI, so it is untested. The fused
kernel takes an explicit boolean mask (True = masked out), built here from positions / docs as a
``[B, 1, Sq, Sk]`` tensor on the device; ``lse = softmax_max + log(softmax_sum)``. Queries with
no visible key are forced to ``out = 0`` / ``lse = -inf``. The returned lse is not
differentiable on this backend (the fused kernel does not take an lse gradient).
"""
from __future__ import annotations

import torch


def _rows(t, batch):
    return t.unsqueeze(0).expand(batch, -1) if t.dim() == 1 else t.expand(batch, -1)


def npu_attention(q, k, v, q_pos, k_pos, causal, q_doc, k_doc, scale):
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        raise NotImplementedError(
            f"hyper_parallel.ops.attention on device '{q.device}' needs torch_npu") from exc
    B, Hq, Sq, D = q.shape
    qp = _rows(q_pos, B)[:, None, :, None]
    kp = _rows(k_pos, B)[:, None, None, :]
    vis = torch.ones(B, 1, Sq, k.shape[2], dtype=torch.bool, device=q.device)
    if causal:
        vis = vis & (kp <= qp)
    if q_doc is not None:
        qd = _rows(q_doc, B)[:, None, :, None]
        kd = _rows(k_doc, B)[:, None, None, :]
        vis = vis & (qd == kd) & (kd >= 0)
    res = torch_npu.npu_fusion_attention(q, k, v, Hq, input_layout="BNSD", atten_mask=~vis,
                                         scale=scale, keep_prob=1.0, sparse_mode=0)
    out, smax, ssum = res[0], res[1], res[2]
    seen = vis.any(-1)  # [B, 1, Sq]
    lse = (smax[..., 0] + torch.log(ssum[..., 0])).float().detach()
    lse = torch.where(seen, lse, torch.full_like(lse, float("-inf")))
    out = torch.where(seen[..., None], out, torch.zeros_like(out))
    return out, lse
