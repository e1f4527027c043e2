"""BaseTrainer: the training-step lifecycle (design section 2.3) for any causal-LM-like task.

One optimizer step::

  global micro-batches (same on every CP rank of a DP rank)          ``next_micro_batches``
    -> prepare: CP>1 ``shard_batch_for_cp`` (local input_ids, global position_ids,
                global-shift ``shift_labels``, CPBatchMeta); CP=1 the plain batch
    -> N = valid targets of *all* micro-batches, summed over ``dp_cp_mesh``   (one all-reduce)
    -> per micro-batch, inside ``cp_batch_context(meta)`` (forward *and* backward, so
       activation-checkpoint recomputation sees the same meta):
         forward (declared CP wrappers, no HF attention_mask) -> local logits
         local_loss_sum (never gathered at the CP boundary)
         loss = local_loss_sum / N * grad_scale  -> backward
    -> gradient reduction: FSDP2 (reduce-scatter, averaged over the fsdp mesh, hence
       grad_scale = fsdp mesh size) or, without FSDP, one SUM all-reduce over dp_cp_mesh
    -> global-norm clipping (DTensor norms reduced with ``full_tensor``)
    -> optimizer.step, LR scheduler step

With ``accelerator.cp_size == 1`` no CP code is on the path: no ``shard_batch_for_cp``, no
wrappers, no meta; the loss is bit for bit Hugging Face's ``labels=`` loss.

Subclasses provide the data (:meth:`build_data`) and the per-micro-batch loss
(:meth:`compute_loss`); :class:`~hyper_parallel.trainer.text.TextTrainer` does byte-level
text.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed.errors import CPConfigError
from ..distributed.infrastructure import DistributedSetup, setup_distributed
from ..distributed.preflight import agree_or_raise
from ..platform import all_gather_object, all_reduce, get_platform, init_distributed, set_default_timeout
from ..platform.faults import maybe_inject_fault
from . import checkpoint as ckpt
from .config import TrainerConfig
from .loss import global_token_count, mean_global_loss, reduce_loss_value
from .metrics import Progress, RunLog
from .model import HyperAutoModel

log = logging.getLogger("hyper_parallel.trainer")

@dataclasses.dataclass
class PreparedBatch:
    """One micro-batch ready for forward on this rank."""

    inputs: dict                    # model kwargs (input_ids, position_ids)
    shift_labels: torch.Tensor      # local next-token targets (global shift)
    num_valid_tokens: int           # local targets != ignore_index
    meta: Any = None                # CPBatchMeta when CP > 1
    seq_len: int = 0                # global (unpadded) sequence length of the micro-batch
    local: Any = None               # the shard_batch_for_cp result (CP > 1)


@dataclasses.dataclass
class StepProbe:
    """What :meth:`BaseTrainer.train_step` should capture for parity tests / debugging."""

    logits: bool = False   # global logits per micro-batch (gathered over CP with gather_from_cp)
    grads: bool = False    # full gradient of every parameter (before clipping)
    params: bool = False   # full parameters after the optimizer step


@dataclasses.dataclass
class StepResult:
    step: int
    loss: float
    valid_tokens: int
    grad_norm: float | None
    lr: float
    time_s: float
    tokens_per_s: float
    logits: list | None = None
    grads: dict | None = None
    params: dict | None = None

    def record(self) -> dict:
        return {"step": self.step, "loss": self.loss, "valid_tokens": self.valid_tokens,
                "grad_norm": self.grad_norm, "lr": self.lr, "time_s": round(self.time_s, 4),
                "tokens_per_s": round(self.tokens_per_s, 1)}


def clean_param_name(name: str) -> str:
    for wrapped in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapped, "")
    return name


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A full, plain copy (collective for DTensors: every rank must call in the same order)."""
    if _is_dtensor(t):
        t = t.full_tensor()
    return t.detach().clone()


