"""Refusals of a CP Trainer: every option whose data flow or randomness CP would change.

:func:`check_trainer` runs locally on every rank (no collective; the entry agrees the outcome
across ranks with :func:`~hyper_parallel.distributed.preflight.agree_or_raise` before the first
step). Each refusal is one :class:`~hyper_parallel.distributed.errors.CPConfigError` naming the
field, the module where one applies, and the fix.
"""
from __future__ import annotations

import types

from ...distributed.errors import CPConfigError
from .grpo import check_grpo, is_grpo

# collators whose output is the batch contract of .batch (class names; module-qualified below)
KNOWN_COLLATORS = {
    "trl.trainer.sft_trainer.DataCollatorForLanguageModeling",
    "transformers.data.data_collator.DataCollatorWithFlattening",
    "transformers.data.data_collator.DataCollatorWithPadding",
    "transformers.data.data_collator.DataCollatorForSeq2Seq",
    "transformers.data.data_collator.DataCollatorForLanguageModeling",
    "transformers.data.data_collator.default_data_collator",
}


FSDP2_FIX = ("leave TrainingArguments.fsdp unset and load the model sharded by transformers' own FSDP2: "
             "from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=WORLD_SIZE)) "
             "(docs/hf_integration.md, 'FSDP2')")


# the losses whose arithmetic under CP is known (the model's own token loss, TRL's fused head)
KNOWN_LOSSES = {
    "transformers.trainer.Trainer.compute_loss",
    "trl.trainer.sft_trainer.SFTTrainer.compute_loss",
}
GRPO_LOSS = "trl.trainer.grpo_trainer.GRPOTrainer.compute_loss"      # under CP through .grpo


def check_loss(trainer, cp_size: int) -> None:
    """Refuse a loss that would see one CP shard as if it were the row: a ``compute_loss`` other than
    transformers' Trainer's, TRL SFTTrainer's or GRPOTrainer's (a subclass's own, RLOO's, DPO's, ...)
    and a ``compute_loss_func`` (it receives the shard's logits and its unshifted labels). GRPO's own
    options are checked by :func:`.grpo.check_grpo`."""
    fn = type(trainer).compute_loss
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    if name == GRPO_LOSS:
        check_grpo(trainer, cp_size)    # its loss runs under CP through .grpo
        return
    if name not in KNOWN_LOSSES:
        rl = any(c.__name__ == "RLOOTrainer" for c in type(trainer).__mro__)
        problem = (f"{type(trainer).__name__}'s policy loss (per-completion means, advantages over generation "
                   "groups gathered across processes) is not computed over the CP group: each rank would score "
                   "only its shard of every completion (GRPOTrainer is)" if rl else
                   f"{name} is not a loss whose arithmetic under CP is known: it would compute on one shard's "
                   "logits and targets as if they were the row's")
        raise CPConfigError("Trainer.compute_loss", problem,
                            fix="train with transformers' Trainer or TRL's SFTTrainer and the model's own token "
                                "loss (SFTConfig(loss_type='nll' | 'dft')), or run this trainer at cp_size 1")
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise CPConfigError("Trainer.compute_loss_func",
                            "it receives one CP shard's logits and that shard's unshifted labels (shifting them "
                            "on the shard loses a target at every shard edge, and its mean is the shard's)",
                            fix="drop compute_loss_func: the model's own loss (or SFTConfig(loss_type='dft')) is "
                                "computed exactly under CP")


def collator_name(collator) -> str:
    """``module.qualname`` of a collator function or of a collator object's class."""
    target = collator if isinstance(collator, (types.FunctionType, types.BuiltinFunctionType)) else type(collator)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"


def packs_rows(trainer) -> bool:
    """The Trainer's rows hold several documents: TRL's ``packing`` / ``padding_free`` or transformers'
    ``DataCollatorWithFlattening``."""
    args = trainer.args
    flattening = type(getattr(trainer, "data_collator", None)).__name__ == "DataCollatorWithFlattening"
    return bool(getattr(args, "packing", False) or getattr(args, "padding_free", False) or flattening)


