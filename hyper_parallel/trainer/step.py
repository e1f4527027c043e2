"""One optimizer step (design section 2.3), in the order the design states it::

  global micro-batches -> CP shard (every CP size, CP=1 a group of one) -> N = valid targets of
  the step over dp_cp_mesh -> per micro-batch, in cp_batch_context: forward -> local loss sum ->
  loss = sum / N * grad_scale -> backward -> gradient reductions (dp_cp SUM without FSDP, TP
  partial gradients) -> global-norm clipping -> optimizer + LR scheduler step

The trainer supplies the pieces (:class:`~hyper_parallel.trainer.base.BaseTrainer` hooks:
``prepare_batch``, ``batch_context``, ``autocast``, ``compute_loss``, ``gather_logits``,
``sync_gradients``, ``sync_tp_partial_grads``, ``named_full``); this module only orders them.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from ..platform import all_gather_object
from ..platform.faults import maybe_inject_fault
from .grad_utils import clip_grad_norm_global
from .loss import global_token_count, mean_global_loss, reduce_loss_value

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
    logits: list | None = None
    grads: dict | None = None
    params: dict | None = None

    def record(self) -> dict:
        return {"step": self.step, "loss": self.loss, "valid_tokens": self.valid_tokens,
                "grad_norm": self.grad_norm, "lr": self.lr, "time_s": round(self.time_s, 4),
                "tokens_per_s": round(self.tokens_per_s, 1),
                "peak_mem_gb": None if not self.peak_mem_gb_per_rank else max(self.peak_mem_gb_per_rank),
                "peak_mem_gb_per_rank": self.peak_mem_gb_per_rank}


def run_step(trainer, micro_batches: list[dict], probe: StepProbe | None = None) -> StepResult:
    """One optimizer step of ``trainer`` over this DP rank's global micro-batches (module doc)."""
    t0 = time.perf_counter()
    mesh, cfg = trainer.mesh, trainer.cfg
    trainer.model.train()
    trainer.capture_logits = bool(probe and probe.logits)     # the tiled loss produces no logits
    # batch -> CP shard (+ the step's global valid-target count: one all-reduce)
    prepared = [trainer.prepare_batch(b) for b in micro_batches]
    n_global = global_token_count(sum(p.num_valid_tokens for p in prepared), mesh.dp_cp_mesh, trainer.device)
    maybe_inject_fault(trainer.rank, trainer.step + 1, "forward")   # test hook (platform/faults.py)
    loss_sum_total = torch.zeros((), dtype=torch.float32, device=trainer.device)
    logits_out = [] if probe and probe.logits else None
    for p in prepared:
        # forward -> local loss -> backward, all inside the batch's CP context
        with trainer.batch_context(p):
            with trainer.autocast():
                logits, loss_sum, n_local = trainer.compute_loss(p)
            if int(n_local) != p.num_valid_tokens:
                raise RuntimeError(f"valid-token mismatch: loss saw {int(n_local)} targets, the batch "
                                   f"shard declares {p.num_valid_tokens}")
            out = mean_global_loss(loss_sum, n_local, mesh.dp_cp_mesh, grad_scale=trainer.grad_scale,
                                   global_valid_tokens=n_global, reduce_value=False)
            out.loss.backward()
        loss_sum_total += loss_sum.detach().float()
        if logits_out is not None:
            logits_out.append(trainer.gather_logits(logits, p))
        del logits, loss_sum, out
    # reductions
    trainer.sync_gradients()
    trainer.sync_tp_partial_grads()
    loss_value = reduce_loss_value(loss_sum_total, n_global, mesh.dp_cp_mesh)
    grads = trainer.named_full("grad") if probe and probe.grads else None
    # clip -> optimizer step
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grad_norm = clip_grad_norm_global(params, cfg.optimizer.grad_clip, cfg.optimizer.foreach)
    lr = float(trainer.optimizer.param_groups[0]["lr"])
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.step += 1
    full_params = trainer.named_full("param") if probe and probe.params else None
    dt = time.perf_counter() - t0
    n = int(n_global)
    peaks = [round(b / 2**30, 4) for b in all_gather_object(trainer.platform.peak_memory_bytes())]
    return StepResult(trainer.step, float(loss_value), n, float(grad_norm), lr, dt, n / max(dt, 1e-9), peaks,
                      logits_out, grads, full_params)
