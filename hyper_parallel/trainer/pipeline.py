"""The trainer's pipeline-parallel path (``accelerator.pp_size > 1``): a schedule the sizes cannot run is
refused (:func:`check_pipeline_run`, local, before anything is built); the step's forward and backward,
and an evaluation's forward, go through :mod:`hyper_parallel.distributed.pipeline_parallel`
(:func:`pipeline_forward_backward`).

Each rank holds one stage (cut in ``setup_distributed``); a step's micro-batches are the schedule's
microbatches (``schedule.grad_accum_steps``), each sharded for the stage's CP group by the trainer's
batch contract; the gradient norm is taken over every stage. docs/pipeline_parallel.md.
"""
from __future__ import annotations

import torch

from ..distributed.errors import CPConfigError
from ..distributed.pipeline_parallel import INTERLEAVED, PipelineStep, StageRouterLoss, check_pipelinable, check_schedule
from .router_loss import router_spec, stage_router_stats, valid_input_mask

__all__ = ["virtual_stages", "adopt_stage", "check_pipeline_head", "check_pipeline_run", "make_pipeline",
           "pipeline_forward_backward"]


def virtual_stages(schedule) -> int:
    """``schedule.virtual_stages``, its default resolved: 2 for an interleaved schedule, else 1."""
    if schedule.virtual_stages is not None:
        return schedule.virtual_stages
    return 2 if schedule.pipeline in INTERLEAVED else 1


def check_pipeline_run(cfg, *, model: bool = True) -> None:
    """CPConfigError naming the field for a schedule the declared sizes cannot run
    (:func:`~...pipeline_parallel.check_schedule`: the step's micro-batches and, with evaluation on,
    an evaluation's) and, with ``model``, for a model that cannot be cut into the stages
    (:func:`~...pipeline_parallel.check_pipelinable`, on the model built on the meta device: the CLI's
    check before any rank starts; a trainer leaves it to ``setup_distributed``, which checks the
    model it builds anyway, agreed across ranks)."""
    pp = cfg.accelerator.pp_size
    if pp == 1:
        return
    sch = cfg.schedule
    check_schedule(sch.pipeline, pp, sch.grad_accum_steps, virtual_stages(sch))
    if cfg.data.eval_every is not None:     # an evaluation runs its micro-batches through the same schedule
        check_schedule(sch.pipeline, pp, cfg.data.eval_batches, virtual_stages(sch), field="data.eval_batches")
    if not model:
        return
    from .model import run_model

    built = run_model(cfg)
    check_pipelinable(built, pp * virtual_stages(sch))
    check_pipeline_head(built, cfg)


def check_pipeline_head(model, cfg) -> None:
    """The pipeline's last stage computes the tiled loss with the model's head post-processing
    (``ops.tiled_loss.head_post``); prove on a probe, as the trainer's tiled head does
    (:func:`.tiled_head.verify_tiled_head`, on a small twin of a meta-built model), that this
    reproduces the model's own logits and loss, else CPConfigError naming the reason."""
    from .model import head_probe_model, is_meta_model
    from .tiled_head import verify_tiled_head

    reason = verify_tiled_head(head_probe_model(model) if is_meta_model(model) else model,
                               chunk_size=cfg.loss.chunk_size, ignore_index=cfg.data.ignore_index)
    if reason is not None:
        raise CPConfigError("accelerator.pp_size", f"the pipeline's last stage computes the tiled loss, which does "
                            f"not reproduce this model's head: {reason}", fix="set accelerator.pp_size: 1 for this model")


def adopt_stage(setup, model):
    """The stage ``setup_distributed`` cut from ``model``, carrying ``model``'s build source (``_hp_*``:
    the meta build's materialisation reads it, by the whole model's names)."""
    setup.stage.__dict__.update({k: v for k, v in model.__dict__.items() if k.startswith("_hp_")})
    return setup.stage


def make_pipeline(trainer) -> PipelineStep:
    """The trainer's :class:`~...pipeline_parallel.PipelineStep` (its stage, schedule, batch policy), with
    the MoE router loss across stages when the model's objective has it (:mod:`.router_loss`'s domain)."""
    cfg, mesh = trainer.cfg, trainer.mesh
    spec = router_spec(trainer)
    trainer.router_masks = []                       # valid-token masks of the step's micro-batches
    if spec is not None:
        local = spec.domain == "local_micro_batch"
        domain = (mesh.cp_mesh if trainer.cp_size > 1 else None) if local else mesh.dp_cp_mesh
        trainer.model.router = StageRouterLoss(spec.num_experts, stage_router_stats(spec, domain, trainer.router_masks))
    bf16 = cfg.schedule.mixed_precision == "bf16"      # FSDP2's policy computes (and passes on) bf16
    return PipelineStep(trainer.model, mesh, cfg.schedule.pipeline, policy=trainer.cp_policy,
                        packed_documents=cfg.data.packed_documents, grad_scale=trainer.grad_scale,
                        device=trainer.device, activation_dtype=torch.bfloat16 if bf16 else None,
                        without_router_loss=spec is None)


def pipeline_forward_backward(trainer, prepared: list, n_global, train: bool = True, router_weight=None):
    """Forward and backward (``train=False``: forward only, an evaluation, without the router loss) of
    the prepared micro-batches through the schedule. Returns ``(loss, router)``: their global mean
    token loss (every rank) and, with the router loss (``router_weight``: a micro-batch's weight in the
    step's, as :func:`.step.run_step` forms it), ``(sum over micro-batches of weight x aux, the token
    counts per expert summed over them)`` on every rank (else None)."""
    from ..platform import all_reduce

    items = [{"input_ids": p.inputs["input_ids"], "position_ids": p.inputs["position_ids"],
              "shift_labels": p.shift_labels, "meta": p.meta, "num_valid_tokens": p.num_valid_tokens}
             for p in prepared]
    stage, spec = trainer.model, router_spec(trainer)
    router = stage.router
    if router_weight is None or not train:
        stage.router = None
        try:
            return trainer.pipeline.run(items, n_global, train=train), None
        finally:
            stage.router = router
    weight = router_weight
    router.scale, router.values[:] = spec.coef * weight * trainer.grad_scale, []
    trainer.router_masks[:] = [valid_input_mask(p, trainer.device) for p in prepared]
    loss = trainer.pipeline.run(items, n_global)
    E = spec.num_experts
    total = torch.zeros(E + 1, dtype=torch.float32, device=trainer.device)
    for aux, counts in router.values:               # the last stage's record of each micro-batch
        total += torch.cat([(aux * weight).reshape(1), counts.float()]).to(total.device)
    total = all_reduce(total, trainer.mesh.pp_mesh.get_group())
    return loss, (total[0], total[1:])
