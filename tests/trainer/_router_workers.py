"""Rank functions for the MoE router-loss tests (module-level, picklable; see _workers.py)."""
from __future__ import annotations

import os

import torch

from hyper_parallel.trainer.grad_utils import clip_grad_norm_global

from . import _workers as W

MIXTRAL = os.path.join(W.ROOT, "examples", "models", "tiny_mixtral.yaml")
ASYNC_COLOSSAL = ("hyper_parallel.models.qwen3_moe.adapter.distributed.context_parallel_async."
                  "qwen3_moe_async_colossal_cp_wrapper")
COEF = 0.5   # large, so the router term is visible in every gradient at fp32 tolerance


def moe_cfg(arch: str, **kw) -> dict:
    """make_cfg for a tiny MoE with the router loss on (output_router_logits, router_aux_loss_coef)."""
    method = kw.pop("method", "colossal")
    loss = {k.split("__", 1)[1]: kw.pop(k) for k in [k for k in kw if k.startswith("loss__")]}
    cfg = W.make_cfg("qwen3_moe", method="colossal" if method == "async_colossal" else method, **kw)
    if method == "async_colossal":   # the Qwen3-MoE model adapter's async Colossal (examples/cp/async_colossal.yaml)
        for entry in cfg["plan_overrides"]:
            entry["inner_wrapper"] = {"_target_": ASYNC_COLOSSAL}
    if arch == "mixtral":
        cfg["model"] = {"architecture": "mixtral", "config_file": MIXTRAL, "seed": 0}
    cfg["model"]["config"] = {"output_router_logits": True, "router_aux_loss_coef": COEF}
    if loss:
        cfg["loss"] = loss
    return cfg


def run_moe_steps(cfg: dict, batches: list):
    """TextTrainer steps with gradients probed; returns the losses, router losses, expert loads, grads."""
    from hyper_parallel.trainer.base import StepProbe
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    dp = trainer.mesh.dp_rank
    out = []
    for mbs in batches[dp]:
        r = trainer.train_step(mbs, StepProbe(grads=True))
        out.append({"loss": r.loss, "router_loss": r.router_loss, "expert_load": r.expert_load,
                    "grads": r.grads, "record": r.record()})
    return {"dp_rank": dp, "cp_rank": trainer.mesh.cp_rank, "steps": out}


def _reference_model(cfg: dict):
    """(config, the trainer's model at its seed in train(), AdamW with the config's settings)."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.model import HyperAutoModel

    c = TrainerConfig.from_dict(cfg)
    torch.manual_seed(c.schedule.seed)
    model = HyperAutoModel.from_config(c.model).train()
    o = c.optimizer
    return c, model, torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                       weight_decay=o.weight_decay)


def hf_reference(cfg: dict, batches: list):
    """transformers' own objective at CP=1, one process, written by hand: per micro-batch
    ``model(labels, attention_mask, num_items_in_batch=N, output_router_logits=True).loss`` with its
    aux term scaled by 1/GA (the trainer's step mean), AdamW, clip_grad_norm_."""
    c, model, opt = _reference_model(cfg)
    o = c.optimizer
    coef = model.config.router_aux_loss_coef
    res = []
    for mbs in batches[0]:
        n = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in mbs))
        total = aux_total = 0.0
        for b in mbs:
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                        num_items_in_batch=n, output_router_logits=True, use_cache=False)
            loss = out.loss - coef * out.aux_loss * (1 - 1 / len(mbs))   # HF adds coef*aux per call
            loss.backward()
            total += float((out.loss - coef * out.aux_loss).detach())
            aux_total += float(out.aux_loss.detach()) / len(mbs)
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        clip_grad_norm_global(list(model.parameters()), o.grad_clip)   # the trainer's rule (float64 norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        res.append({"loss": total, "router_loss": aux_total, "grads": grads})
    return res


def hf_reference_per_dp(cfg: dict, batches: list):
    """``loss.router_balance_domain: local_micro_batch`` by hand (GA 1, one process): token CE over
    every DP rank's rows (global mean) + coef x the mean over DP ranks of transformers'
    ``load_balancing_loss_func`` on that rank's rows (padding masked). Returns per step the CE,
    the router loss and the gradients (before clipping)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    c, model, opt = _reference_model(cfg)
    o = c.optimizer
    cfg_m = model.config
    D = len(batches)
    res = []
    for s in range(len(batches[0])):
        mbs = [batches[d][s][0] for d in range(D)]
        n = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in mbs))
        ce_total, aux_total = 0.0, 0.0
        for b in mbs:
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                        num_items_in_batch=n, output_router_logits=True, use_cache=False)
            aux = load_balancing_loss_func(out.router_logits, cfg_m.num_experts, cfg_m.num_experts_per_tok,
                                           b["attention_mask"])
            ce = out.loss - cfg_m.router_aux_loss_coef * out.aux_loss
            (ce + cfg_m.router_aux_loss_coef * aux / D).backward()
            ce_total += float(ce.detach())
            aux_total += float(aux.detach()) / D
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        clip_grad_norm_global(list(model.parameters()), o.grad_clip)   # the trainer's rule (float64 norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        res.append({"loss": ce_total, "router_loss": aux_total, "grads": grads})
    return res
