"""TP partial gradients: parameters replicated over TP whose per-rank gradient is a partial sum.

Example: Qwen3 ``q_norm`` / ``k_norm`` act on the TP-local heads only, so each TP rank's
gradient covers its heads; the full gradient is the SUM over the tp group. The sharding applier
names them in ``TPGradInfo.partial_grad``.
"""
from __future__ import annotations

import torch.nn as nn

from .grad_utils import sum_grads_in_place

__all__ = ["tp_partial_params", "sync_tp_partial_grads"]


def tp_partial_params(model: nn.Module, plan, tp_grad_info) -> list:
    """The parameters of ``model`` listed in ``tp_grad_info.partial_grad`` ([] without TP)."""
    if plan is None or plan.tp_size == 1 or tp_grad_info is None:
        return []
    params = dict(model.named_parameters())
    return [params[n] for n in tp_grad_info.partial_grad if n in params]


def sync_tp_partial_grads(params: list, tp_mesh) -> None:
    """SUM over ``tp_mesh``'s group the existing gradients of ``params`` (one flat all-reduce,
    none when ``params`` is empty)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        sum_grads_in_place(grads, tp_mesh.get_group())