def clip_grad_norm_global(parameters, max_norm: float | None, foreach: bool | None = None) -> torch.Tensor:
    """Clip by the global 2-norm over every gradient; return the (pre-clip) total norm.

    Plain tensors: exactly ``torch.nn.utils.clip_grad_norm_``. DTensors (FSDP/TP): norms are
    computed per (mesh, placements) group and reduced with ``full_tensor()``, so shards are
    summed and replicas counted once — the norm of the full gradient, identical on all ranks.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.tensor(0.0)
    if not any(_is_dtensor(g) for g in grads):
        if max_norm is None:
            return torch.nn.utils.get_total_norm(grads, 2.0, False, foreach)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=foreach)
    groups: dict = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if _is_dtensor(g) else ("local",)
        groups.setdefault(key, []).append(g)
    squares = []
    for key in sorted(groups, key=str):
        norm = torch.nn.utils.get_total_norm(groups[key], 2.0, False, foreach)
        if _is_dtensor(norm):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum().sqrt()
    if max_norm is not None:
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total


def _check_same_config_on_every_rank(cfg: TrainerConfig) -> None:
    """Every rank must run the same config: a per-rank difference would pair different
    collectives across ranks. One object all-gather of per-section digests; on a mismatch every
    rank raises the same CPConfigError naming the first differing section and the ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    import hashlib
    import json

    digests = {name: hashlib.sha256(json.dumps(section, sort_keys=True, default=str).encode()).hexdigest()
               for name, section in sorted(cfg.to_dict().items())}
    everyone = all_gather_object(digests)
    for name in digests:
        differ = [r for r, d in enumerate(everyone) if d.get(name) != everyone[0].get(name)]
        if differ:
            raise CPConfigError(name, f"the '{name}' section differs between ranks: rank(s) {differ} "
                                f"were launched with another '{name}' than rank 0",
                                fix="launch every rank with the same YAML and the same overrides")


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
        _check_same_config_on_every_rank(cfg)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.is_main = self.rank == 0
        torch.manual_seed(cfg.schedule.seed)
        if model is None:  # agreed: a bad model config on one rank fails every rank here
            model = agree_or_raise(lambda: HyperAutoModel.from_config(cfg.model), what="model build")
        self.setup: DistributedSetup = setup_distributed(cfg.accelerator, cfg.plan_overrides, model, self.platform)
        self.mesh = self.setup.mesh
        self.cp_size = cfg.accelerator.cp_size
        # fail fast on a topology mismatch, before parallelizing; called on every rank even
        # without resume_from so that the ranks' agreement steps stay paired
        ckpt.validate_resume(cfg.schedule.resume_from, ckpt.topology_of(self.mesh))
        self.cp_policy = None   # shard_batch_for_cp policy, from the sharding plan (CP > 1)
        self.sharding_plan = None
        self.device = self.platform.device(_local_rank())
        model = model.to(self.device)
        self.model, self.tp_grad_info = self.parallelize(model)
        self.uses_fsdp = _has_fsdp(self.model)
        self.tp_partial_params = self._tp_head_local_params()
        self.grad_scale = float(self.mesh.fsdp_mesh.size()) if self.uses_fsdp else 1.0
        self.optimizer = self.build_optimizer()
        self.scheduler = self.build_scheduler()
        self.data = self.build_data()
        self.step = 0
        out_dir = Path(cfg.logging.out_dir)
        self.ckpt_root = Path(cfg.schedule.checkpoint_dir) if cfg.schedule.checkpoint_dir else out_dir / "checkpoints"
        self.run_log = RunLog(out_dir, json_name=cfg.logging.json_log, plot_name=cfg.logging.plot_file,
                              is_main=self.is_main, meta=self._log_meta())
        if cfg.schedule.resume_from:
            self.load_checkpoint(cfg.schedule.resume_from)

    # ------------------------------------------------------------------ set-up pieces
    def parallelize(self, model: nn.Module):
        """TP placement -> declared CP wrappers -> activation checkpointing -> FSDP2 (applier).

        A single rank with no parallelism and fp32 keeps the plain HF model (activation
        checkpointing through HF's non-reentrant gradient checkpointing). ``mixed_precision:
        bf16`` is FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` with fp32
        master weights — on every topology, a 1-rank FSDP mesh included, so CP=1 and CP>1 run
        the same bf16 arithmetic.
        """
        acc = self.cfg.accelerator
        ac = self.cfg.schedule.activation_checkpointing
        bf16 = self.cfg.schedule.mixed_precision == "bf16"
        if self.mesh.world_size == 1 and acc.tp_size == 1 and self.cp_size == 1 and not bf16:
            if ac:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return model, None
        from ..distributed.sharding_applier import apply_sharding_plan
        from ..distributed.sharding_planner import ShardingPlanner

        # agreed across ranks like the preflight: a planning error on one rank (say a TP-local
        # head check) fails every rank here, before TP / FSDP issue their first collective
        plan = agree_or_raise(lambda: ShardingPlanner(plan_overrides=self.cfg.plan_overrides).plan(
            model, self.mesh, tp_size=acc.tp_size, cp_size=acc.cp_size, ep_size=acc.ep_size,
            sequence_parallel=acc.sequence_parallel, loss_parallel=acc.loss_parallel), what="sharding plan")
        mp_policy = None
        if bf16:
            if self.fsdp is False:
                raise CPConfigError("schedule.mixed_precision", "bf16 is FSDP2's mixed-precision policy, but "
                                    f"{type(self).__name__}.fsdp is False", fix="enable FSDP or drop bf16")
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # CP preflight proof (accelerator.cp_preflight_proof): before FSDP, on the probe batch
        # sharded by this trainer's batch contract; a refusal fails every rank before the first step
        proof = ({"pad_token_id": self.cfg.data.pad_token_id, "ignore_index": self.cfg.data.ignore_index}
                 if acc.cp_preflight_proof else False)
        model, tp_grad_info = apply_sharding_plan(model, plan, self.mesh, mode="production",
                                                  fsdp=True if bf16 else self.fsdp, mp_policy=mp_policy,
                                                  activation_checkpointing=ac, preflight_proof=proof)
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
                "cp_policy": self.cp_policy, "fsdp": self.uses_fsdp, "grad_scale": self.grad_scale,
                "plan": self.setup.plan.summary()}

    # ------------------------------------------------------------------ batch + loss
    def prepare_batch(self, batch: dict) -> PreparedBatch:
        ignore = self.cfg.data.ignore_index
        seq_len = int(batch["input_ids"].shape[1])
        if self.cp_size == 1:
            _check_right_padded(batch.get("attention_mask"))
            labels = batch["labels"]
            shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore)
            inputs = {"input_ids": batch["input_ids"].to(self.device)}
            if "position_ids" in batch:
                inputs["position_ids"] = batch["position_ids"].to(self.device)
            return PreparedBatch(inputs, shift.to(self.device), int((shift != ignore).sum()), None, seq_len)
        from ..distributed.context_parallel.batch import shard_batch_for_cp

        # a registered model spec's batch contract (register_cp_model_spec(batch_prepare_fn=...))
        # replaces the standard one; same arguments, same CPBatch result
        prepare = getattr(self.sharding_plan, "batch_prepare_fn", None) or shard_batch_for_cp
        local = prepare(batch, self.mesh.cp_mesh, self.cp_policy, ignore_index=ignore,
                        pad_token_id=self.cfg.data.pad_token_id)
        inputs = {"input_ids": _field(local, "input_ids").to(self.device),
                  "position_ids": _field(local, "position_ids").to(self.device)}
        shift = _field(local, "shift_labels").to(self.device)
        return PreparedBatch(inputs, shift, int(local.num_valid_tokens_local), local.meta, seq_len, local)

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
        logits = _full(logits) if _is_dtensor(logits) else logits.detach()
        if prepared.meta is not None:
            from ..distributed.context_parallel.batch import gather_from_cp

            logits = gather_from_cp(logits, self.mesh.cp_mesh, dim=1)  # every layout holds contiguous shards
        return logits[:, :prepared.seq_len].float().cpu().clone()

    # ------------------------------------------------------------------ gradients
    def sync_gradients(self) -> None:
        """Without FSDP: one SUM all-reduce of every gradient over dp_cp_mesh (grad_scale=1)."""
        if self.uses_fsdp or self.mesh.dp_cp_mesh.size() == 1:
            return
        _sum_grads_in_place([p.grad for p in self.model.parameters() if p.grad is not None],
                            self.mesh.dp_cp_mesh.get_group())

    def _tp_head_local_params(self) -> list:
        """Parameters whose per-TP-rank gradient is a partial sum (``TPGradInfo.partial_grad``,
        e.g. Qwen3 ``q_norm``/``k_norm`` acting on TP-local heads)."""
        plan = self.sharding_plan
        if plan is None or plan.tp_size == 1:
            return []
        params = dict(self.model.named_parameters())
        return [params[n] for n in self.tp_grad_info.partial_grad if n in params]

    def sync_tp_partial_grads(self) -> None:
        """SUM over the tp group the gradients of :meth:`_tp_head_local_params` (one all-reduce)."""
        _sum_grads_in_place([p.grad for p in self.tp_partial_params if p.grad is not None],
                            self.mesh.tp_mesh.get_group())

    def named_full(self, what: str) -> dict:
        out = {}
        for name, p in self.model.named_parameters():
            t = p.grad if what == "grad" else p
            if t is None:
                continue
            out[clean_param_name(name)] = _full(t).float().cpu()
        return out

    # ------------------------------------------------------------------ the step
    def train_step(self, micro_batches: list[dict], probe: StepProbe | None = None) -> StepResult:
        """One optimizer step over this DP rank's global micro-batches (see module doc)."""
        t0 = time.perf_counter()
        self.model.train()
        prepared = [self.prepare_batch(b) for b in micro_batches]
        local_tokens = sum(p.num_valid_tokens for p in prepared)
        n_global = global_token_count(local_tokens, self.mesh.dp_cp_mesh, self.device)
        maybe_inject_fault(self.rank, self.step + 1, "forward")   # test hook (platform/faults.py)
        loss_sum_total = torch.zeros((), dtype=torch.float32, device=self.device)
        logits_out = [] if probe and probe.logits else None
        for p in prepared:
            with self.batch_context(p):
                with self.autocast():
                    logits, loss_sum, n_local = self.compute_loss(p)
                if int(n_local) != p.num_valid_tokens:
                    raise RuntimeError(f"valid-token mismatch: loss saw {int(n_local)} targets, the batch "
                                       f"shard declares {p.num_valid_tokens}")
                out = mean_global_loss(loss_sum, n_local, self.mesh.dp_cp_mesh, grad_scale=self.grad_scale,
                                       global_valid_tokens=n_global, reduce_value=False)
                out.loss.backward()
            loss_sum_total += loss_sum.detach().float()
            if logits_out is not None:
                logits_out.append(self.gather_logits(logits, p))
            del logits, loss_sum, out
        self.sync_gradients()
        self.sync_tp_partial_grads()
        loss_value = reduce_loss_value(loss_sum_total, n_global, self.mesh.dp_cp_mesh)
        grads = self.named_full("grad") if probe and probe.grads else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = clip_grad_norm_global(params, self.cfg.optimizer.grad_clip, self.cfg.optimizer.foreach)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        full_params = self.named_full("param") if probe and probe.params else None
        dt = time.perf_counter() - t0
        n = int(n_global)
        return StepResult(self.step, float(loss_value), n, float(grad_norm), lr, dt, n / max(dt, 1e-9),
                          logits_out, grads, full_params)

    # ------------------------------------------------------------------ loop
    def train(self, steps: int | None = None) -> list[StepResult]:
        """Run until ``schedule.steps`` (or ``steps``) optimizer steps are done."""
        total = self.cfg.schedule.steps if steps is None else steps
        ga = self.cfg.schedule.grad_accum_steps
        lcfg, scfg = self.cfg.logging, self.cfg.schedule
        bar = Progress(total, initial=self.step, enabled=self.is_main and lcfg.progress,
                       desc=f"train cp={self.cp_size}")
        results = []
        last_saved = None   # step of the last checkpoint written by this loop
        try:
            while self.step < total:
                maybe_inject_fault(self.rank, self.step + 1, "step")  # test hook (platform/faults.py)
                res = self.train_step(self.data.next_micro_batches(ga))
                results.append(res)
                self.run_log.append(res.record())
                bar.update(res.loss, res.tokens_per_s, res.lr)
                if self.step % lcfg.log_every == 0 and not lcfg.progress and self.is_main:
                    print(f"step {res.step}/{total} loss={res.loss:.4f} tok/s={res.tokens_per_s:,.0f}", flush=True)
                if scfg.save_every and self.step % scfg.save_every == 0:
                    self.save_checkpoint()
                    last_saved = self.step
        finally:
            bar.close()
        if scfg.save_every and results and last_saved != self.step:
            self.save_checkpoint()   # the final state is always resumable
        self.run_log.write(plot=lcfg.plot)
        return results

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        path = Path(path) if path is not None else ckpt.step_dir(self.ckpt_root, self.step)
        out = ckpt.save_checkpoint(path, self.model, self.optimizer, step=self.step,
                                   data_position=self.data.position, topology=ckpt.topology_of(self.mesh),
                                   scheduler_state=self.scheduler.state_dict(),
                                   extra={"config": self.cfg.to_dict()})
        self.run_log.write(plot=False)
        if self.is_main:
            log.info("saved checkpoint %s", out)
        return out

    def load_checkpoint(self, path: str | Path) -> dict:
        meta = ckpt.load_checkpoint(path, self.model, self.optimizer, topology=ckpt.topology_of(self.mesh))
        self.step = int(meta["step"])
        self.data.load_state_dict({"position": meta["data_position"]})
        if meta.get("scheduler"):
            self.scheduler.load_state_dict(meta["scheduler"])
        self.run_log.load_previous(self.step)
        return meta


