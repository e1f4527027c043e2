"""Eval-loss gathering of a CP Trainer.

The Trainer's evaluation loop gathers each rank's per-batch loss (``loss.repeat(batch_size)``,
``[b]``) with ``trainer.gather_function`` (accelerate's ``gather_for_metrics``: every rank, then
the dataset's remainder cut off the last batch, as if every rank held different rows) and
averages. Under CP the ranks of one group hold the same rows, and their losses are arranged by
:mod:`.forward` so that their mean is the group's exact loss. :func:`install_eval_gather` sets
``gather_function`` to: mean over the CP group (all-reduce), then gather over the data-parallel
group only (``[b x dp]``), then accelerate's remainder cut, which is in data-parallel terms
because the dataloaders shard by DP rank (:mod:`.data`). Loss-only evaluation: compute_metrics is
refused at cp > 1 (:mod:`.checks`), so nothing else goes through it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...platform import all_gather, all_reduce


def install_eval_gather(trainer, cp_size: int, cp_group, dp_group) -> None:
    """Replace ``trainer.gather_function`` (module doc)."""
    accelerator = trainer.accelerator

    def gather(tensor):
        if not torch.is_tensor(tensor):
            return accelerator.gather_for_metrics(tensor)
        t = tensor.reshape(-1) if tensor.dim() == 0 else tensor
        t = all_reduce(t.float().contiguous(), cp_group, op=dist.ReduceOp.SUM) / cp_size
        data = all_gather(t, dp_group, dim=0)
        state = accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = data[: state.remainder]
        return data

    trainer.gather_function = gather
