"""TRL's ``GRPOTrainer`` under CP: generation per data-parallel group, the policy loss's forward and
backward under CP (docs/hf_integration.md, "GRPO").

GRPO counts *processes* everywhere: the generation batch (``per_device x processes x
steps_per_generation``), which process holds which completions of a prompt group
(``process_index``), the rewards and advantages gathered across processes, the loss normaliser of
the ``dapo``-type losses. Under CP the processes of that arithmetic are the data-parallel groups,
not the ranks. So, on every rank of a CP group (which hold the same prompts, :mod:`.data`):

* :class:`DPView` stands for ``trainer.accelerator`` (and TRL's module-level ``gather`` /
  ``gather_object``) while GRPO generates, scores and computes its loss: ``process_index`` /
  ``num_processes`` are the DP group's index and count, and a gather runs over one rank per CP group;
  ``generation_batch_size`` is recomputed for ``world / cp`` processes from ``steps_per_generation``;
* generation, and the no-grad log-probs computed with it (old / reference policy), run with the CP
  wrappers off (``cp_disabled``): the same plain computation as at CP=1, on every rank of the group;
* the policy's per-token log-probs and entropies (:func:`cp_logps_and_entropies`) are computed under
  CP — each rank scores its shard of every prompt+completion row through TRL's fused head, the
  targets shifted on the global row — and gathered over the CP group in row order (differentiable:
  the backward reduce-scatters, so each rank's tokens get the gradient the group's identical losses
  give them, summed; with DDP's average over ``dp x cp`` ranks that is CP=1's gradient).
"""
from __future__ import annotations

import contextlib
import copy
import functools

import torch

from ...distributed.context_parallel.comm.primitives import all_gather_seq
from ...distributed.context_parallel.model_proof.state import cp_disabled
from ...distributed.errors import CPConfigError
from ...platform import all_gather, all_gather_object
from .batch import META_KEY, CPDataCollator
from .context import activate, release


def is_grpo(trainer) -> bool:
    """Whether ``trainer`` is TRL's GRPOTrainer (or a subclass)."""
    return any(c.__name__ == "GRPOTrainer" and c.__module__.startswith("trl.") for c in type(trainer).__mro__)


def check_grpo(trainer, cp_size: int) -> None:
    """Refuse, by field, what this module does not carry at CP degree ``cp_size``, and a batch geometry
    that does not hold whole prompt groups for ``world / cp_size`` processes (TRL checked it for all
    ranks). Local: no collective."""
    args = trainer.args
    if getattr(args, "use_vllm", False):
        raise CPConfigError("GRPOConfig.use_vllm", "vLLM generates outside the trainer's processes; its weight "
                            "sync and process slices are not mapped to the CP groups", fix="use_vllm=False")
    if getattr(args, "use_transformers_continuous_batching", False):
        raise CPConfigError("GRPOConfig.use_transformers_continuous_batching", "not mapped to the CP groups",
                            fix="leave it False")
    if getattr(trainer, "_is_vlm", False):
        raise CPConfigError("GRPOTrainer.model", "images through GRPO under CP are not carried (the fused head's "
                            "rows would need the media spread over the CP group)", fix="text-only GRPO at cp > 1")
    dp = max(1, getattr(args, "world_size", cp_size) // cp_size)
    batch = args.per_device_train_batch_size * dp * args.steps_per_generation
    if batch % trainer.num_generations:
        raise CPConfigError("GRPOConfig.num_generations",
                            f"the generation batch of {dp} data-parallel group(s) is {args.per_device_train_batch_size} "
                            f"x {dp} x steps_per_generation {args.steps_per_generation} = {batch} rows, not whole "
                            f"groups of num_generations={trainer.num_generations} (under CP the processes are the "
                            "data-parallel groups, world / cp_size)",
                            fix="make per_device_train_batch_size x (world / cp_size) x steps_per_generation a "
                                "multiple of num_generations")
    evals = getattr(args, "num_generations_eval", None) or trainer.num_generations
    # eval_strategy is a str enum: it compares equal to its value
    if getattr(args, "do_eval", False) and args.eval_strategy != "no" and (args.per_device_eval_batch_size * dp) % evals:
        raise CPConfigError("GRPOConfig.per_device_eval_batch_size",
                            f"the eval batch of {dp} data-parallel group(s), {args.per_device_eval_batch_size} x {dp}, "
                            f"is not a multiple of the {evals} generations per eval prompt",
                            fix="make per_device_eval_batch_size x (world / cp_size) a multiple of them")


class DPView:
    """``accelerator`` as GRPO's arithmetic must see it under CP: the processes are the ``dp`` groups,
    ``process_index`` this rank's group. A gather runs over ``dp_group`` (the ranks with this rank's CP
    index, one per group, through :mod:`hyper_parallel.platform`): every rank of a CP group holds the
    same tensors while GRPO generates, scores and reduces its loss, so it returns what ``dp`` processes
    return at CP=1. Every other attribute is the accelerator's."""

    def __init__(self, accelerator, dp_group, dp: int, dp_index: int):
        self.__dict__.update(_acc=accelerator, _group=dp_group, _dp=dp, _dp_index=dp_index)

    def __getattr__(self, name):
        return getattr(self._acc, name)

    @property
    def process_index(self) -> int:
        return self._dp_index

    @property
    def num_processes(self) -> int:
        return self._dp

    def gather(self, tensor):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"GRPO under CP gathers tensors only, got {type(tensor).__name__}")
        x = tensor.detach()              # as accelerate's gather: values, not a graph
        return all_gather((x if x.dim() else x.reshape(1)).contiguous(), self._group, dim=0)

    def gather_for_metrics(self, tensor, use_gather_object: bool = False):
        if use_gather_object or not isinstance(tensor, torch.Tensor):
            return self.gather_object(tensor)
        return self.gather(tensor)

    def gather_object(self, obj):
        """A list from every group, concatenated (accelerate's ``gather_object`` on lists)."""
        per = all_gather_object(list(obj), self._group) if self._dp > 1 else [list(obj)]
        return [x for part in per for x in part]

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        g = self.gather(tensor.reshape(1, *tensor.shape))
        out = g.sum(0) if reduction == "sum" else g.mean(0) if reduction == "mean" else g
        return out * scale


