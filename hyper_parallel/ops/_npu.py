"""NPU backend of :func:`hyper_parallel.ops.attention` through ``torch_npu.npu_fusion_attention``.

The fused kernel takes an explicit boolean mask (True = masked out). A mask over the whole
``Sq x Sk`` score matrix is exactly the O(S^2) buffer the CP path must never build, so the
queries are processed in **query chunks**: chunk ``c`` gets a ``[B, 1, Qc, Sk]`` mask built on
the device from its positions / docs, with ``Qc`` chosen so that one chunk's mask stays under
:data:`MASK_BUDGET` elements (``Qc = clamp(MASK_BUDGET // (B * Sk), 16, Sq)``). Query rows of
attention are independent, so concatenating the chunks is exact in forward and backward (each
chunk's key/value gradients are summed by autograd) and needs no lse merge.

``lse = softmax_max + log(softmax_sum)``; queries with no visible key are forced to ``out = 0``
/ ``lse = -inf``. The returned lse is not differentiable on this backend (the fused kernel does
not take an lse gradient); the CP strategies that merge partial results by lse run on the
engine's CPU / CUDA paths.

No NPU is available to this repository's CI: the chunking, mask construction and lse handling
are tested on CPU against the engine with a stand-in for the fused kernel (``_fused=``), the
fused kernel itself is not.
"""
from __future__ import annotations

import torch

#: Largest number of mask elements (bools) one query chunk may build: 16 Mi = 16 MiB.
MASK_BUDGET = 1 << 24


def _rows(t, batch):
    return t.unsqueeze(0).expand(batch, -1) if t.dim() == 1 else t.expand(batch, -1)


def query_chunk(B: int, Sq: int, Sk: int, budget: int = MASK_BUDGET) -> int:
    """Rows per query chunk so that a ``[B, 1, Qc, Sk]`` mask holds at most ``budget`` bools."""
    return max(1, min(Sq, max(16, budget // max(1, B * Sk))))


def _fused_npu(q, k, v, head_num, atten_mask, scale):
    import torch_npu

    res = torch_npu.npu_fusion_attention(q, k, v, head_num, input_layout="BNSD",
                                         atten_mask=atten_mask, scale=scale, keep_prob=1.0,
                                         sparse_mode=0)
    return res[0], res[1], res[2]


def npu_attention(q, k, v, q_pos, k_pos, causal, q_doc, k_doc, scale, *, window=None,
                  softcap=None, sinks=None, alibi_slopes=None, _fused=None,
                  _budget: int = MASK_BUDGET):
    """(out, lse float32) for NPU tensors; same contract as hyper_parallel.ops.attention.

    ``window`` joins the per-chunk mask. ``softcap`` is refused (``npu_fusion_attention`` has no
    score modifier), and so are ALiBi, ``sinks`` (they need an lse gradient this backend lacks) and a
    value head dim different from the qk head dim. ``_fused(q, k, v, head_num, atten_mask, scale) -> (out, softmax_max,
    softmax_sum)`` replaces ``torch_npu.npu_fusion_attention`` in tests.
    """
    if alibi_slopes is not None:
        raise NotImplementedError(
            "hyper_parallel.ops.attention: alibi_slopes (ALiBi) is not supported on NPU; use "
            "the CPU or CUDA backend")
    if v.shape[-1] != q.shape[-1]:
        raise NotImplementedError(
            "hyper_parallel.ops.attention: a value head dim different from the qk head dim "
            f"(v {v.shape[-1]} vs q {q.shape[-1]}, MLA) is not supported on NPU; use the CPU or "
            "CUDA backend")
    if sinks is not None:
        raise NotImplementedError(
            "hyper_parallel.ops.attention: sinks are not supported on NPU (they need a "
            "differentiable lse, which npu_fusion_attention does not give); use the CPU or CUDA "
            "backend")
    if softcap is not None:
        raise NotImplementedError(
            "hyper_parallel.ops.attention: softcap is not supported on NPU "
            "(torch_npu.npu_fusion_attention has no score modifier); use the CPU or CUDA backend")
    if _fused is None:
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise NotImplementedError(
                f"hyper_parallel.ops.attention on device '{q.device}' needs torch_npu") from exc
        _fused = _fused_npu
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    kp = _rows(k_pos, B)[:, None, None, :]
    kd = _rows(k_doc, B)[:, None, None, :] if q_doc is not None else None
    qp_all = _rows(q_pos, B)
    qd_all = _rows(q_doc, B) if q_doc is not None else None
    Qc = query_chunk(B, Sq, Sk, _budget)
    outs, lses = [], []
    for s in range(0, Sq, Qc):
        e = min(Sq, s + Qc)
        vis = torch.ones(B, 1, e - s, Sk, dtype=torch.bool, device=q.device)
        if causal:
            vis = vis & (kp <= qp_all[:, None, s:e, None])
        if window is not None:
            vis = vis & (kp > qp_all[:, None, s:e, None] - window)
        if kd is not None:
            vis = vis & (qd_all[:, None, s:e, None] == kd) & (kd >= 0)
        out, smax, ssum = _fused(q[:, :, s:e], k, v, Hq, ~vis, scale)
        seen = vis.any(-1)  # [B, 1, Qc]
        lse = (smax[..., 0] + torch.log(ssum[..., 0])).float().detach()
        lses.append(torch.where(seen, lse, torch.full_like(lse, float("-inf"))))
        outs.append(torch.where(seen[..., None], out, torch.zeros_like(out)))
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)
