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

An MoE model whose config sets ``output_router_logits`` gets its router load-balancing loss over the
CP group's whole micro-batch in TRL's SFTTrainer (:class:`CPRouterLoss`, the trainer's
``router_loss`` statistics with one differentiable all-reduce), not over a shard.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from ...distributed.context_parallel.comm import scale_grad
from ...platform import all_reduce
from .batch import META_KEY, CPMetaHolder
from .context import activate

_NOT_TO_MODEL = ("attention_mask", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class CPRouterLoss:
    """The MoE router load-balancing loss of the CP group's whole micro-batch in TRL's SFTTrainer, in
    place of the shard's own: the trainer's ``router_loss`` statistics and one differentiable
    all-reduce over ``cp_group``, so every CP rank holds the ``aux`` one rank computes on its rows.

    TRL's fused head computes ``aux_loss`` with Mixtral's ``load_balancing_loss_func`` (imported at
    call time) and adds ``coef x aux_loss / GA`` to a token loss it multiplies by the ``W`` ranks. While
    the forward runs, that function returns the CP group's aux with ``cp`` times its gradient: every
    CP rank adds it, the group's gradients sum to its gradient (identity backward), and DDP's average
    over ``W = cp x W_1`` ranks then gives CP=1's average over ``W_1``. In evaluation TRL divides by GA
    only because :func:`wrap_compute_loss` supplies the count CP=1 does not have: the value is
    multiplied back (``eval_steps``)."""

    def __init__(self, spec, cp_group, cp_size: int, eval_steps):
        self.spec, self.group, self.cp, self.eval_steps = spec, cp_group, cp_size, eval_steps

    def aux(self, router_logits, meta, device):
        from types import SimpleNamespace

        from ...trainer.router_loss import local_router_stats, router_aux_from_stats, valid_input_mask

        mask = valid_input_mask(SimpleNamespace(meta=meta), device)
        return router_aux_from_stats(local_router_stats(router_logits, self.spec, mask), self.spec, self.group)[0]

    @contextlib.contextmanager
    def fused(self, meta, training: bool):
        """The class doc's substitution of ``load_balancing_loss_func`` around one fused forward."""
        import transformers.models.mixtral.modeling_mixtral as mixtral

        value = 1.0 if training else float(self.eval_steps())

        def global_aux(router_logits, num_experts=None, top_k=2, attention_mask=None):
            return value * scale_grad(self.aux(router_logits, meta, router_logits[0].device), self.cp / value)

        own = mixtral.load_balancing_loss_func
        mixtral.load_balancing_loss_func = global_aux
        try:
            yield
        finally:
            mixtral.load_balancing_loss_func = own


def router_spec(base):
    """The router loss ``base``'s config asks for, balanced over a CP group's micro-batch (the domain one
    rank's rows have at CP=1), or None; a config the trainer cannot reproduce raises ``CPConfigError``."""
    from types import SimpleNamespace

    from ...trainer.router_loss import router_loss_spec

    return router_loss_spec(base, SimpleNamespace(router_loss=True, router_balance_domain="local_micro_batch"))


def router_loss(base, cp_group, cp_size: int, trainer) -> CPRouterLoss | None:
    """:class:`CPRouterLoss` for ``base`` in ``trainer``, or None when its config sets no
    ``output_router_logits`` (:func:`~.checks.check_trainer` refuses the router loss outside TRL's
    fused head)."""
    spec = router_spec(base)
    if spec is None:
        return None
    return CPRouterLoss(spec, cp_group, cp_size, lambda: trainer.current_gradient_accumulation_steps)


def wrap_forward(model, router: "CPRouterLoss | None" = None) -> None:
    """Install the CP forward on ``model`` (idempotent); ``router``: :func:`router_loss`'s or None."""
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
            if router is None:
                return inner(*args, **kwargs)
            with router.fused(holder.meta, base.training):
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
            if router is not None:      # refused by check_trainer: the aux would be the shard's
                raise RuntimeError("the MoE router loss under CP is computed in TRL's fused head only")
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
