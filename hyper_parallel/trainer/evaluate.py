"""Held-out evaluation: the global token-mean loss (and perplexity) of the model on the first
``data.eval_batches`` micro-batches of the held-out stream — the same rows at every evaluation,
DP ranks reading disjoint rows, every CP rank its shard.

Same batch contract and loss as a training step (:func:`~hyper_parallel.trainer.step.run_step`):
``prepare_batch`` -> forward inside the batch's CP context -> local loss sum; then one SUM over
``dp_cp_mesh`` of the valid-target count and one of the loss sums, so the value equals CP=1 on
every DP rank's rows concatenated. No gradients, no optimizer, no data-position change.
"""
from __future__ import annotations

import math

import torch

from .loss import global_token_count, reduce_loss_value

__all__ = ["evaluate"]


def evaluate(trainer, stream) -> dict:
    """Collective over the world. -> ``{"step", "eval_loss", "eval_ppl", "eval_tokens"}``."""
    n_batches = trainer.cfg.data.eval_batches
    batches = [stream.batcher.batch(i) for i in range(n_batches)]
    was_training = trainer.model.training
    trainer.model.eval()
    trainer.capture_logits = False
    run = _evaluate_pipeline if getattr(trainer, "pipeline", None) is not None else _evaluate_local
    try:
        with torch.no_grad():
            value, n_global = run(trainer, batches)
    finally:
        trainer.model.train(was_training)
    return {"step": trainer.step, "eval_loss": value, "eval_ppl": math.exp(min(value, 80.0)),
            "eval_tokens": int(n_global)}


def _evaluate_local(trainer, batches: list) -> tuple:
    """(global mean loss, global valid targets): each micro-batch's forward in its CP context."""
    loss_sum = torch.zeros((), dtype=torch.float32, device=trainer.device)
    n_local = 0
    for b in batches:
        p = trainer.prepare_batch(b)
        with trainer.batch_context(p):
            with trainer.autocast():
                _, s, n = trainer.compute_loss(p)
        trainer.router_stats = None
        loss_sum += s.detach().float()
        n_local += int(n)
    n_global = global_token_count(n_local, trainer.mesh.dp_cp_mesh, trainer.device)
    return float(reduce_loss_value(loss_sum, n_global, trainer.mesh.dp_cp_mesh)), n_global


def _evaluate_pipeline(trainer, batches: list) -> tuple:
    """(global mean loss, global valid targets): the micro-batches through the schedule's forward
    (pp_size > 1)."""
    from .pipeline import pipeline_forward_backward

    prepared = [trainer.prepare_batch(b) for b in batches]
    n_global = global_token_count(sum(p.num_valid_tokens for p in prepared), trainer.mesh.dp_cp_mesh, trainer.device)
    return float(pipeline_forward_backward(trainer, prepared, n_global, train=False)[0]), n_global
