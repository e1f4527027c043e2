"""Gradient utilities of the step: full copies, the global gradient norm, flat SUM reduction.

Every function works on plain tensors and on DTensors (FSDP2 / TP shards). Functions that
touch DTensors may run collectives (``full_tensor``): every rank of the tensor's mesh must call
them in the same order. Collectives go through :mod:`hyper_parallel.platform` or DTensor.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..platform import all_reduce

__all__ = ["clean_param_name", "is_dtensor", "full_copy", "named_full", "clip_grad_norm_global",
           "sum_grads_in_place"]


def clean_param_name(name: str) -> str:
    """The HF parameter name without activation-checkpoint / FSDP / compile wrapper prefixes."""
    for wrapped in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapped, "")
    return name


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_copy(t: torch.Tensor) -> torch.Tensor:
    """A full, plain, detached copy (collective for DTensors: every rank must call in the same order)."""
    if is_dtensor(t):
        t = t.full_tensor()
    return t.detach().clone()


def named_full(model: torch.nn.Module, what: str) -> dict:
    """``{clean name: full fp32 CPU copy}`` of every parameter (``what="param"``) or of every
    existing gradient (``what="grad"``); collective for DTensors (see :func:`full_copy`)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if what == "grad" else p
        if t is None:
            continue
        out[clean_param_name(name)] = full_copy(t).float().cpu()
    return out


def _norm64(grads: list) -> torch.Tensor:
    """The 2-norm of ``grads`` accumulated in float64 (a DTensor result keeps its placements: the caller
    reduces it). torch's float32 norm of a large gradient (an LM head's) is off by up to ~1e-4 relative
    and by a different amount for each sharding, which made the clipping coefficient depend on the CP
    size; in float64 the rounding is ~1e-16."""
    norms = [torch.linalg.vector_norm(g, 2, dtype=torch.float64) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), 2)


def clip_grad_norm_global(parameters, max_norm: float | None, foreach: bool | None = None, *,
                          across=None) -> torch.Tensor:
    """Clip by the global 2-norm over every gradient; return the (pre-clip) total norm (float32).

    The norm is accumulated in float64 (:func:`_norm64`), so it is the same number at every sharding;
    the coefficient is ``torch.nn.utils.clip_grad_norm_``'s, ``min(1, max_norm / (norm + 1e-6))``.
    DTensors (FSDP/TP): norms are computed per (mesh, placements) group and reduced with
    ``full_tensor()``, so shards are summed and replicas counted once — the norm of the full
    gradient, identical on all ranks. Plain tensors are taken as replicated (each rank holds all of
    them). ``across`` (a mesh or group: the pipeline's stages): the squared norms of the ranks there
    are summed, each holding different parameters. ``foreach`` is accepted for the config's sake (the
    float64 norms are per tensor).
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    groups: dict = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if is_dtensor(g) else ("local",)
        groups.setdefault(key, []).append(g)
    squares = []
    for key in sorted(groups, key=str):
        norm = _norm64(groups[key])
        if is_dtensor(norm):
            norm = norm.full_tensor()
        squares.append(norm ** 2)
    device = grads[0].device if grads else None
    total_sq = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=device)
    if across is not None:
        total_sq = all_reduce(total_sq, across.get_group() if hasattr(across, "get_group") else across)
    total = total_sq.sqrt()
    if max_norm is not None:
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total.float()


def sum_grads_in_place(grads: list, group) -> None:
    """SUM-all-reduce ``grads`` (local shards of DTensor grads) over ``group`` in one flat
    collective (platform ``all_reduce``); no-op for an empty list."""
    if not grads:
        return
    local = [g.to_local() if is_dtensor(g) else g for g in grads]
    flat = all_reduce(torch.cat([g.reshape(-1) for g in local]), group, op=dist.ReduceOp.SUM)
    offset = 0
    for g in local:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
