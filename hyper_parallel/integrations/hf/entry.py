"""``context_parallel(trainer, cp_size, plan_overrides)``: exact CP inside an unchanged HF script.

Call it after building a ``transformers.Trainer`` or a TRL ``SFTTrainer`` and before
``trainer.train()``, on every rank (``torchrun`` / ``accelerate launch``). It

1. parses the declaration (:mod:`.declaration`) and checks the trainer (:mod:`.checks`) on every
   rank, agreeing the outcome across ranks: a refusal is raised on every rank before any step;
2. at ``cp_size == 1`` returns the trainer untouched (the script's own CP=1 reference) — unless
   ``packed_documents="independent"``: the declared methods then run as a CP group of one;
3. builds the meshes and the plan (``setup_distributed``: ``dp_replicate = world / cp`` x ``cp``)
   and applies it to the causal LM (under a PEFT model: its base model) without FSDP — the CP
   wrappers, the RoPE-on-global-positions hook and, by default, the CP preflight proof;
4. hooks the Trainer: one batch per CP group (:mod:`.data`), the collator wrapped by the batch
   contract (:mod:`.batch`), the forward and the loss normalisation (:mod:`.forward`) — for TRL's
   GRPOTrainer instead generation per data-parallel group and its policy loss under CP
   (:mod:`.grpo`) —, the eval-loss gathering (:mod:`.evaluation`), and a
   callback that leaves the CP batch context when training ends.

Gradients: the model is prepared by the Trainer as plain DDP over all ``W`` ranks, or — loaded
sharded by transformers' own FSDP2 (``from_pretrained(distributed_config=DistributedConfig(
fsdp_size=W))``, checked by :func:`.checks.check_load_time_sharding`) — left to FSDP2's
reduce-scatter over those ``W`` ranks. Both average; the loss normalisation of :mod:`.forward`
makes that average the CP=1 gradient (docs/hf_integration.md, "FSDP2"). Returns the trainer.
"""
from __future__ import annotations

import torch.distributed as dist

from ...distributed.config import AcceleratorConfig
from ...distributed.context_parallel.batch import CONTIGUOUS_POLICY
from ...distributed.context_parallel.meta import INDEPENDENT, PACKED_DOCUMENTS
from ...distributed.infrastructure import setup_distributed
from ...distributed.plan.applier import apply_sharding_plan
from ...distributed.preflight import agree_or_raise
from .batch import CPDataCollator
from .checks import check_trainer, packs_rows
from .context import release
from .data import shard_data_by_dp
from .declaration import load_plan_overrides
from .evaluation import install_eval_gather
from .forward import router_loss, wrap_compute_loss, wrap_forward
from .grpo import install_grpo, is_grpo


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _release_callback():
    from transformers import TrainerCallback

    class ReleaseCPContext(TrainerCallback):
        """Leaves the CP batch context (module :mod:`.context`) at the end of training and of each
        evaluation, so no later forward of the process (another model, a plain forward) runs
        under a stale CP batch."""

        def on_train_end(self, args, state, control, **kwargs):
            release()

        def on_evaluate(self, args, state, control, **kwargs):
            release()

    return ReleaseCPContext()


def context_parallel(trainer, cp_size: int, plan_overrides, *, accept_collator: bool = False,
                     preflight_proof: bool = True, packed_documents: str | None = None):
    """Make ``trainer`` train with context parallelism of degree ``cp_size`` (module doc).

    ``plan_overrides``: the YAML trainer's declaration — a list of dicts, or a YAML file.
    ``accept_collator``: declare that a collator outside ``checks.KNOWN_COLLATORS`` returns the
    batch contract's fields. ``preflight_proof``: run the CP preflight proof (default on).
    ``packed_documents``: what a packed row means for a model whose result depends on it
    (docs/wrappers.md, "Packed documents"): ``independent`` runs the declared methods at cp_size 1
    too (a CP group of one), so each packed document is computed alone at every CP size;
    ``as_transformers`` (or None) leaves the Trainer at cp_size 1 untouched (plain transformers)."""
    def check():
        specs = load_plan_overrides(plan_overrides)
        check_trainer(trainer, cp_size, accept_collator=accept_collator, installs=packed_documents == INDEPENDENT)
        if packed_documents not in (None,) + PACKED_DOCUMENTS:
            raise ValueError(f"packed_documents must be one of {PACKED_DOCUMENTS} or None, got {packed_documents!r}")
        return specs

    release()   # nothing of an earlier trainer in this process stays current
    specs = agree_or_raise(check, what="hyper_parallel HF context_parallel", same_error=True)
    if cp_size == 1 and packed_documents != INDEPENDENT:
        return trainer
    world = dist.get_world_size()
    model = _base_model(trainer.model)
    accel = AcceleratorConfig(cp_size=cp_size, dp_replicate_size=world // cp_size)
    setup = setup_distributed(accel, specs, model, packed_documents=packed_documents, packed_rows=packs_rows(trainer),
                              documents_field="context_parallel(packed_documents=...)")
    apply_sharding_plan(model, setup.plan, setup.mesh, fsdp=False, preflight_proof=preflight_proof)
    mesh = setup.mesh
    shard_data_by_dp(trainer, mesh)
    cp_rank = mesh.cp_mesh.get_local_rank()
    pad_id = getattr(getattr(trainer, "processing_class", None), "pad_token_id", None)
    if pad_id is None:
        pad_id = getattr(model.config, "pad_token_id", None) or 0
    policy = setup.plan.batch_policy or CONTIGUOUS_POLICY            # None at cp 1: one contiguous "shard"
    collator = CPDataCollator(trainer.data_collator, (cp_rank, cp_size), policy, pad_token_id=int(pad_id),
                              packed_documents=packed_documents)
    if is_grpo(trainer):             # GRPO builds its batches itself: generation per DP group, loss under CP
        install_grpo(trainer, mesh, collator, cp_size)
    else:
        trainer.data_collator = collator
        wrap_forward(trainer.model, router_loss(model, mesh.cp_mesh.get_group(), cp_size, trainer))
        wrap_compute_loss(trainer, cp_size, mesh.cp_mesh.get_group())
    install_eval_gather(trainer, cp_size, mesh.cp_mesh.get_group(), mesh.dp_mesh.get_group())
    trainer.add_callback(_release_callback())
    trainer.hyper_parallel_setup = setup
    return trainer