def check_trainer(trainer, cp_size: int, *, accept_collator: bool = False, installs: bool = False) -> None:
    """Raise the first refusal that applies to ``trainer`` at CP degree ``cp_size`` (module doc);
    ``installs``: the methods are installed at cp_size 1 too (packed documents ``independent``)."""
    args = trainer.args
    world = args.world_size
    if cp_size < 1 or world % cp_size:
        raise CPConfigError("cp_size", f"cp_size {cp_size} does not divide the {world} launched ranks",
                            fix="launch a multiple of cp_size ranks (torchrun --nproc-per-node), the rest is DP")
    if cp_size == 1 and not installs:
        return
    model = trainer.model
    # first: for a model loaded with its own TP the Trainer builds a ParallelismConfig itself, which the
    # parallelism_config refusal below would name instead of the real cause
    check_load_time_sharding(model.get_base_model() if hasattr(model, "get_base_model") else model, world)
    on_cpu_ddp = "MULTI_CPU" in str(getattr(trainer.accelerator, "distributed_type", ""))
    refusals = (
        ("group_by_length", getattr(args, "group_by_length", False),
         "groups rows by length across the dataset: under CP the ranks of one group must read the same rows",
         "set group_by_length=False"),
        ("train_sampling_strategy", getattr(args, "train_sampling_strategy", "random") in ("group_by_length",
                                                                                         "batch_rebalance"),
         f"'{getattr(args, 'train_sampling_strategy', '')}' regroups rows by length across ranks: under CP the "
         "ranks of one group must read the same rows", "set train_sampling_strategy='random' or 'sequential'"),
        ("neftune_noise_alpha", getattr(args, "neftune_noise_alpha", None) is not None,
         "NEFTune scales its embedding noise by the sequence length and draws it per rank; on a CP shard it "
         "is not the noise of the row", "set neftune_noise_alpha=None"),
        ("use_liger_kernel", getattr(args, "use_liger_kernel", False),
         "Liger kernels replace the model's attention/loss forwards, bypassing the CP wrappers and the "
         "shifted-label contract", "set use_liger_kernel=False"),
        ("label_smoothing_factor", getattr(args, "label_smoothing_factor", 0) not in (0, 0.0),
         "the label smoother shifts the labels of the local shard itself (a CP shard is not a row)",
         "set label_smoothing_factor=0"),
        ("fsdp", bool(getattr(args, "fsdp", None)) or bool(getattr(trainer, "is_fsdp_enabled", False)),
         "accelerate runs DDP here, not FSDP (distributed_type MULTI_CPU: the fsdp setting would be ignored "
         "silently)" if on_cpu_ddp else "accelerate's FSDP preparation would shard the model over a mesh it "
         "reads from a ParallelismConfig, which CP leaves unset", FSDP2_FIX),
        ("parallelism_config", getattr(trainer.accelerator, "parallelism_config", None) is not None,
         "accelerate's ParallelismConfig is set; it would install its own context parallelism / mesh next "
         "to hyper_parallel's", "leave parallelism_config unset: the CP degree and methods come from "
                                "context_parallel(trainer, cp_size, plan_overrides)"),
        ("deepspeed", getattr(args, "deepspeed", None) is not None,
         "DeepSpeed engines are not wired to the CP mesh", "drop deepspeed, or use hyper-train"),
        ("compute_metrics", getattr(trainer, "compute_metrics", None) is not None,
         "compute_metrics receives logits; under CP each rank holds only its slice of the row",
         "drop compute_metrics (the eval loss is exact), or evaluate at cp 1"),
        ("preprocess_logits_for_metrics", getattr(trainer, "preprocess_logits_for_metrics", None) is not None,
         "it receives the logits of a CP shard, not of the row", "drop preprocess_logits_for_metrics"),
    )
    # at cp_size 1 (methods installed for independent packed documents) one rank holds the whole row
    shard_only = {"group_by_length", "train_sampling_strategy", "neftune_noise_alpha", "compute_metrics",
                  "preprocess_logits_for_metrics"}
    for field, bad, problem, fix in refusals:
        if bad and not (cp_size == 1 and field in shard_only):
            raise CPConfigError(f"TrainingArguments.{field}", problem + f" (cp_size={cp_size})", fix=fix)
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    impl = getattr(getattr(base, "config", None), "_attn_implementation", None) or ""
    if impl.startswith("flash_attention") and args.device.type == "cpu":
        raise CPConfigError("model.config.attn_implementation",
                            f"'{impl}' cannot run on CPU and is not what the CP wrappers intercept",
                            module=type(base).__name__, fix="load the model with attn_implementation='sdpa'")
    text_cfg = base.config.get_text_config() if hasattr(getattr(base, "config", None), "get_text_config") else None
    if cp_size > 1 and getattr(text_cfg, "output_router_logits", False):
        fused = (any(c.__name__ == "SFTTrainer" for c in type(trainer).__mro__)
                 and getattr(trainer, "compute_loss_func", None) is None)
        if not fused:
            raise CPConfigError("model.config.output_router_logits",
                                "the MoE load-balancing loss is a nonlinear function of the expert frequencies of "
                                "the tokens it sees; on a CP shard it is not the row's, and it is computed over the "
                                "CP group only in TRL SFTTrainer's fused head", module=type(base).__name__,
                                fix="train with TRL's SFTTrainer (without compute_loss_func), or turn the router "
                                    "aux loss off at cp > 1: model.config.output_router_logits=False")
        from .forward import router_spec

        router_spec(base)       # a router loss the trainer cannot reproduce (a z-loss, ...) is refused here
    check_loss(trainer, cp_size)
    name = collator_name(trainer.data_collator)
    if not accept_collator and name not in KNOWN_COLLATORS and not is_grpo(trainer):   # GRPO batches: .grpo
        raise CPConfigError("Trainer.data_collator",
                            f"collator '{name}' is not one whose output the CP batch contract is known to "
                            f"read (known: {', '.join(sorted(KNOWN_COLLATORS))})",
                            fix="use one of those, or pass accept_collator=True after checking it returns "
                                "input_ids/labels/attention_mask/position_ids [B, S] (docs/hf_integration.md)")
    uses_hf_loss = type(trainer).compute_loss is _base_compute_loss()
    if uses_hf_loss and not trainer.model_accepts_loss_kwargs:
        raise CPConfigError("model.forward", "the model's forward takes no num_items_in_batch, so its loss "
                            "would be the mean over one CP shard", module=type(base).__name__,
                            fix="use a causal LM whose forward accepts **kwargs (transformers then passes it "
                                "num_items_in_batch)")