@contextlib.contextmanager
def dp_processes(trainer, view: DPView):
    """``trainer.accelerator`` and TRL's module-level ``gather`` / ``gather_object`` as ``view`` in the body."""
    import trl.trainer.grpo_trainer as grpo_module

    saved = (trainer.accelerator, grpo_module.gather, grpo_module.gather_object)
    trainer.accelerator = view
    grpo_module.gather, grpo_module.gather_object = view.gather, view.gather_object
    try:
        yield
    finally:
        trainer.accelerator, grpo_module.gather, grpo_module.gather_object = saved


def _fingerprint(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[3]`` int64: the rows' shape and a position-weighted sum of their ids and mask (differs, in
    practice, between two different batches)."""
    w = torch.arange(1, input_ids.numel() + 1, device=input_ids.device).view_as(input_ids)
    total = (input_ids.to(torch.int64) * w).sum() * 3 + (attention_mask.to(torch.int64) * w).sum()
    return torch.stack([torch.tensor(input_ids.shape[0], device=input_ids.device),
                        torch.tensor(input_ids.shape[1], device=input_ids.device), total]).to(torch.int64)


def cp_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *, collator: CPDataCollator,
                           group, cp_mesh, compute_entropy: bool = False):
    """GRPO's per-token log-probs (and entropies) of the completion tokens, ``[B, logits_to_keep]``,
    computed under CP (module doc) — what ``_get_per_token_logps_and_entropies`` returns at CP=1.
    First, one fixed-size all-gather over the CP group checks that its ranks were given the same rows
    (raised on every rank otherwise, before the forward's collectives)."""
    mine = _fingerprint(input_ids, attention_mask)
    every = all_gather(mine, group, dim=0).view(-1, mine.numel())
    if not bool((every == mine).all()):
        raise RuntimeError("GRPO under CP: the ranks of one CP group were given different rows (their "
                           "generation or shuffle diverged); every rank of a group must hold the same batch")
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    local = collator.shard({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    meta = local[META_KEY].meta
    activate(meta)                       # kept current into the backward (activation checkpointing)
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                shift_labels=local["shift_labels"], fused_lm_head=True, use_cache=False)
    order = torch.argsort(meta.k_index)  # the gathered slots (rank order) -> the row's order
    seq = input_ids.shape[1]

    def whole_rows(x):
        """This rank's ``[B, S_local]`` -> the global rows ``[B, S - 1]`` (position t scores token t + 1)."""
        rows = all_gather_seq(x, cp_mesh, dim=1).index_select(1, order.to(x.device))
        return rows[:, :seq - 1][:, -logits_to_keep:]

    logps = whole_rows(out.log_probs)
    return logps, (whole_rows(out.entropy) if compute_entropy else None)


def install_grpo(trainer, mesh, collator: CPDataCollator, cp_size: int) -> None:
    """Make ``trainer`` (a GRPOTrainer) run at CP degree ``cp_size`` on ``mesh`` (module doc)."""
    world = mesh.root.size()
    dp = world // cp_size
    # the generation batch of dp processes, as the CP=1 script on dp ranks computes it from
    # steps_per_generation (on a copy: the user's GRPOConfig is left as it was)
    args = trainer.args = copy.copy(trainer.args)
    args.generation_batch_size = args.per_device_train_batch_size * dp * args.steps_per_generation
    dp_index = mesh.dp_mesh.get_local_rank()
    group = mesh.cp_mesh.get_group()
    view = DPView(trainer.accelerator, mesh.dp_mesh.get_group(), dp, dp_index)
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    generating = {"on": False}
    inner_generate = trainer._generate_and_score_completions
    inner_logps = trainer._get_per_token_logps_and_entropies
    inner_loss = trainer._compute_loss

    @functools.wraps(inner_generate)
    def generate_and_score(inputs):
        release()                        # no CP batch of the last step stays current
        generating["on"] = True
        try:
            with dp_processes(trainer, view), cp_disabled(base):
                return inner_generate(inputs)
        finally:
            generating["on"] = False

    @functools.wraps(inner_logps)
    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                            compute_entropy=False, compute_aux_loss=False, **media):
        if generating["on"]:             # old / reference log-probs: the plain computation, CP wrappers off
            return inner_logps(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                               compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **media)
        if compute_aux_loss or any(v is not None for v in media.values()):   # refused before training
            raise RuntimeError("GRPO under CP: media or the MoE aux loss reached the policy loss")
        logps, entropies = cp_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                  collator=collator, group=group, cp_mesh=mesh.cp_mesh,
                                                  compute_entropy=compute_entropy)
        return logps, entropies, None

    @functools.wraps(inner_loss)
    def compute_loss(model, inputs):
        with dp_processes(trainer, view):
            return inner_loss(model, inputs)

    # GRPOTrainer seeds each process with seed + process_index (distinct samples per process): under CP
    # the process is the DP group, so every rank of a group draws the same samples as CP=1's process
    from accelerate.utils import set_seed

    set_seed(args.seed + dp_index)
    trainer._generate_and_score_completions = generate_and_score
    trainer._get_per_token_logps_and_entropies = logps_and_entropies
    trainer._compute_loss = compute_loss
