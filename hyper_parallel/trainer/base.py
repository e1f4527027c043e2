"""BaseTrainer: YAML config -> distributed model -> optimizer steps, for any causal-LM-like task.

This module builds the run (distributed set-up, sharding, optimizer, LR schedule, data, logs,
checkpoints) and runs the loop; the step itself is :mod:`~hyper_parallel.trainer.step` (batch ->
CP shard -> forward -> local loss -> reductions -> step). The other jobs live where their names
say: :mod:`.batch_prep` (the batch contract, the same at every CP size), :mod:`.grad_utils`
(full copies, global-norm clipping, flat SUM reduction), :mod:`.tp_sync` (TP partial gradients),
:mod:`.config_agreement` (every rank runs the same config).

Subclasses provide the data (:meth:`BaseTrainer.build_data`) and the per-micro-batch loss
(:meth:`BaseTrainer.compute_loss`); :class:`~hyper_parallel.trainer.text.TextTrainer` does
byte-level text. The names ``PreparedBatch``, ``StepProbe``, ``StepResult``,
``clip_grad_norm_global`` and ``clean_param_name`` stay importable from here.
"""
from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed.errors import CPConfigError
from ..distributed.infrastructure import DistributedSetup, setup_distributed
from ..distributed.plan import apply_sharding_plan
from ..distributed.preflight import agree_or_raise
from ..platform import all_reduce, get_platform, init_distributed, set_default_timeout
from ..platform.faults import maybe_inject_fault
from ..platform.shutdown import stop_if_launcher_gone
from . import checkpoint as ckpt
from .activation_offload import check_activation_offload, install_activation_offload
from .batch_prep import PreparedBatch, prepare_batch
from .config import TrainerConfig
from .config_agreement import check_same_config_on_every_rank
from .config_warnings import config_warnings
from .device_setup import bind_local_device, local_rank as _local_rank
from .grad_utils import clean_param_name, clip_grad_norm_global, full_copy, is_dtensor, named_full, sum_grads_in_place
from .metrics import Progress, RunLog, check_output_paths
from .model import check_fsdp_dtypes, head_probe_model, is_meta_model, materialize, run_model
from .nonfinite import NonFiniteError, NonFiniteGuard
from .media import check_media_run, freeze_vision_tower
from .pipeline import adopt_stage, check_pipeline_head, check_pipeline_run, make_pipeline, virtual_stages
from .step import StepProbe, StepResult, run_step
from .tiled_mlp import install_tiled_mlp
from .token_id_checks import checked_token_ids
from .tp_sync import sync_tp_partial_grads, tp_partial_params

__all__ = ["BaseTrainer", "PreparedBatch", "StepProbe", "StepResult", "clip_grad_norm_global",
           "clean_param_name", "bind_local_device"]

log = logging.getLogger("hyper_parallel.trainer")


