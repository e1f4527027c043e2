"""One optimizer step, in the order the design states it::

  global micro-batches -> CP shard (every CP size, CP=1 a group of one) -> N = valid targets of
  the step over dp_cp_mesh -> per micro-batch, in cp_batch_context: forward -> local loss sum ->
  loss = sum / N * grad_scale [+ MoE router loss, see router_loss.py] -> backward -> gradient reductions (dp_cp SUM without FSDP, TP
  partial gradients) -> global-norm clipping -> optimizer + LR scheduler step (a NaN/Inf loss or
  gradient norm on any rank: no optimizer update on any rank, see nonfinite.py)

The trainer supplies the pieces (:class:`~hyper_parallel.trainer.base.BaseTrainer` hooks:
``prepare_batch``, ``batch_context``, ``autocast``, ``compute_loss``, ``gather_logits``,
``sync_gradients``, ``sync_tp_partial_grads``, ``named_full``); this module only orders them.
"""
from __future__ import annotations

import dataclasses
import time
import warnings

import torch
import torch.distributed as dist

from ..platform import all_gather
from ..platform.faults import maybe_inject_fault
from .grad_utils import clip_grad_norm_global
from .loss import global_token_count, mean_global_loss, reduce_loss_value
from .nonfinite import agree_nonfinite
from .pipeline import pipeline_forward_backward
from .router_loss import router_aux_from_stats, router_spec

__all__ = ["StepProbe", "StepResult", "run_step"]


@dataclasses.dataclass
class StepProbe:
    """What :func:`run_step` should capture for parity tests / debugging."""

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
    peak_mem_gb_per_rank: list | None = None   # every rank's peak memory so far (platform.peak_memory_bytes)
    peak_tensor_gb_per_rank: list | None = None  # every rank's peak tensor storage (platform.peak_tensor_bytes)
    router_loss: float | None = None   # MoE: the step's router aux loss (mean over micro-batches; before coef)
    expert_load: dict | None = None    # MoE: tokens per expert of the domain (summed over layers, micro-batches)
    logits: list | None = None
    grads: dict | None = None
    params: dict | None = None
    nonfinite: bool = False   # loss or grad norm NaN/Inf on some rank: the update was not applied
    attn_work_spread: float | None = None   # slowest/mean attention work per CP rank (balance/split.py)

    def record(self) -> dict:
        return {"step": self.step, "loss": self.loss, "valid_tokens": self.valid_tokens,
                "grad_norm": self.grad_norm, "lr": self.lr, "time_s": round(self.time_s, 4),
                "tokens_per_s": round(self.tokens_per_s, 1),
                "peak_mem_gb": None if not self.peak_mem_gb_per_rank else max(self.peak_mem_gb_per_rank),
                "peak_mem_gb_per_rank": self.peak_mem_gb_per_rank,
                **({} if self.peak_tensor_gb_per_rank is None else
                   {"peak_tensor_gb_per_rank": self.peak_tensor_gb_per_rank}),
                **({} if self.router_loss is None else {"router_loss": self.router_loss,
                                                        "expert_load": self.expert_load}),
                **({"nonfinite": True} if self.nonfinite else {}),
                **({} if self.attn_work_spread is None else {"attn_work_max_over_mean":
                                                             round(self.attn_work_spread, 4)})}


def _work_spread(trainer, prepared: list):
    """Slowest/mean attention work per CP rank of this step (the cost model of the plan's balanced
    split, else of the model's config); logged once at the first step. No collective."""
    if trainer.cp_size < 2:
        return None
    from ..distributed.context_parallel.balance.cost import profile_from_config
    from ..distributed.context_parallel.balance.split import step_work_spread

    profile = getattr(trainer.cp_policy, "profile", None) or profile_from_config(getattr(trainer.model, "config", None))
    value = step_work_spread([p.meta for p in prepared], profile)
    if value is not None and trainer.step == 0 and trainer.rank == 0:   # the start-up line (every step: JSONL)
        extra = "" if hasattr(trainer.cp_policy, "profile") else f"; {profile.describe()}"
        print(f"attention work per rank: max/mean {value:.3f} (first batch; batch policy {trainer.cp_policy}{extra})",
              flush=True)
    return value


