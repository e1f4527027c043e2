"""Exact tiled LM-head cross-entropy: ``lm_head`` + (softcap / scale) + cross-entropy in token chunks.

Contract (local logits and loss, never gathered):

``tiled_lm_loss(hidden [N, H], weight [V, H], bias [V] | None, targets [N] int64, *, ignore_index,
chunk_size, logit_scale=None, logit_divisor=None, softcap=None) -> loss [N] float32``

* per token ``t``: ``loss[t] = logsumexp(z_t) - z_t[targets[t]]`` with ``z_t = post(hidden[t] @ weight^T
  + bias).float()``, 0 where ``targets[t] == ignore_index``; ``post`` applies, in the logits' dtype and
  in this order, ``* logit_scale`` (Cohere), ``/ logit_divisor`` (Granite ``logits_scaling``) and
  ``softcap * tanh(x / softcap)`` (Gemma 2/3 ``final_logit_softcapping``) — the order and dtype of
  the transformers heads, so the value equals the untiled ``F.cross_entropy(post(lm_head(h)).float(),
  reduction="none")`` up to fp32 summation order;
* memory: at most one chunk of logits (``chunk_size x V`` in the logits' dtype plus its fp32 softmax)
  is alive at a time, in forward and in backward; the logsumexp (forward), the softmax and the
  post-processing's derivative (backward) run in place (one fp32 ``[chunk, V]`` buffer, plus the
  chunk's logits in a low-precision dtype and the tanh of a softcap)
  and accumulates ``d weight`` with ``addmm_`` (no ``[V, H]`` temporary when the dtypes agree);
  autograd saves only ``hidden``, ``weight``, ``bias`` and ``targets`` (no ``[N, V]`` tensor, no
  fp32 copy of the logits);
* autocast: backward recomputes and multiplies under the forward's autocast state (also when the
  training loop calls ``backward()`` outside the autocast region), so the logits of the recompute
  are the forward's;
* backward recomputes each chunk's logits and returns ``d hidden`` (``[N, H]``, hidden's dtype),
  ``d weight`` / ``d bias`` (accumulated over chunks in fp32, returned in the weight's dtype):
  ``d z = (softmax(z) - onehot(target)) * d loss[t]`` through ``post``'s derivative.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["tiled_lm_loss", "apply_head_post", "head_post"]


def head_post(model) -> dict:
    """The head post-processing transformers applies after ``lm_head``, as the keyword arguments of
    :func:`tiled_lm_loss` / :func:`apply_head_post` (``softcap``, ``logit_scale``, ``logit_divisor``),
    read from what the model declares (``final_logit_softcapping``, Cohere's ``logit_scale``,
    Granite's ``logits_scaling``)."""
    cfg = getattr(model, "config", None)
    text = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    post = {}
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        post["softcap"] = float(cap)
    scale = getattr(model, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "logit_scale", None) if type(model).__name__.startswith("Cohere") else None
    if scale is not None and not isinstance(scale, torch.Tensor):
        post["logit_scale"] = float(scale)
    div = getattr(text, "logits_scaling", None)
    if div is not None and float(div) != 1.0:
        post["logit_divisor"] = float(div)
    return post


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


def _logsumexp_(z: torch.Tensor) -> torch.Tensor:
    """``logsumexp(z, -1)`` of a ``[n, V]`` fp32 buffer **that it overwrites** (with ``exp(z - max)``):
    no ``[n, V]`` temporary, unlike ``torch.logsumexp``."""
    m = z.amax(dim=-1, keepdim=True)
    return (m + z.sub_(m).exp_().sum(dim=-1, keepdim=True).log_()).squeeze(1)


def _softmax_(z: torch.Tensor) -> torch.Tensor:
    """``softmax(z, -1)`` of a ``[n, V]`` fp32 buffer, computed in place (max-shifted) and returned."""
    z.sub_(z.amax(dim=-1, keepdim=True)).exp_()
    return z.div_(z.sum(dim=-1, keepdim=True))


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
            z_t = z.gather(1, safe[:, None]).squeeze(1)
            tok = _logsumexp_(z) - z_t
            out[s:s + chunk] = torch.where(valid, tok, torch.zeros_like(tok))
            del z
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.cfg = (ignore_index, chunk, scale, divisor, softcap)
        dev = hidden.device.type
        # the forward's autocast state: the backward's recompute and matmuls run under the same one
        ctx.amp = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets = ctx.saved_tensors
        dev, amp_on, amp_dtype = ctx.amp
        with torch.autocast(dev, dtype=amp_dtype, enabled=amp_on):
            return _TiledLMLoss._backward(ctx, grad_out, hidden, weight, bias, targets)

    @staticmethod
    def _backward(ctx, grad_out, hidden, weight, bias, targets):
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
            x = F.linear(h, weight, bias)               # a fresh buffer: the post-processing runs in place
            dtype = x.dtype
            if scale is not None:
                x.mul_(scale)
            if divisor is not None:
                x.div_(divisor)
            th = None
            if softcap is not None:
                th = x.div_(softcap).tanh_()
                x = th * softcap
            z = x.float()                               # fp32 logits: x itself
            del x
            valid = tgt != ignore_index
            # softmax(z) in place: one [chunk, V] buffer besides the tanh of a softcap
            dz = _softmax_(z)
            del z
            safe = torch.where(valid, tgt, torch.zeros_like(tgt))
            dz.scatter_add_(1, safe[:, None], torch.full_like(dz[:, :1], -1.0))
            dz.mul_((grad_out[s:s + chunk].float() * valid.float())[:, None])
            dx = dz.to(dtype)                           # autograd casts the fp32 grad back to the logits dtype
            del dz
            if softcap is not None:
                dx.mul_(th.mul_(th).neg_().add_(1))     # d(c tanh(x/c))/dx = 1 - tanh^2
                del th
            if divisor is not None:
                dx.div_(divisor)
            if scale is not None:
                dx.mul_(scale)
            if need_h:
                if dx.dtype == weight.dtype == gh.dtype:
                    torch.matmul(dx, weight, out=gh[s:s + chunk])
                else:
                    gh[s:s + chunk] = dx @ weight
            if need_w:
                if dx.dtype == gw.dtype:
                    gw.addmm_(dx.t(), h)                # no [V, H] temporary
                else:
                    gw.add_((dx.t() @ h).float())
            if need_b:
                gb.add_(dx.sum(0).float())
            del dx
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
