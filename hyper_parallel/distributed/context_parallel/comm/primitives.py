"""The shared CP collective primitives: the CP group of a mesh, the shape checks, and the
differentiable AllGather / ReduceScatter and AllToAll (even and uneven) every method builds on.

Every collective goes through :mod:`hyper_parallel.platform` on a group handed in by the caller (a
1-D ``DeviceMesh``, a cached ``ProcessGroup``, or ``None`` = a group of one: identity, no
collective). Nothing here creates a process group; shapes are checked before any collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .... import platform as P

__all__ = ["CPCollectiveError", "all_gather_seq", "all_reduce_sum_replicated", "group_desc", "resolve_group",
           "scale_grad"]


class CPCollectiveError(ValueError):
    """A CP collective was called with shapes or a group that do not fit (raised before any comm)."""


# ----------------------------------------------------------------------------- groups
def resolve_group(cp_mesh):
    """ProcessGroup (or None for size 1) behind ``cp_mesh``: a 1-D DeviceMesh, a group, or None."""
    if cp_mesh is None:
        return None
    if isinstance(cp_mesh, DeviceMesh):
        if cp_mesh.ndim != 1:
            raise CPCollectiveError(
                f"CP collectives need a 1-D DeviceMesh, got a {cp_mesh.ndim}-D mesh with dims "
                f"{cp_mesh.mesh_dim_names}: pass mesh[dim_name] or its cached group"
            )
        return cp_mesh.get_group()
    if isinstance(cp_mesh, dist.ProcessGroup):
        return cp_mesh
    raise CPCollectiveError(
        f"expected a 1-D DeviceMesh, a ProcessGroup or None for the CP group, got {type(cp_mesh).__name__}"
    )


def group_desc(group) -> str:
    """Human-readable ``group(size=W, ranks=[...])`` for error messages (no communication)."""
    if group is None:
        return "group(size=1)"
    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - description only
        ranks = "?"
    return f"group(size={P.group_size(group)}, ranks={ranks})"


def check_dim(x: torch.Tensor, dim: int, what: str, fn: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise CPCollectiveError(f"{fn}: {what} must be a tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise CPCollectiveError(f"{fn}: {what} has shape {tuple(x.shape)}, no dim {dim}")
    return dim % x.dim()


def check_divisible(x: torch.Tensor, dim: int, world: int, what: str, dim_name: str, group, fn: str):
    if x.shape[dim] % world:
        raise CPCollectiveError(
            f"{fn}: {what} {dim_name} dim {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) is not "
            f"divisible by the size {world} of {group_desc(group)}"
        )


# ----------------------------------------------------------------------------- autograd functions
class _AllGather(torch.autograd.Function):
    """fwd: AllGather along ``dim``; bwd: ReduceScatter(sum) of the gathered gradient."""

    @staticmethod
    def forward(ctx, x, group, dim, tag):
        ctx.group, ctx.dim, ctx.tag = group, dim, tag
        return P.all_gather(x, group, dim=dim, tag=tag)

    @staticmethod
    def backward(ctx, grad):
        return P.reduce_scatter(grad, ctx.group, dim=ctx.dim, tag=ctx.tag + ".bwd"), None, None, None


class KVAllGather(torch.autograd.Function):
    """fwd: AllGather K and V (both launched before either is waited); bwd: two ReduceScatters."""

    @staticmethod
    def gather(k, v, group, dim, tag="cp.allgather"):
        hk = P.all_gather(k, group, dim=dim, async_op=True, tag=tag + "_k")
        hv = P.all_gather(v, group, dim=dim, async_op=True, tag=tag + "_v")
        return hk.wait(), hv.wait()

    @staticmethod
    def forward(ctx, k, v, group, dim):
        ctx.group, ctx.dim = group, dim
        return KVAllGather.gather(k, v, group, dim)

    @staticmethod
    def backward(ctx, gk, gv):
        hk = P.reduce_scatter(gk.contiguous(), ctx.group, dim=ctx.dim, async_op=True,
                              tag="cp.allgather_k.bwd")
        hv = P.reduce_scatter(gv.contiguous(), ctx.group, dim=ctx.dim, async_op=True,
                              tag="cp.allgather_v.bwd")
        return hk.wait(), hv.wait(), None, None


class AllToAll(torch.autograd.Function):
    """fwd: all_to_all(scatter_dim -> gather_dim); bwd: all_to_all(gather_dim -> scatter_dim).

    The all-to-all is a permutation of equal chunks, so its adjoint is its inverse: split the
    gradient along ``gather_dim`` and reassemble along ``scatter_dim``.
    """

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, tag):
        ctx.group, ctx.sd, ctx.gd, ctx.tag = group, scatter_dim, gather_dim, tag
        return P.all_to_all(x, group, scatter_dim=scatter_dim, gather_dim=gather_dim, tag=tag)

    @staticmethod
    def backward(ctx, grad):
        out = P.all_to_all(grad, ctx.group, scatter_dim=ctx.gd, gather_dim=ctx.sd, tag=ctx.tag + ".bwd")
        return out, None, None, None, None


class AllToAllUneven(torch.autograd.Function):
    """fwd: sparse piece permutation (``send_counts`` -> ``recv_counts``); bwd: the inverse
    permutation of the gradient (counts swapped). ``piece``: as ``platform.all_to_all_uneven``."""

    @staticmethod
    def forward(ctx, x, group, send_counts, recv_counts, dim, tag, piece=None):
        ctx.args = (group, recv_counts, send_counts, dim, tag + ".bwd", piece)
        return P.all_to_all_uneven(x, group, send_counts, recv_counts, dim, tag=tag, piece=piece)

    @staticmethod
    def backward(ctx, grad):
        group, send, recv, dim, tag, piece = ctx.args
        return (P.all_to_all_uneven(grad.contiguous(), group, send, recv, dim, tag=tag, piece=piece),
                None, None, None, None, None, None)



def all_gather_seq(x: torch.Tensor, cp_mesh, dim: int = 1, tag: str = "cp.allgather") -> torch.Tensor:
    """Differentiable AllGather of one tensor along ``dim`` (bwd: ReduceScatter sum)."""
    group = resolve_group(cp_mesh)
    d = check_dim(x, dim, "x", "all_gather_seq")
    if P.group_size(group) == 1:
        return x
    return _AllGather.apply(x, group, d, tag)


# ----------------------------------------------------------------------------- gradient scale
class _ScaleGrad(torch.autograd.Function):
    """fwd: identity; bwd: the gradient times ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` unchanged forward, ``factor x`` its gradient backward: where a rank's share of a gradient
    must count ``factor`` times in a reduction that averages (EP's expert gradients, a replicated aux
    loss under DDP's average)."""
    return _ScaleGrad.apply(x, float(factor))


# ----------------------------------------------------------------------------- replicated sums
class _AllReduceSumReplicated(torch.autograd.Function):
    """fwd: SUM all-reduce; bwd: identity (see :func:`all_reduce_sum_replicated`)."""

    @staticmethod
    def forward(ctx, x, group, tag):
        return P.all_reduce(x, group, op=dist.ReduceOp.SUM, tag=tag)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def all_reduce_sum_replicated(x: torch.Tensor, group, tag: str = "cp.all_reduce_replicated") -> torch.Tensor:
    """Differentiable SUM of per-rank partial sums ``x`` over ``group`` whose result feeds a loss
    that every rank of the group computes **identically** (a replicated loss).

    fwd: ``y = sum_r x_r`` (every rank). bwd: ``dx_r = dy`` (identity, no communication): each
    rank's upstream ``dy`` already is the full derivative of the replicated loss, so the gradient
    of ``x_r`` is exactly ``dy``; the trainer's gradient reduction (SUM / FSDP average with its
    grad_scale) then adds the ranks' parameter contributions once. (A SUM all-reduce in backward
    would count the loss ``group size`` times.) ``group``: a 1-D DeviceMesh, a ProcessGroup or
    None (size 1: identity, no collective).
    """
    if not isinstance(x, torch.Tensor):
        raise CPCollectiveError(f"all_reduce_sum_replicated: x must be a tensor, got {type(x).__name__}")
    group = resolve_group(group)
    if P.group_size(group) == 1:
        return x
    return _AllReduceSumReplicated.apply(x.contiguous(), group, tag)
