"""One optimizer step's forward and backward through a pipeline of stages, CP inside each stage.

:class:`PipelineStep` drives ``torch.distributed.pipelining`` (``PipelineStage`` with static shapes and a
schedule chosen by name: :data:`SCHEDULES`); it writes no scheduler. Per step:

1. every microbatch is sharded for this rank's CP group (``shard_batch_for_cp``: global positions,
   labels shifted globally then sharded, document metadata) and all must have one local shape;
2. the valid-token count of the whole step (every microbatch, every DP x CP rank of the stage) is
   summed before the schedule runs, and the last stage's loss is ``sum / that count x grad_scale``:
   the schedule's own per-microbatch scaling is off (``scale_grads=False``), so the gradients are
   those of one big batch at CP=1;
3. the schedule runs; each microbatch's forward and backward run inside its own CP batch context
   (``cp_batch_context(meta of that microbatch)``), activations pass between stages as the CP-local
   shard ``[b, L, H]`` over ``mesh.pp_mesh`` (rank ``(pp, …, cp=i)`` to ``(pp+1, …, cp=i)``);
4. the loss value (every rank) is the global token mean, summed over the pp group from the last stage.

Gradients are then the CP=1 gradients once reduced over the stage's DP x CP ranks: FSDP2 on the
stage (``grad_scale`` = its mesh size, as the trainer) or :func:`reduce_stage_grads` without it.
docs/pipeline_parallel.md.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ... import platform as P
from ..context_parallel import shard_batch_for_cp
from ..context_parallel.meta import cp_batch_context
from ..errors import CPConfigError
from .stages import StageModule

__all__ = ["SCHEDULES", "PipelineStep", "check_schedule", "reduce_stage_grads"]

#: ``schedule.pipeline`` names -> torch's schedule class (in ``torch.distributed.pipelining``, imported only
#: when a pipeline is built: it pulls in torch.export and dynamo, ~1 s of every process's start-up);
#: the interleaved one runs several stages per rank
SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved_1f1b": "ScheduleInterleaved1F1B"}
INTERLEAVED = ("interleaved_1f1b",)


def check_schedule(name: str, pp_size: int, microbatches: int, virtual: int = 1,
                   field: str = "schedule.grad_accum_steps") -> type:
    """The schedule class for ``name``; CPConfigError (before any collective) for an unknown name, a
    number of stages per rank (``virtual``) the schedule does not take (2 or more for the interleaved
    one, 1 otherwise), or a microbatch count it cannot run (1F1B: at least ``pp_size``; interleaved:
    a multiple of its rounds, ``max(1, microbatches // pp_size)``)."""
    if name not in SCHEDULES:
        raise CPConfigError("schedule.pipeline", f"unknown pipeline schedule {name!r}",
                            fix=f"use one of {sorted(SCHEDULES)} (zero-bubble schedules are not offered)")
    if (virtual >= 2) != (name in INTERLEAVED):
        raise CPConfigError("schedule.virtual_stages", f"{name} runs {'2 or more stages' if name in INTERLEAVED else 'one stage'} "
                            f"per rank, got virtual_stages={virtual}",
                            fix="virtual_stages >= 2 with interleaved_1f1b, 1 with 1f1b / gpipe")
    rounds = max(1, microbatches // pp_size)
    if microbatches < 1 or (name == "1f1b" and microbatches < pp_size) or (name in INTERLEAVED and microbatches % rounds):
        need = (f"at least {pp_size}" if name == "1f1b" else f"a multiple of max(1, microbatches // {pp_size})"
                if name in INTERLEAVED else "at least 1")
        raise CPConfigError(field, f"{name} with pp_size={pp_size} needs {need} microbatches "
                            f"per step, got {microbatches}",
                            fix=f"use {pp_size} or a multiple of it as the microbatch count (the gradient-accumulation count)")
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, SCHEDULES[name])


class PipelineStep:
    """Runs steps of ``stage`` (a :class:`~.stages.StageModule`, CP applied, optionally FSDP2) under
    schedule ``schedule`` on ``mesh`` (a :class:`~..mesh.MeshContext` with ``pp`` = the stage count).

    ``policy`` / ``packed_documents``: the CP batch policy of the stage's plan and what a packed row
    means (as for ``shard_batch_for_cp``). ``grad_scale``: the factor the gradient reduction divides
    by (FSDP2's mean over the stage's DP x CP ranks: its size; 1 with :func:`reduce_stage_grads`).
    ``activation_dtype``: the dtype of the hidden states passed between stages (default: the
    parameters'; bf16 under FSDP2's bf16 mixed-precision policy). A model whose objective has the MoE
    router loss (``output_router_logits``) needs ``stage.router`` (router.py), unless the caller trains
    without it on purpose (``without_router_loss``)."""

    def __init__(self, stage: StageModule, mesh, schedule: str = "1f1b", *, policy="all_gather",
                 packed_documents: Optional[str] = None, grad_scale: float = 1.0, device=None,
                 activation_dtype: Optional[torch.dtype] = None, without_router_loss: bool = False):
        self.stage, self.mesh, self.name = stage, mesh, schedule
        self.activation_dtype, self.without_router_loss = activation_dtype, without_router_loss
        self.policy, self.documents, self.grad_scale = policy, packed_documents, float(grad_scale)
        self.device = torch.device(device or "cpu")
        self._pipes: dict = {}

    def _pipe(self, n: int, b: int, L: int, dtype: torch.dtype):
        """(PipelineStages of this rank, schedule) for ``n`` microbatches of ``b`` rows of ``L`` local
        tokens (static shapes: no shape-inference run); cached per shape."""
        key = (n, b, L, dtype, self.stage.router is not None)
        if key not in self._pipes:
            import torch.distributed.pipelining as pipelining

            st = self.stage
            cls = check_schedule(self.name, st.pp_size, n, st.virtual)
            H, total = st.config.hidden_size, st.pp_size * st.virtual
            # requires_grad: the received activations must carry their gradient back to the previous stage
            hidden = torch.empty(b, L, H, dtype=dtype, device=self.device, requires_grad=True)
            loss = torch.empty((), dtype=torch.float32, device=self.device, requires_grad=True)
            # with the router loss, the router statistics [2E + 1] travel beside the hidden states (router.py)
            carried = (hidden,) if st.router is None else (
                hidden, torch.empty(2 * st.router.num_experts + 1, device=self.device, requires_grad=True))
            pipes = []
            for call, sid in zip(st.stages(), st.stage_ids):
                inp = (torch.empty(b, L, dtype=torch.long, device=self.device),) if sid == 0 else carried
                pipes.append(pipelining.PipelineStage(call, sid, total, self.device, input_args=inp,
                                           output_args=loss if sid == total - 1 else carried,
                                           group=self.mesh.pp_mesh.get_group()))
            loss_fn = lambda loss, _target: loss     # noqa: E731 - the last stage returns the scaled loss
            sched = (cls(pipes, n_microbatches=n, loss_fn=loss_fn, scale_grads=False) if st.virtual > 1 else
                     cls(pipes[0], n_microbatches=n, loss_fn=loss_fn, scale_grads=False))
            self._pipes[key] = (pipes, sched)
        return self._pipes[key]

    def __call__(self, micro_batches: list) -> torch.Tensor:
        """Forward and backward of one step over ``micro_batches`` (global collated batches ``[b, S]``
        of this DP rank, one per microbatch); returns the step's global mean loss (fp32 scalar, every
        rank). Gradients accumulate into the stage's parameters."""
        local = []
        for mb in micro_batches:
            x = shard_batch_for_cp(mb, self.mesh.cp_mesh, self.policy, packed_documents=self.documents)
            local.append({"input_ids": x["input_ids"], "position_ids": x["position_ids"],
                          "shift_labels": x["shift_labels"], "meta": x.meta,
                          "num_valid_tokens": x.num_valid_tokens_local})
        return self.run(local)

    def run(self, local: list, n_global=None, *, train: bool = True) -> torch.Tensor:
        """:meth:`__call__` on microbatches already sharded for this CP rank: dicts of ``input_ids``,
        ``position_ids``, ``shift_labels`` (``[b, L]``), ``meta`` (the CP batch meta) and
        ``num_valid_tokens``; ``n_global``: the step's valid-token count over the stage's DP x CP ranks
        (None: counted here, one all-reduce). ``train=False``: forward only (the schedule's ``eval``;
        evaluation), nothing accumulated."""
        if self.stage.router is None and getattr(self.stage.config, "output_router_logits", False) \
                and train and not self.without_router_loss:
            raise CPConfigError("model.config.output_router_logits", "the model's objective has the MoE router loss, "
                                "but the stage has no StageRouterLoss to compute it across stages",
                                fix="set stage.router (pipeline_parallel.router.StageRouterLoss), or "
                                    "output_router_logits: false")
        mesh = self.mesh
        shapes = {tuple(x["position_ids"].shape[-2:]) for x in local}
        if len(shapes) != 1:
            raise CPConfigError("data", f"pipeline microbatches must share one [rows, local length]; got {sorted(shapes)}",
                                fix="collate every microbatch of a step to the same rows and sequence length")
        (b, L), = shapes
        dtype = self.activation_dtype or next(self.stage.parameters()).dtype
        pipes, sched = self._pipe(len(local), b, L, dtype)
        if n_global is None:
            n_local = torch.tensor(sum(int(x["num_valid_tokens"]) for x in local), dtype=torch.int64, device=self.device)
            n_global = P.all_reduce(n_local, mesh.dp_cp_mesh.get_group())
        n_global = max(int(n_global), 1)
        self.stage.loss_scale = self.grad_scale / n_global
        cat = {k: torch.cat([x[k] for x in local]).to(self.device) for k in ("input_ids", "position_ids",
                                                                             "shift_labels")}
        losses: list = []
        with contextlib.ExitStack() as stack:
            for pipe in pipes:
                stack.enter_context(_per_microbatch(pipe, [x["meta"] for x in local], self.stage.router))
            args = (cat["input_ids"],) if self.stage.is_first else ()
            target = torch.zeros(len(local), device=self.device) if self.stage.is_last else None
            run = sched.step if train else sched.eval
            run(*args, target=target, losses=losses, return_outputs=False, position_ids=cat["position_ids"],
                shift_labels=cat["shift_labels"])
        # the loss value: the last stage's (scaled) sums, back to sum / n_global, shared over pp and dp x cp
        value = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.stage.is_last:      # the token loss only: the router loss (router.py) is reported apart
            total = torch.stack([x.detach().float() for x in losses]).sum()
            if self.stage.router is not None and train:
                total = total - sum(aux for aux, _counts in self.stage.router.values) * self.stage.router.scale
            value = total / self.grad_scale
        value = P.all_reduce(value, mesh.dp_cp_mesh.get_group())
        return P.all_reduce(value, mesh.pp_mesh.get_group())


@contextlib.contextmanager
def _per_microbatch(pipe, metas: list, router=None):
    """Run each microbatch's forward and backward of ``pipe`` inside its own CP batch context (and
    tell the router loss which microbatch a forward is)."""
    fwd, bwd = pipe.forward_one_chunk, pipe.backward_one_chunk

    def context(i: int):     # no meta: CP=1 with no method installed (the model's own forward)
        return contextlib.nullcontext() if metas[i] is None else cp_batch_context(metas[i])

    def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
        if router is not None:
            router.microbatch = fwd_chunk_id
        with context(fwd_chunk_id):
            return fwd(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
        with context(bwd_chunk_id):
            return bwd(bwd_chunk_id, *args, **kwargs)

    pipe.forward_one_chunk, pipe.backward_one_chunk = forward_one_chunk, backward_one_chunk
    try:
        yield
    finally:
        del pipe.forward_one_chunk, pipe.backward_one_chunk


def reduce_stage_grads(stage: torch.nn.Module, mesh) -> None:
    """Without FSDP: sum every gradient of the stage over its DP x CP ranks (``mesh.dp_cp_mesh``)."""
    group = mesh.dp_cp_mesh.get_group()
    if P.group_size(group) == 1:
        return
    for p in stage.parameters():
        if p.grad is not None:
            p.grad.copy_(P.all_reduce(p.grad, group))