def run_step(trainer, micro_batches: list[dict], probe: StepProbe | None = None) -> StepResult:
    """One optimizer step of ``trainer`` over this DP rank's global micro-batches (module doc)."""
    t0 = time.perf_counter()
    mesh, cfg = trainer.mesh, trainer.cfg
    trainer.model.train()
    trainer.capture_logits = bool(probe and probe.logits)     # the tiled loss produces no logits
    # batch -> CP shard (+ the step's global valid-target count: one all-reduce)
    prepared = [trainer.prepare_batch(b) for b in micro_batches]
    work_spread = _work_spread(trainer, prepared)
    n_global = global_token_count(sum(p.num_valid_tokens for p in prepared), mesh.dp_cp_mesh, trainer.device)
    maybe_inject_fault(trainer.rank, trainer.step + 1, "forward")   # test hook (platform/faults.py)
    loss_sum_total = torch.zeros((), dtype=torch.float32, device=trainer.device)
    # MoE router loss (router_loss.py): aux per micro-batch over the domain, mean over micro-batches
    spec = router_spec(trainer)
    if spec is not None:
        local_domain = spec.domain == "local_micro_batch"
        dom_mesh = (mesh.cp_mesh if trainer.cp_size > 1 else None) if local_domain else mesh.dp_cp_mesh
        dp_size = max(1, mesh.dp_cp_mesh.size() // trainer.cp_size)
        weight = 1.0 / len(prepared) / (dp_size if local_domain else 1)
        router_total = torch.zeros((), dtype=torch.float32, device=trainer.device)
        counts_total = torch.zeros(spec.num_experts, dtype=torch.float32, device=trainer.device)
    logits_out = [] if probe and probe.logits else None
    # pp_size > 1: the schedule runs every micro-batch's forward and backward (trainer/pipeline.py)
    pipelined = trainer.pipeline is not None
    if pipelined:     # the global mean (every rank); the router loss formed across the stages
        pipeline_loss, router = pipeline_forward_backward(trainer, prepared, n_global,
                                                          router_weight=weight if spec is not None else None)
        if router is not None:
            router_total, counts_total = router
    for p in ([] if pipelined else prepared):
        # forward -> local loss -> backward, all inside the batch's CP context
        with trainer.batch_context(p):
            with trainer.autocast():
                logits, loss_sum, n_local = trainer.compute_loss(p)
            if int(n_local) != p.num_valid_tokens:
                raise RuntimeError(f"valid-token mismatch: loss saw {int(n_local)} targets, the batch "
                                   f"shard declares {p.num_valid_tokens}")
            out = mean_global_loss(loss_sum, n_local, mesh.dp_cp_mesh, grad_scale=trainer.grad_scale,
                                   global_valid_tokens=n_global, reduce_value=False)
            loss = out.loss
            if spec is not None:   # every rank of the domain holds the same aux (identity-backward sum)
                aux, counts = router_aux_from_stats(trainer.router_stats, spec, dom_mesh)
                loss = loss + (spec.coef * weight * trainer.grad_scale) * aux.to(loss.device)
                router_total += aux.detach().float().to(router_total.device) * weight
                counts_total += counts.to(counts_total.device)
                trainer.router_stats = None
            loss.backward()
        loss_sum_total += loss_sum.detach().float()
        if logits_out is not None:
            logits_out.append(trainer.gather_logits(logits, p))
        del logits, loss_sum, out, loss
    # reductions
    trainer.sync_gradients()
    trainer.sync_tp_partial_grads()
    loss_value = pipeline_loss if pipelined else reduce_loss_value(loss_sum_total, n_global, mesh.dp_cp_mesh)
    router_value = expert_load = None
    if spec is not None:
        if local_domain:   # each DP rank's aux (already / dp): sum over dp_cp, each counted cp times
            router_total = reduce_loss_value(router_total, trainer.cp_size, mesh.dp_cp_mesh)
        router_value = float(router_total)
        c = counts_total.double()
        expert_load = {"tokens_per_expert": [round(float(x), 1) for x in c.tolist()],
                       "max": float(c.max()), "mean": float(c.mean()),
                       "max_over_mean": float(c.max() / c.mean().clamp(min=1e-12))}
        ep = getattr(getattr(trainer, "sharding_plan", None), "ep_size", 1)
        if ep > 1 and c.numel() % ep == 0:   # what each EP rank's experts received (dropless: unbounded by a capacity)
            r = c.view(ep, -1).sum(1)
            expert_load.update(rows_per_ep_rank=[round(float(x), 1) for x in r.tolist()],
                               ep_max_over_mean=float(r.max() / r.mean().clamp(min=1e-12)))
    grads = trainer.named_full("grad") if probe and probe.grads else None
    # clip -> optimizer step
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grad_norm = clip_grad_norm_global(params, cfg.optimizer.grad_clip, cfg.optimizer.foreach,
                                      across=mesh.pp_mesh if pipelined else None)   # every stage's gradients
    lr = float(trainer.optimizer.param_groups[0]["lr"])
    nonfinite = agree_nonfinite(loss_value, grad_norm, trainer.device)   # the same on every rank
    if not nonfinite:
        trainer.optimizer.step()
    with warnings.catch_warnings():   # a skipped first step: torch warns of scheduler before optimizer
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*optimizer.step", category=UserWarning)
        trainer.scheduler.step()      # lr stays a function of the step number, skipped or not
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.step += 1
    full_params = trainer.named_full("param") if probe and probe.params else None
    dt = time.perf_counter() - t0
    n = int(n_global)
    # every rank's peak memory and peak tensor storage (-1: not counted): one all-gather over the world
    tensor_peak = trainer.platform.peak_tensor_bytes()
    peak = torch.tensor([float(trainer.platform.peak_memory_bytes()), float(-1 if tensor_peak is None else tensor_peak)],
                        dtype=torch.float64, device=trainer.device)
    world = dist.group.WORLD if dist.is_initialized() else None
    gathered = all_gather(peak, world, tag="trainer.peak_memory").reshape(-1, 2).tolist()
    peaks = [round(m / 2**30, 4) for m, _ in gathered]
    tensor_peaks = None if any(t < 0 for _, t in gathered) else [round(t / 2**30, 4) for _, t in gathered]
    return StepResult(trainer.step, float(loss_value), n, float(grad_norm), lr, dt, n / max(dt, 1e-9), peaks,
                      tensor_peaks,
                      router_value, expert_load, logits_out, grads, full_params, nonfinite,
                      attn_work_spread=work_spread)