def _bf16_policy():
    """FSDP2's bf16 mixed precision: bf16 parameters in compute, fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class BaseTrainer:
    """YAML config -> distributed model -> optimizer steps. See the module doc for the step."""

    #: FSDP2 switch passed to ``apply_sharding_plan``: None = on whenever the FSDP mesh has more
    #: than one rank (or bf16 is requested). False keeps replicated parameters and SUM-all-reduces
    #: gradients over dp_cp_mesh instead (grad_scale 1).
    fsdp: bool | None = None

    def __init__(self, cfg: TrainerConfig, *, model: nn.Module | None = None):
        self.cfg = cfg
        self.platform = get_platform(cfg.accelerator.device_type)
        bind_local_device(self.platform)
        if cfg.accelerator.comm_timeout_s is not None:  # before any group exists (see setup)
            set_default_timeout(cfg.accelerator.comm_timeout_s)
        init_distributed(self.platform)
        check_same_config_on_every_rank(cfg)
        # every output path writable before anything is built (agreed: the same error on every rank)
        agree_or_raise(lambda: check_output_paths(
            cfg.logging, (cfg.schedule.checkpoint_dir or Path(cfg.logging.out_dir) / "checkpoints")
            if cfg.schedule.save_every else None), what="output paths", same_error=True)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.is_main = self.rank == 0
        check_activation_offload(cfg.schedule, cfg.accelerator.tp_size)   # local: the same error on every rank
        check_pipeline_run(cfg, model=False)      # local too; the model is checked in setup_distributed
        check_media_run(cfg)
        if self.is_main:
            for line in config_warnings(cfg, self.platform.device_type):
                log.warning("%s", line)
        torch.manual_seed(cfg.schedule.seed)
        if model is None:  # agreed: a bad model config on one rank fails every rank here
            # built on the meta device: parallelize() shards it, then each rank materializes its shards
            # (the vocabulary rule of vocab_rule.py: vocab_size set from the data when not given,
            # refused below the data's ids, a model.path checkpoint's resized up)
            # token ids checked against the built vocabulary here too (the CLI checks them at config
            # load): an id past the embedding would fail one rank inside the preflight's collective
            model = agree_or_raise(lambda: checked_token_ids(cfg, run_model(cfg), say=self.is_main), what="model build")
        if cfg.accelerator.pp_size > 1:     # the last stage's tiled loss, proved on a probe (all ranks alike)
            check_pipeline_head(model, cfg)
        self.setup: DistributedSetup = setup_distributed(cfg.accelerator, cfg.plan_overrides, model, self.platform,
                                                         packed_documents=cfg.data.packed_documents,
                                                         packed_rows=cfg.data.packing,
                                                         virtual_stages=virtual_stages(cfg.schedule))
        self.mesh = self.setup.mesh
        self.cp_size = cfg.accelerator.cp_size
        if self.setup.stage is not None:      # pp_size > 1: this rank trains its stage (cut in setup_distributed)
            model = adopt_stage(self.setup, model)
        # fail fast on a topology mismatch, before parallelizing; called on every rank even
        # without resume_from so that the ranks' agreement steps stay paired
        self.ckpt_root = (Path(cfg.schedule.checkpoint_dir) if cfg.schedule.checkpoint_dir
                          else Path(cfg.logging.out_dir) / "checkpoints")
        self._resume_meta = ckpt.validate_resume(cfg.schedule.resume_from, ckpt.topology_of(self.mesh),
                                                 root=self.ckpt_root,
                                                 allow_unverified=cfg.schedule.allow_unverified_checkpoint)
        self.cp_policy = None   # shard_batch_for_cp policy, from the sharding plan (CP > 1)
        self.sharding_plan = None
        self.device = self.platform.device(_local_rank())
        self.meta_build = is_meta_model(model)
        if not self.meta_build:
            model = model.to(self.device)
        # a pipeline's last stage computes the tiled loss itself (pipeline_parallel/stages.py)
        self.tiled_head = self.install_loss_head(model) if self.setup.stage is None else None
        self.tiled_mlp = (install_tiled_mlp(model, self.cfg.schedule.tiled_mlp_chunk_size,
                                            tp_size=self.cfg.accelerator.tp_size)
                          if self.cfg.schedule.tiled_mlp else [])
        self.capture_logits = False      # run_step sets it when a probe asks for the logits
        if cfg.model.freeze_vision_tower:  # before the optimizer and the gradient sync read requires_grad
            freeze_vision_tower(model)
        self.model, self.tp_grad_info = self.parallelize(model)
        self.activation_offload = (install_activation_offload(self.model, self.platform)
                                   if cfg.schedule.activation_offload else [])
        self.uses_fsdp = _has_fsdp(self.model)
        self.tp_partial_params = tp_partial_params(self.model, self.sharding_plan, self.tp_grad_info)
        self.grad_scale = float(self.mesh.fsdp_mesh.size()) if self.uses_fsdp else 1.0
        self.optimizer = self.build_optimizer()
        self.pipeline = make_pipeline(self) if self.setup.stage is not None else None
        self.scheduler = self.build_scheduler()
        self.data = self.build_data()
        self.step = 0
        self.last_checkpoint = None   # the newest checkpoint saved or resumed from (the stop message names it)
        self.nonfinite = NonFiniteGuard(cfg)   # schedule.on_nonfinite; counts this run's skipped steps
        out_dir = Path(cfg.logging.out_dir)
        self.run_log = RunLog(out_dir, json_name=cfg.logging.json_log, plot_name=cfg.logging.plot_file,
                              is_main=self.is_main, meta=self._log_meta(),
                              tensorboard_dir=out_dir / "tensorboard" if cfg.logging.tensorboard else None)
        if cfg.schedule.resume_from:
            self.load_checkpoint(cfg.schedule.resume_from)

    # ------------------------------------------------------------------ set-up pieces
    def install_loss_head(self, model: nn.Module):
        """``loss.tiled``: the model's LM head becomes the tiled loss (:mod:`.tiled_head`), before any
        parallelization, after a probe proves it reproduces the model's own logits; else None (the
        untiled loss), with a log line saying why."""
        lc = self.cfg.loss
        if not lc.tiled:
            return None
        from .tiled_head import install_tiled_head, verify_tiled_head

        # a meta-built model holds no values yet: the probe runs on a small twin (same class and head config)
        probe = head_probe_model(model) if is_meta_model(model) else model
        reason = verify_tiled_head(probe, chunk_size=lc.chunk_size, ignore_index=self.cfg.data.ignore_index)
        if reason is not None:
            if self.is_main:
                log.warning("loss.tiled: falling back to the untiled loss ([S_local, vocab] logits): %s", reason)
            return None
        return install_tiled_head(model, chunk_size=lc.chunk_size, ignore_index=self.cfg.data.ignore_index)

    def parallelize(self, model: nn.Module):
        """Apply the run's plan (built once in :func:`setup_distributed`): TP placement -> declared
        CP wrappers -> activation checkpointing -> FSDP2 (:func:`apply_sharding_plan`).

        A single rank with no parallelism, fp32 and no method installed at cp 1 (``at_cp1``: DSA,
        Doge) keeps the plain HF model (activation checkpointing through HF's non-reentrant
        gradient checkpointing). ``mixed_precision:
        bf16`` is FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` with fp32
        master weights — on every topology, a 1-rank FSDP mesh included, so CP=1 and CP>1 run
        the same bf16 arithmetic.
        """
        plan = self.setup.plan
        ac = self.cfg.schedule.activation_checkpointing
        bf16 = self.cfg.schedule.mixed_precision == "bf16"
        materialize_fn = (lambda m: materialize(m, self.device)) if is_meta_model(model) else None
        if self.mesh.world_size == 1 and plan.tp_size == 1 and plan.cp_size == 1 and not bf16 and not plan.cp_targets:
            if materialize_fn is not None:
                materialize_fn(model)
            if ac:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return model, None
        if bf16 and self.fsdp is False:
            raise CPConfigError("schedule.mixed_precision", "bf16 is FSDP2's mixed-precision policy, but "
                                f"{type(self).__name__}.fsdp is False", fix="enable FSDP or drop bf16")
        shards = bf16 or (self.fsdp if self.fsdp is not None else self.mesh.fsdp_mesh.size() > 1)
        if shards:                              # FSDP2 needs one parameter dtype: refused at model.dtype
            check_fsdp_dtypes(model, self.cfg.model.dtype)
        # CP preflight proof (accelerator.cp_preflight_proof): before FSDP, on the probe batch
        # sharded by this trainer's batch contract; a refusal fails every rank before the first step
        # (a pipeline stage is not a whole model: the proof does not run on it, docs/pipeline_parallel.md)
        proof = ({"pad_token_id": self.cfg.data.pad_token_id, "ignore_index": self.cfg.data.ignore_index}
                 if self.cfg.accelerator.cp_preflight_proof and self.setup.stage is None else False)
        model, tp_grad_info = apply_sharding_plan(
            model, plan, self.mesh, mode="production", fsdp=True if bf16 else self.fsdp,
            mp_policy=_bf16_policy() if bf16 else None, activation_checkpointing=ac, preflight_proof=proof,
            materialize=materialize_fn)
        self.sharding_plan = plan
        self.cp_policy = plan.batch_policy
        return model, tp_grad_info

    def build_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optimizer
        params = [p for p in self.model.parameters() if p.requires_grad]
        if o.name.lower() == "adamw":
            return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                     weight_decay=o.weight_decay, foreach=o.foreach)
        return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay, foreach=o.foreach)

    def build_scheduler(self):
        s = self.cfg.schedule
        warm, total, floor = s.warmup_steps, max(s.steps, 1), s.min_lr_ratio

        def factor(i: int) -> float:
            if warm and i < warm:
                return (i + 1) / warm
            if s.lr_schedule == "cosine":
                progress = min(1.0, (i - warm) / max(1, total - warm))
                return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
            return 1.0

        return torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)

    def build_data(self):
        """A stream with ``next_micro_batches(n)``, ``position``, ``state_dict``/``load_state_dict``."""
        raise NotImplementedError

    def _log_meta(self) -> dict:
        return {"title": f"{self.cfg.model.architecture or 'model'} cp={self.cp_size} "
                         f"world={self.mesh.world_size}",
                "config": self.cfg.to_dict(), "topology": ckpt.topology_of(self.mesh),
                "cp_policy": None if self.cp_policy is None else str(self.cp_policy), "fsdp": self.uses_fsdp, "grad_scale": self.grad_scale,
                "plan": self.setup.plan.summary()}

    # ------------------------------------------------------------------ batch + loss
    def prepare_batch(self, batch: dict) -> PreparedBatch:
        """The batch contract (:func:`~hyper_parallel.trainer.batch_prep.prepare_batch`): the same
        ``shard_batch_for_cp`` at every CP size, CP=1 a CP group of one."""
        return prepare_batch(batch, cp_mesh=self.mesh.cp_mesh if self.cp_size > 1 else None,
                             cp_size=self.cp_size, policy=self.cp_policy, device=self.device,
                             ignore_index=self.cfg.data.ignore_index, pad_token_id=self.cfg.data.pad_token_id,
                             # a registered model spec's batch contract replaces the standard one
                             prepare_fn=getattr(self.sharding_plan, "batch_prepare_fn", None),
                             packed_documents=self.cfg.data.packed_documents,
                             # methods installed at cp 1 read the meta of the CP group of one
                             keep_meta=bool(getattr(self.sharding_plan, "cp_targets", None)))

    def batch_context(self, prepared: PreparedBatch):
        if prepared.meta is None:
            return contextlib.nullcontext()
        from ..distributed.context_parallel.meta import cp_batch_context

        return cp_batch_context(prepared.meta)

    def autocast(self):
        """Context around each forward (hook for subclasses). bf16 is FSDP2's mixed-precision
        policy (see :meth:`parallelize`), not autocast, so this is a no-op by default."""
        return contextlib.nullcontext()

    def compute_loss(self, prepared: PreparedBatch):
        """-> (local logits, local_loss_sum fp32, local valid tokens)."""
        raise NotImplementedError

    def gather_logits(self, logits: torch.Tensor, prepared: PreparedBatch) -> torch.Tensor:
        logits = full_copy(logits) if is_dtensor(logits) else logits.detach()
        if prepared.meta is not None and self.cp_size > 1:
            from ..distributed.context_parallel.batch import gather_from_cp

            logits = gather_from_cp(logits, self.mesh.cp_mesh, dim=1)  # every layout holds contiguous shards
        return logits[:, :prepared.seq_len].float().cpu().clone()

    # ------------------------------------------------------------------ gradients
    def sync_gradients(self) -> None:
        """Without FSDP: one SUM all-reduce of every gradient over dp_cp_mesh (grad_scale=1). With FSDP,
        the parameters it leaves replicated (a vision tower: docs/vlm.md) get the same sum divided by
        grad_scale — what FSDP's mean reduce-scatter gives its own."""
        if self.mesh.dp_cp_mesh.size() == 1:
            return
        group = self.mesh.dp_cp_mesh.get_group()
        params = [p for p in self.model.parameters() if p.requires_grad and not (self.uses_fsdp and is_dtensor(p))]
        # the ranks agree on which parameters have a gradient (a tower that encoded no medium on this rank
        # has none here): those get one sum on every rank (zeros where absent), the others stay None
        has = all_reduce(torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.device),
                         group, tag="trainer.grads_present") if params else None
        for p, n in zip(params, [] if has is None else has.tolist()):
            if n and p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        sum_grads_in_place(grads, group)
        if self.uses_fsdp:
            for g in grads:
                g.div_(self.grad_scale)

    def sync_tp_partial_grads(self) -> None:
        """SUM over the tp group the gradients of TP partial-gradient parameters (:mod:`.tp_sync`)."""
        sync_tp_partial_grads(self.tp_partial_params, self.mesh.tp_mesh)

    def named_full(self, what: str) -> dict:
        return named_full(self.model, what)

    # ------------------------------------------------------------------ the step
    def train_step(self, micro_batches: list[dict], probe: StepProbe | None = None) -> StepResult:
        """One optimizer step over this DP rank's global micro-batches (:func:`.step.run_step`)."""
        return run_step(self, micro_batches, probe)

    # ------------------------------------------------------------------ loop
    def train(self, steps: int | None = None) -> list[StepResult]:
        """Run until ``schedule.steps`` (or ``steps``) optimizer steps are done. A step whose loss or
        gradient norm is NaN/Inf raises :class:`~.nonfinite.NonFiniteError` on every rank, or with
        ``schedule.on_nonfinite: skip`` is logged as skipped (bounded by ``max_nonfinite_skips``)."""
        total = self.cfg.schedule.steps if steps is None else steps
        ga = self.cfg.schedule.grad_accum_steps
        lcfg, scfg = self.cfg.logging, self.cfg.schedule
        bar = Progress(total, initial=self.step, enabled=self.is_main and lcfg.progress,
                       desc=f"train cp={self.cp_size}")
        results = []
        last_saved = None   # step of the last checkpoint written by this loop
        guard = self.nonfinite
        try:
            while self.step < total:
                stop_if_launcher_gone()   # an orphaned rank (launcher killed) runs no further step
                maybe_inject_fault(self.rank, self.step + 1, "step")  # test hook (platform/faults.py)
                res = self.train_step(self.data.next_micro_batches(ga))
                stop_if_launcher_gone()   # ... and writes no record of the step in flight
                results.append(res)
                try:
                    skipped = guard.check(res, self.last_checkpoint)
                except NonFiniteError:
                    self.run_log.append({**res.record(), "stopped": True})
                    raise
                if skipped and self.is_main:
                    log.warning("step %d: loss %s, grad norm %s: update skipped (schedule.on_nonfinite: skip, "
                                "%d of %d)", res.step, res.loss, res.grad_norm, guard.skipped,
                                scfg.max_nonfinite_skips)
                held_out = self.maybe_evaluate(total)
                self.run_log.append({**res.record(), **skipped, **held_out})
                if held_out and self.is_main:
                    line = (f"step {res.step}: eval loss {held_out['eval_loss']:.4f} "
                            f"ppl {held_out['eval_ppl']:.2f} ({held_out['eval_tokens']} tokens)")
                    bar.write(line) if lcfg.progress else print(line, flush=True)
                bar.update(res.loss, res.tokens_per_s, res.lr,
                           None if not res.peak_mem_gb_per_rank else max(res.peak_mem_gb_per_rank), res.router_loss)
                if self.step % lcfg.log_every == 0 and self.is_main:
                    load = ""
                    if res.expert_load:     # MoE: tokens per expert of the balancing domain, max / mean
                        load = (f" expert load max/mean={res.expert_load.get('max_over_mean', float('nan')):.2f}"
                                f" (max {res.expert_load.get('max', 0):.1f}, mean {res.expert_load.get('mean', 0):.1f} tokens)")
                        if "ep_max_over_mean" in res.expert_load:
                            load += f"; EP ranks' rows max/mean={res.expert_load['ep_max_over_mean']:.2f}"
                    if not lcfg.progress:
                        print(f"step {res.step}/{total} loss={res.loss:.4f} tok/s={res.tokens_per_s:,.0f}{load}",
                              flush=True)
                    elif load:
                        bar.write(f"step {res.step}:{load}")
                if scfg.save_every and self.step % scfg.save_every == 0:
                    self.save_checkpoint()
                    last_saved = self.step
        finally:
            bar.close()
        if scfg.save_every and results and last_saved != self.step:
            self.save_checkpoint()   # the final state is always resumable
        self.run_log.write(plot=lcfg.plot)
        return results

    def maybe_evaluate(self, total: int) -> dict:
        """``data.eval_every``: the held-out loss (:mod:`.evaluate`) after every N-th step and after
        step ``total``; ``{}`` otherwise. Collective (every rank calls it after every step)."""
        every, held = self.cfg.data.eval_every, getattr(self, "eval_data", None)
        if not every or held is None or (self.step % every and self.step != total):
            return {}
        from .evaluate import evaluate

        out = evaluate(self, held)
        out.pop("step")
        return out

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        path = Path(path) if path is not None else ckpt.step_dir(self.ckpt_root, self.step)
        out = ckpt.save_checkpoint(path, self.model, self.optimizer, step=self.step,
                                   data_position=self.data.position, topology=ckpt.topology_of(self.mesh),
                                   scheduler_state=self.scheduler.state_dict(),
                                   extra={"config": self.cfg.to_dict(), "data_state": self.data.state_dict()},
                                   keep_last=self.cfg.schedule.keep_last)
        self.run_log.write(plot=False)
        self.last_checkpoint = out
        if self.is_main:
            log.info("saved checkpoint %s", out)
        return out

    def load_checkpoint(self, path: str | Path) -> dict:
        """Collective: restore model, optimizer, step, data position and LR schedule from ``path``
        (``latest``: the newest complete checkpoint in ``ckpt_root``)."""
        verified = getattr(self, "_resume_meta", None)
        if verified is not None and str(path) == str(self.cfg.schedule.resume_from):
            path = verified["path"]   # resolved and verified at construction
        else:
            verified = None
            path = ckpt.resolve_resume(path, self.ckpt_root) if str(path) == ckpt.LATEST else path
        meta = ckpt.load_checkpoint(path, self.model, self.optimizer, topology=ckpt.topology_of(self.mesh),
                                    meta=verified, allow_unverified=self.cfg.schedule.allow_unverified_checkpoint)
        self.step = int(meta["step"])
        # the stream's own state (global rows consumed, epoch, seed) when the checkpoint has it
        self.data.load_state_dict({"position": meta["data_position"], **(meta.get("data_state") or {})})
        if meta.get("scheduler"):
            self.scheduler.load_state_dict(meta["scheduler"])
        self.run_log.load_previous(self.step)
        self.last_checkpoint = Path(path)
        return meta


# ---------------------------------------------------------------------- helpers
def _has_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())
