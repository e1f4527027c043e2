"""Exact tiled MLP: a token-wise module applied in sequence chunks, recomputed chunk by chunk in backward.

Contract (the tiled MLP of Arctic Long Sequence Training):

``tiled_mlp(fn, x [B, S, H], params, *, chunk_size) -> y [B, S, H_out]``

* ``fn`` must be *token-wise*: ``fn(x)[:, s]`` depends on ``x[:, s]`` only (a gated MLP, an
  activation, a linear). Then ``y`` equals ``fn(x)`` up to rounding: the same arithmetic on the
  same rows, but a GEMM over fewer rows may block its reductions differently, and the parameter
  gradients of the chunks are summed in fp32 or wider (tests: fp32 relative error <= 2e-6, float64 1e-13);
* memory: forward runs ``fn`` under ``no_grad`` one chunk at a time, so the intermediates of at
  most one chunk (``chunk_size x intermediate``) are alive and autograd saves only ``x`` (not the
  ``[B, S, intermediate]`` activations the untiled MLP keeps for backward);
* backward recomputes each chunk with grad enabled and returns ``d x`` (chunk by chunk) and the
  gradient of every tensor in ``params`` (summed over chunks in fp32 or the parameter's wider
  dtype, returned in its dtype):
  ``params`` must be exactly the tensors ``fn`` reads that need a gradient — they are passed
  through the autograd function so that whoever owns them (plain parameters, FSDP2's unsharded
  parameters) receives the gradient through ordinary autograd accumulation.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["tiled_mlp"]


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunk, x, *params):
        S = x.shape[1]
        with torch.no_grad():
            out = torch.cat([fn(x[:, s:s + chunk]) for s in range(0, S, chunk)], dim=1)
        ctx.fn, ctx.chunk = fn, chunk
        ctx.save_for_backward(x, *params)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        fn, chunk = ctx.fn, ctx.chunk
        need_x = ctx.needs_input_grad[2]
        want = [p for p, need in zip(params, ctx.needs_input_grad[3:]) if need]
        gx = torch.empty_like(x) if need_x else None
        acc = [torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device) for p in want]
        for s in range(0, x.shape[1], chunk):
            xc = x[:, s:s + chunk].detach().requires_grad_(need_x)
            with torch.enable_grad():
                y = fn(xc)
            inputs = ([xc] if need_x else []) + want
            grads = torch.autograd.grad(y, inputs, grad_out[:, s:s + chunk], allow_unused=True)
            if need_x:
                gx[:, s:s + chunk] = grads[0]
                grads = grads[1:]
            for a, g in zip(acc, grads):
                if g is not None:
                    a.add_(g)
            del y, grads
        it = iter(a.to(p.dtype) for a, p in zip(acc, want))
        gparams = [next(it) if need else None for need in ctx.needs_input_grad[3:]]
        return (None, None, gx, *gparams)


def tiled_mlp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor], *,
              chunk_size: int) -> torch.Tensor:
    """``fn(x)`` computed in chunks of ``chunk_size`` tokens along dim 1 (module doc)."""
    if x.dim() != 3:
        raise ValueError(f"tiled_mlp: x must be [B, S, H], got {tuple(x.shape)}")
    if int(chunk_size) < 1:
        raise ValueError(f"tiled_mlp: chunk_size must be >= 1, got {chunk_size}")
    if x.shape[1] <= chunk_size or not (x.requires_grad or any(p.requires_grad for p in params)):
        return fn(x)   # one chunk, or nothing to save for backward: the plain call is the same
    return _TiledMLP.apply(fn, int(chunk_size), x, *params)