# ---------------------------------------------------------------------- helpers
def bind_local_device(platform) -> None:
    """CUDA/NPU: pin this process to its local device (LOCAL_RANK) before the process group
    starts, so NCCL/HCCL ranks do not all land on device 0. No-op on CPU."""
    mod = platform.device_module()
    if mod is not None and hasattr(mod, "set_device"):
        mod.set_device(_local_rank())


def _local_rank() -> int:
    import os

    return int(os.environ.get("LOCAL_RANK", "0"))


def _has_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _field(local, name: str):
    if isinstance(local, dict):
        return local[name]
    if hasattr(local, name):
        return getattr(local, name)
    return local[name]


def _check_right_padded(mask) -> None:
    """CP=1 passes no attention_mask: padding must be a suffix of each row (collator contract)."""
    if mask is None:
        return
    m = mask.to(torch.int64)
    if bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError("attention_mask has padding before valid tokens: the trainer's batches must be "
                         "right-padded documents (no left padding, no packing)")


def _sum_grads_in_place(grads: list, group) -> None:
    """SUM-all-reduce ``grads`` (local shards of DTensor grads) over ``group`` in one flat collective."""
    if not grads:
        return
    local = [g.to_local() if _is_dtensor(g) else g for g in grads]
    flat = all_reduce(torch.cat([g.reshape(-1) for g in local]), group, op=dist.ReduceOp.SUM)
    offset = 0
    for g in local:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
