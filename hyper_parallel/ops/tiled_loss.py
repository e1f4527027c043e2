"""Exact tiled LM-head cross-entropy: ``lm_head`` + (softcap / scale) + cross-entropy in token chunks.

Contract (issue 14 item 1, design 4.6 "local logits/loss, never gathered"):

``tiled_lm_loss(hidden [N, H], weight [V, H], bias [V] | None, targets [N] int64, *, ignore_index,
chunk_size, logit_scale=None, logit_divisor=None, softcap=None) -> loss [N] float32``

* per token ``t``: ``loss[t] = logsumexp(z_t) - z_t[targets[t]]`` with ``z_t = post(hidden[t] @ weight^T
  + bias).float()``, 0 where ``targets[t] == ignore_index``; ``post`` applies, in the logits' dtype and
  in this order, ``* logit_scale`` (Cohere), ``/ logit_divisor`` (Granite ``logits_scaling``) and
  ``softcap * tanh(x / softcap)`` (Gemma 2/3 ``final_logit_softcapping``) — the order and dtype of
  the transformers heads, so the value equals the untiled ``F.cross_entropy(post(lm_head(h)).float(),
  reduction="none")`` up to fp32 summation order;
* memory: at most one chunk of logits (``chunk_size x V`` in the logits' dtype plus its fp32 softmax)
  is alive at a time, in forward and in backward; autograd saves only ``hidden``, ``weight``,
  ``bias`` and ``targets`` (no ``[N, V]`` tensor, no fp32 copy of the logits);
* backward recomputes each chunk's logits and returns ``d hidden`` (``[N, H]``, hidden's dtype),
  ``d weight`` / ``d bias`` (accumulated over chunks in fp32, returned in the weight's dtype):
  ``d z = (softmax(z) - onehot(target)) * d loss[t]`` through ``post``'s derivative.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["tiled_lm_loss", "apply_head_post"]


def apply_head_post(logits: torch.Tensor, scale=None, divisor=None, softcap=None) -> torch.Tensor:
    """The LM-head post-processing of the module doc, in ``logits``' dtype and in transformers'
    order: ``* scale``, ``/ divisor``, ``softcap * tanh(x / softcap)`` (None = skipped)."""
    if scale is not None:
        logits = logits * scale
    if divisor is not None:
        logits = logits / divisor
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


class _TiledLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, chunk, scale, divisor, softcap):
        N = hidden.shape[0]
        out = torch.zeros(N, dtype=torch.float32, device=hidden.device)
        for s in range(0, N, chunk):
            tgt = targets[s:s + chunk]
            z = apply_head_post(F.linear(hidden[s:s + chunk], weight, bias), scale, divisor, softcap).float()
            valid = tgt != ignore_index
            safe = torch.where(valid, tgt, torch.zeros_like(tgt))
            tok = torch.logsumexp(z, dim=-1) - z.gather(1, safe[:, None]).squeeze(1)
            out[s:s + chunk] = torch.where(valid, tok, torch.zeros_like(tok))
            del z
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.cfg = (ignore_index, chunk, scale, divisor, softcap)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets = ctx.saved_tensors
        ignore_index, chunk, scale, divisor, softcap = ctx.cfg
        N = hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], \
            bias is not None and ctx.needs_input_grad[2]
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, N, chunk):
            h = hidden[s:s + chunk]
            tgt = targets[s:s + chunk]
            logits = F.linear(h, weight, bias)
            x = logits
            if scale is not None:
                x = x * scale
            if divisor is not None:
                x = x / divisor
            th = None
            if softcap is not None:
                th = torch.tanh(x / softcap)
                x = th * softcap
            z = x.float()
            valid = tgt != ignore_index
            dz = torch.softmax(z, dim=-1)
            safe = torch.where(valid, tgt, torch.zeros_like(tgt))
            dz.scatter_add_(1, safe[:, None], torch.full_like(dz[:, :1], -1.0))
            dz.mul_((grad_out[s:s + chunk].float() * valid.float())[:, None])
            dx = dz.to(logits.dtype)                    # autograd casts the fp32 grad back to the logits dtype
            del z, dz
            if softcap is not None:
                dx = dx * (1 - th * th)
            if divisor is not None:
                dx = dx / divisor
            if scale is not None:
                dx = dx * scale
            if need_h:
                gh[s:s + chunk] = dx @ weight
            if need_w:
                gw.add_((dx.t() @ h).float())
            if need_b:
                gb.add_(dx.sum(0).float())
        return (gh, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype),
                None, None, None, None, None, None)


def tiled_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                  *, ignore_index: int = -100, chunk_size: int = 256, logit_scale: Optional[float] = None,
                  logit_divisor: Optional[float] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """Per-token cross-entropy of ``post(hidden @ weight^T + bias)``, tiled over tokens (module doc)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"tiled_lm_loss: hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"tiled_lm_loss: targets {tuple(targets.shape)} must be [N={hidden.shape[0]}]")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"tiled_lm_loss: bias {tuple(bias.shape)} must be [V={weight.shape[0]}]")
    if int(chunk_size) < 1:
        raise ValueError(f"tiled_lm_loss: chunk_size must be >= 1, got {chunk_size}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"tiled_lm_loss: softcap must be > 0, got {softcap}")
    return _TiledLMLoss.apply(hidden, weight, bias, targets.to(torch.int64), int(ignore_index), int(chunk_size),
                              logit_scale, logit_divisor, softcap)
