"""The trainer's pipeline-parallel path (``accelerator.pp_size > 1``): a schedule the sizes cannot run is
refused (:func:`check_pipeline_run`, local, before anything is built); the step's forward and backward,
and an evaluation's forward, go through :mod:`hyper_parallel.distributed.pipeline_parallel`
(:func:`pipeline_forward_backward`).

Each rank holds one stage (cut in ``setup_distributed``); a step's micro-batches are the schedule's
microbatches (``schedule.grad_accum_steps``), each sharded for the stage's CP group by the trainer's
batch contract; the gradient norm is taken over every stage. docs/pipeline_parallel.md.
"""
from __future__ import annotations

from ..distributed.pipeline_parallel import INTERLEAVED, PipelineStep, check_schedule

__all__ = ["virtual_stages", "adopt_stage", "check_pipeline_run", "make_pipeline", "pipeline_forward_backward"]


def virtual_stages(schedule) -> int:
    """``schedule.virtual_stages``, its default resolved: 2 for an interleaved schedule, else 1."""
    if schedule.virtual_stages is not None:
        return schedule.virtual_stages
    return 2 if schedule.pipeline in INTERLEAVED else 1


def check_pipeline_run(cfg) -> None:
    """CPConfigError naming the field for a schedule the declared sizes cannot run
    (:func:`~...pipeline_parallel.check_schedule`): the step's micro-batches and, with evaluation on,
    an evaluation's."""
    pp = cfg.accelerator.pp_size
    if pp == 1:
        return
    acc, sch = cfg.accelerator, cfg.schedule
    check_schedule(sch.pipeline, pp, sch.grad_accum_steps, virtual_stages(sch))
    if cfg.data.eval_every is not None:     # an evaluation runs its micro-batches through the same schedule
        check_schedule(sch.pipeline, pp, cfg.data.eval_batches, virtual_stages(sch), field="data.eval_batches")


def adopt_stage(setup, model):
    """The stage ``setup_distributed`` cut from ``model``, carrying ``model``'s build source (``_hp_*``:
    the meta build's materialisation reads it, by the whole model's names)."""
    setup.stage.__dict__.update({k: v for k, v in model.__dict__.items() if k.startswith("_hp_")})
    return setup.stage


def make_pipeline(trainer) -> PipelineStep:
    """The trainer's :class:`~...pipeline_parallel.PipelineStep` (its stage, schedule, batch policy)."""
    cfg = trainer.cfg
    import torch

    bf16 = cfg.schedule.mixed_precision == "bf16"      # FSDP2's policy computes (and passes on) bf16
    return PipelineStep(trainer.model, trainer.mesh, cfg.schedule.pipeline, policy=trainer.cp_policy,
                        packed_documents=cfg.data.packed_documents, grad_scale=trainer.grad_scale,
                        device=trainer.device, activation_dtype=torch.bfloat16 if bf16 else None)


def pipeline_forward_backward(trainer, prepared: list, n_global, train: bool = True):
    """Forward and backward (``train=False``: forward only, an evaluation) of the prepared micro-batches
    through the schedule; returns their global mean loss (every rank)."""
    items = [{"input_ids": p.inputs["input_ids"], "position_ids": p.inputs["position_ids"],
              "shift_labels": p.shift_labels, "meta": p.meta, "num_valid_tokens": p.num_valid_tokens}
             for p in prepared]
    return trainer.pipeline.run(items, n_global, train=train)
