"""The halo exchange: ``x [B, L, H] -> [B, h + L, H]`` with the previous CP rank's last ``h`` tokens in
front (rank 0: zeros; one ring all-to-all); backward returns the halo's gradient to its owner. Used by
every method around a causal conv (``mixers/halo.py``, ``mixers/state_passing.py``)."""
from __future__ import annotations

import torch

from .... import platform as P
from .primitives import resolve_group

__all__ = ["halo_exchange"]


class _HaloCat(torch.autograd.Function):
    """fwd: ``x [B, L, H] -> [B, h + L, H]``: the previous CP rank's last ``h`` tokens, then ``x``
    (rank 0: zeros, never used as a real input). One ring ``all_to_all_uneven`` (rank r sends its
    tail to r+1; the last rank's tail goes to rank 0, which discards it).
    bwd: the halo's gradient goes back to the previous rank (the inverse ring) and is added to the
    gradient of its last ``h`` tokens."""

    @staticmethod
    def forward(ctx, x, group, h):
        world, me = P.group_size(group), P.group_rank(group)
        ctx.group, ctx.h = group, h
        send = [1 if d == (me + 1) % world else 0 for d in range(world)]
        recv = [1 if s == (me - 1) % world else 0 for s in range(world)]
        halo = P.all_to_all_uneven(x[:, -h:].contiguous(), group, send, recv, dim=1, tag="cp.mixer_halo")
        if me == 0:
            halo = torch.zeros_like(halo)
        return torch.cat([halo, x], dim=1)

    @staticmethod
    def backward(ctx, grad):
        group, h = ctx.group, ctx.h
        world, me = P.group_size(group), P.group_rank(group)
        g_halo = grad[:, :h].contiguous()
        if me == 0:
            g_halo = torch.zeros_like(g_halo)
        send = [1 if d == (me - 1) % world else 0 for d in range(world)]
        recv = [1 if s == (me + 1) % world else 0 for s in range(world)]
        back = P.all_to_all_uneven(g_halo, group, send, recv, dim=1, tag="cp.mixer_halo.bwd")
        gx = grad[:, h:].clone()
        if me != world - 1:
            gx[:, -h:] += back
        return gx, None, None


def halo_exchange(x: torch.Tensor, cp_mesh, h: int) -> torch.Tensor:
    """``[B, L, H] -> [B, h + L, H]`` with the previous CP rank's last ``h`` tokens in front (rank 0:
    zeros); differentiable (the halo's gradient returns to its owner). Identity cat for cp 1."""
    group = resolve_group(cp_mesh)
    if h == 0:
        return x
    if P.group_size(group) == 1:
        return torch.cat([x.new_zeros(x.shape[0], h, *x.shape[2:]), x], dim=1)
    return _HaloCat.apply(x, group, h)
