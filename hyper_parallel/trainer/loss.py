"""Loss contract: local sums in, global mean out.

Every rank computes, on its own tokens only,

  local_loss_sum      sum of token cross-entropy over its local ``shift_labels`` (fp32)
  local_valid_tokens  number of local targets != ignore_index

and :func:`mean_global_loss` turns them into

  loss        differentiable: ``local_loss_sum / N_global * grad_scale`` (what backward uses)
  loss_value  detached global mean ``sum_r local_loss_sum_r / N_global`` (what is logged)

with ``N_global = sum_r local_valid_tokens_r`` over ``dp_cp_mesh`` — each CP rank holds a
disjoint shard of the sequence, so every token is counted exactly once; TP replicas live in
different ``dp_cp`` groups and are never counted twice.

``grad_scale`` matches the gradient reduction that follows backward. FSDP2 *averages*
gradients over its mesh (``dp_shard x cp``, times ``dp_replicate`` for HSDP), so the trainer
passes ``grad_scale = fsdp mesh size``: then ``sum_r grad_r / size = d(global mean)/d(theta)``.
A plain SUM all-reduce of gradients uses ``grad_scale = 1``. With CP=1 and one rank the loss is
``local_loss_sum / N``, bit for bit the Hugging Face ``ForCausalLMLoss`` with
``num_items_in_batch = N``.

Collectives go through :mod:`hyper_parallel.platform` only.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..platform import all_reduce


@dataclasses.dataclass
class GlobalLoss:
    loss: torch.Tensor                 # differentiable, scaled for backward
    loss_value: torch.Tensor | None    # detached global mean (None when reduce_value=False)
    global_valid_tokens: torch.Tensor  # int64 scalar, identical on every rank of dp_cp_mesh
    local_valid_tokens: torch.Tensor   # int64 scalar


def _group(mesh):
    if mesh is None or not dist.is_initialized():
        return None
    return mesh.get_group()


def token_loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int = -100):
    """(sum of token CE in fp32, number of valid targets) for logits ``[..., V]``."""
    if hasattr(logits, "full_tensor"):  # a replicated DTensor (TP without loss_parallel)
        logits = logits.full_tensor()
    flat = logits.float().reshape(-1, logits.shape[-1])
    target = shift_labels.reshape(-1).to(flat.device)
    loss_sum = F.cross_entropy(flat, target, ignore_index=ignore_index, reduction="sum")
    valid = (target != ignore_index).sum()
    return loss_sum, valid


def global_token_count(local_valid_tokens, dp_cp_mesh, device=None) -> torch.Tensor:
    """Sum of valid tokens over ``dp_cp_mesh`` (int64 scalar on ``device``: the collective
    backend's device, e.g. CUDA for NCCL)."""
    local = torch.as_tensor(local_valid_tokens, dtype=torch.int64, device=device).reshape(())
    return all_reduce(local, _group(dp_cp_mesh), op=dist.ReduceOp.SUM)


def mean_global_loss(local_loss_sum: torch.Tensor, local_valid_tokens, dp_cp_mesh, *,
                     grad_scale: float = 1.0, global_valid_tokens=None,
                     reduce_value: bool = True) -> GlobalLoss:
    """Global token-mean loss over ``dp_cp_mesh`` (see module doc).

    ``global_valid_tokens`` may be given precomputed — gradient accumulation passes the total
    over *all* micro-batches of the step, so the step normalizes exactly like CP=1 with one
    big batch. ``reduce_value=False`` skips the logging all-reduce (the trainer reduces the
    summed value once per step instead).
    """
    device = local_loss_sum.device
    local_tokens = torch.as_tensor(local_valid_tokens, dtype=torch.int64, device=device).reshape(())
    if global_valid_tokens is None:
        n_global = global_token_count(local_tokens, dp_cp_mesh, device)
    else:
        n_global = torch.as_tensor(global_valid_tokens, dtype=torch.int64, device=device).reshape(())
    denom = n_global.clamp(min=1).to(device=local_loss_sum.device, dtype=local_loss_sum.dtype)
    loss = local_loss_sum / denom
    if grad_scale != 1:
        loss = loss * grad_scale
    value = None
    if reduce_value:
        value = reduce_loss_value(local_loss_sum.detach(), n_global, dp_cp_mesh)
    return GlobalLoss(loss, value, n_global, local_tokens)


def reduce_loss_value(local_loss_sum: torch.Tensor, global_valid_tokens, dp_cp_mesh) -> torch.Tensor:
    """Detached global mean: all-reduce(SUM) of the local loss sums / global token count."""
    total = all_reduce(local_loss_sum.detach().float().reshape(()), _group(dp_cp_mesh), op=dist.ReduceOp.SUM)
    n = torch.as_tensor(global_valid_tokens, dtype=torch.int64, device=total.device).clamp(min=1)
    return total / n.to(total.dtype)
