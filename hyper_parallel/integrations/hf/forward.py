"""Model-forward wrapper and loss normalisation of a CP Trainer.

:func:`wrap_forward` replaces ``model.forward`` (instance attribute, the outermost module the
Trainer calls: a PEFT model, or the causal LM carrying TRL's fused head). It takes the
:class:`~.batch.CPMetaHolder` out of the inputs, makes its meta current (:mod:`.context`) and calls
the model with the local ``input_ids`` / global ``position_ids``. With TRL's fused head
(``fused_lm_head=True``) the local ``labels`` + ``shift_labels`` go to it (it scores
``shift_labels`` unshifted); otherwise the loss is the model's own ``loss_function`` on the local
logits with ``shift_labels`` (transformers passes a forward's extra kwargs down to every attention
call, where the CP attention refuses unknown ones). ``attention_mask`` is not passed (padding and documents are in the meta; HF's
local mask is never trusted under CP). Output: the model's own, on this rank's tokens
(logits ``[B, S_local, V]``; a loss over the local targets).

:func:`wrap_compute_loss` wraps ``trainer.compute_loss`` so that the loss each rank returns makes
the Trainer's own arithmetic (``num_items_in_batch``, the ``x num_processes`` loss scale of
``average_tokens_across_devices``, DDP's gradient *average* over all ``W = dp x cp`` ranks, the
mean of the gathered eval losses) give the CP=1 numbers. Each rank's loss is
``local_target_loss_sum / n`` with

* ``average_tokens_across_devices`` on, ``num_items_in_batch`` given: unchanged (the Trainer's
  count is the sum over all ranks of the local ``shift_labels`` counts = CP=1's count);
* on, ``num_items_in_batch`` None (evaluation, or no count): ``n = N_cp * W / cp`` with ``N_cp``
  the CP group's target count of this micro-batch (the Trainer/TRL then multiply by ``W``);
* off: ``n = (sum over the CP group of the given count, or N_cp) / cp``;

so ``sum over the CP group of the rank losses x (cp / W)`` — what DDP's average and the eval mean
do — is the CP group's global token mean, exactly as one rank computes it on the whole row.
One all-reduce over the CP group (``hyper_parallel.platform``) per call when the count changes.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ...platform import all_reduce
from .batch import META_KEY, CPMetaHolder
from .context import activate

_NOT_TO_MODEL = ("attention_mask", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def wrap_forward(model) -> None:
    """Install the CP forward on ``model`` (idempotent)."""
    if getattr(model, "_hyper_parallel_cp_forward", False):
        return
    inner = model.forward

    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        holder = kwargs.pop(META_KEY, None)
        if not isinstance(holder, CPMetaHolder):
            return inner(*args, **kwargs)
        activate(holder.meta)
        for key in _NOT_TO_MODEL:
            kwargs.pop(key, None)
        if kwargs.get("fused_lm_head"):     # TRL's fused head scores shift_labels itself, unshifted
            return inner(*args, **kwargs)
        # transformers hands the forward's **kwargs down to every attention call, where the CP
        # attention refuses what it does not know: the loss is computed here, by the model's own
        # loss function, on the local logits and the globally shifted local targets
        labels = kwargs.pop("labels", None)
        shift_labels = kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        out = inner(*args, **kwargs)
        if labels is not None and shift_labels is not None:
            vocab = base.config.get_text_config().vocab_size
            out.loss = base.loss_function(out.logits, labels, vocab, num_items_in_batch=num_items,
                                          shift_labels=shift_labels)
        return out

    model.forward = forward
    model._hyper_parallel_cp_forward = True


def _cp_target_count(inputs: dict, cp_group, device) -> torch.Tensor:
    target = inputs.get("shift_labels")
    local = torch.zeros((), dtype=torch.int64, device=device) if target is None else (target != -100).sum()
    return all_reduce(local.to(device=device, dtype=torch.int64).reshape(()), cp_group, op=dist.ReduceOp.SUM)


def wrap_compute_loss(trainer, cp_size: int, cp_group) -> None:
    """Install the loss normalisation of the module doc on ``trainer.compute_loss``."""
    inner = trainer.compute_loss
    world = trainer.args.world_size

    @functools.wraps(inner)
    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        holder = inputs.get(META_KEY)
        if isinstance(holder, CPMetaHolder):
            activate(holder.meta)
            device = inputs["input_ids"].device if "input_ids" in inputs else torch.device("cpu")
            if trainer.args.average_tokens_across_devices:
                if num_items_in_batch is None:
                    num_items_in_batch = _cp_target_count(inputs, cp_group, device) * world / cp_size
            else:
                n = (_cp_target_count(inputs, cp_group, device) if num_items_in_batch is None else
                     all_reduce(torch.as_tensor(num_items_in_batch, device=device).reshape(()), cp_group,
                                op=dist.ReduceOp.SUM))
                num_items_in_batch = n / cp_size
        return inner(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    trainer.compute_loss = compute_loss