def check_load_time_sharding(base, world: int) -> None:
    """A model sharded at load time (``from_pretrained(distributed_config=...)``) is taken under CP when it
    is FSDP2 alone over every rank (HSDP included): its reduce-scatter then averages over all ``world``
    ranks, as DDP does. Tensor, pipeline or expert parallelism of transformers' own is refused."""
    cfg = getattr(getattr(base, "config", None), "distributed_config", None)
    if cfg is None or not getattr(base, "is_distributed_loading_by_transformers", False):
        return
    for field in ("tp_size", "pp_size", "ep_size"):
        if (getattr(cfg, field, None) or 1) > 1:
            raise CPConfigError(f"from_pretrained(distributed_config).{field}",
                                f"{field}={getattr(cfg, field)}: transformers' own {field[:2].upper()} shards the "
                                "model on a mesh CP does not share (the CP ranks would hold different shards)",
                                module=type(base).__name__,
                                fix=f"load with {field}=1 (FSDP2 alone: fsdp_size=WORLD_SIZE), or use hyper-train "
                                    "for TP/PP/EP x CP")
    shards = (getattr(cfg, "fsdp_size", None) or 1) * (getattr(cfg, "dp_replicate_size", None) or 1)
    if shards != world:
        raise CPConfigError("from_pretrained(distributed_config).fsdp_size",
                            f"FSDP2 spans {shards} of the {world} ranks: its gradient average would not be over "
                            "the CP x DP ranks the loss is normalised for", module=type(base).__name__,
                            fix="load with fsdp_size x dp_replicate_size = WORLD_SIZE")


def _base_compute_loss():
    from transformers import Trainer

    return Trainer.compute_loss
