"""Expert parallelism on one experts module: its experts split over the EP group, routed token rows
sent to the rank that holds their expert and back (dropless, exact). docs/expert_parallel.md.

Layout: on EP rank ``r`` of ``ep`` ranks, every per-expert parameter becomes a DTensor on the EP mesh
(``Shard(0)``: global shape ``[E, ...]``, local rows ``[r*E/ep, (r+1)*E/ep)``), so checkpoints and
the trainer's materialisation see the global tensor.

Forward ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``:
the ``T*k`` (token, choice) rows are sorted by expert (stable), counted per destination rank, and
exchanged by one uneven all-to-all (counts first, one more all-to-all); the receiving rank runs the
module's own forward on its local experts (each row with its local expert id and weight 1) and
returns the rows by the inverse all-to-all; the source unsorts them, multiplies by its routing
weights and sums the ``k`` choices. Every collective goes through ``platform``.

Backward: the reverse exchanges (``AllToAllUneven``). Expert-parameter gradients come out divided by
``ep`` (the input gradients are not): averaging them over the ranks that hold the same experts
(``ep_replicate``, what FSDP2 on that mesh does) then gives the mean over all dense ranks, the same
factor every dense parameter gets. A rank that receives no rows still joins both backward exchanges
and gets zero expert gradients (never None), so no rank skips a collective.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ... import platform as P
from ..context_parallel.comm.primitives import AllToAllUneven, scale_grad
from .targets import EPTarget


def shard_experts(module: nn.Module, target: EPTarget, ep_mesh) -> None:
    """Replace each per-expert parameter with a DTensor holding this EP rank's experts (meta stays meta)."""
    from torch.distributed.tensor import DTensor, Shard

    ep = ep_mesh.size()
    r = ep_mesh.get_local_rank()
    n_local = target.num_experts // ep
    for name in target.params:
        p = getattr(module, name)
        local = p.detach()[r * n_local:(r + 1) * n_local].clone()
        dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
        setattr(module, name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _local_params(module: nn.Module, names: tuple) -> dict:
    out = {}
    for name in names:
        p = module._parameters[name]
        out[name] = p.to_local() if hasattr(p, "to_local") else p
    return out


def _run_local_experts(module, original, names, n_local, x, experts, ones):
    """The module's own forward on rows ``x`` of its local experts (ids ``experts``, weight 1)."""
    saved = {name: module._parameters[name] for name in names}
    saved_n = module.num_experts
    try:
        module._parameters.update(_local_params(module, names))
        module.num_experts = n_local
        return original(module, x, experts.unsqueeze(1), ones)
    finally:
        module._parameters.update(saved)
        module.num_experts = saved_n


def ep_forward(module: nn.Module, target: EPTarget, ep_mesh):
    """The EP forward for ``module`` (installed as its ``forward``; see the module docstring)."""
    original = type(module).forward
    names = target.params
    ep = ep_mesh.size()
    group = ep_mesh.get_group()
    n_local = target.num_experts // ep
    arg_names = target.args

    def forward(*args, **kwargs):
        bound = dict(zip(arg_names, args))
        bound.update({k: kwargs.pop(k) for k in arg_names if k in kwargs})
        if kwargs or len(bound) != 3:
            raise TypeError(f"{target.fqn}: the EP experts forward takes ({', '.join(arg_names)}), got extra "
                            f"{sorted(kwargs)}")
        hidden, index, weights = (bound[k] for k in arg_names)
        t, h = hidden.shape
        k = index.shape[1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts = flat.index_select(0, order)
        dest = torch.div(experts, n_local, rounding_mode="floor")
        send = torch.bincount(dest, minlength=ep)
        recv = P.all_to_all(send, group, scatter_dim=0, gather_dim=0, tag="ep.counts")
        send_l, recv_l = send.tolist(), recv.tolist()
        rows = hidden.index_select(0, torch.div(order, k, rounding_mode="floor"))
        x = AllToAllUneven.apply(rows, group, send_l, recv_l, 0, "ep.dispatch", 1)
        local_ids = P.all_to_all_uneven(experts - dest * n_local, group, send_l, recv_l, 0, tag="ep.dispatch_ids",
                                        piece=1)
        x = scale_grad(x, ep)
        ones = weights.new_ones(x.shape[0], 1)
        y = _run_local_experts(module, original, names, n_local, x, local_ids, ones)
        if x.shape[0] == 0:    # no rows here: keep the backward exchanges and the expert gradients on this rank
            params = _local_params(module, names).values()
            y = y + (x.sum() + sum(p.sum() for p in params)) * 0
        y = scale_grad(y, 1.0 / ep)
        back = AllToAllUneven.apply(y, group, recv_l, send_l, 0, "ep.combine", 1)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        slots = back.index_select(0, inverse).view(t, k, h)
        return (slots * weights.unsqueeze(-1)).to(hidden.dtype).sum(dim=1)

    forward.__hp_ep__ = target.fqn
    return forward
