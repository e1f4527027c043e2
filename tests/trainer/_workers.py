"""Rank functions and config builders shared by the trainer tests (module-level, picklable).

Every function here runs on the warm gloo pool (``ranks(n).run(fn, ...)``): it builds a real
:class:`TextTrainer` from a plain config dict and returns plain tensors/numbers.
"""
from __future__ import annotations

import copy
import os

import torch

from hyper_parallel.trainer.grad_utils import clip_grad_norm_global

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "examples", "data", "corpus.txt")
MODELS = {
    "llama": ("llama", os.path.join(ROOT, "examples", "models", "tiny_llama.yaml")),
    "qwen3": ("qwen3", os.path.join(ROOT, "examples", "models", "tiny_qwen3.yaml")),
    "qwen3_moe": ("qwen3_moe", os.path.join(ROOT, "examples", "models", "tiny_qwen3_moe.yaml")),
}
WRAPPERS = "hyper_parallel.distributed.context_parallel.wrappers."
METHODS = {
    "colossal": {"_target_": WRAPPERS + "sdpa_hf_cp_wrapper"},
    "ulysses": {"_target_": WRAPPERS + "sdpa_hf_ulysses_cp_wrapper"},
    "hybrid": {"_target_": WRAPPERS + "sdpa_hf_hybrid_cp_wrapper", "ulysses_degree": 2},
    "head_tail": {"_target_": WRAPPERS + "sdpa_hf_load_balance_cp_wrapper"},
    "balanced": {"_target_": WRAPPERS + "sdpa_hf_balanced_cp_wrapper"},
}


def make_cfg(arch: str = "llama", *, cp: int = 1, dp_shard: int = 1, dp_replicate: int = 1, tp: int = 1,
             method: str = "colossal", steps: int = 3, ga: int = 1, ac: bool = False, mp=None,
             seq_len: int = 64, micro_batch_size: int = 2, min_doc_len=None, lr: float = 1e-3,
             eps: float = 1e-6, grad_clip=1.0, out_dir: str = "/tmp/hp_trainer_tests", warmup: int = 0,
             plan: bool = True, **extra) -> dict:
    name, cfg_file = MODELS[arch]
    cfg = {
        "model": {"architecture": name, "config_file": cfg_file, "seed": 0},
        "data": {"path": CORPUS, "seq_len": seq_len, "micro_batch_size": micro_batch_size,
                 "min_doc_len": min_doc_len, "seed": 0},
        "optimizer": {"name": "adamw", "lr": lr, "eps": eps, "grad_clip": grad_clip, "weight_decay": 0.01},
        "schedule": {"steps": steps, "grad_accum_steps": ga, "activation_checkpointing": ac,
                     "mixed_precision": mp, "warmup_steps": warmup, "seed": 0},
        "accelerator": {"cp_size": cp, "dp_shard_size": dp_shard, "dp_replicate_size": dp_replicate,
                        "tp_size": tp},
        "plan_overrides": ([{"match": "*.self_attn", "when": "cp", "region_dispatch": False,
                             "inner_target": "self", "inner_wrapper": copy.deepcopy(METHODS[method])}]
                           if plan else []),
        "logging": {"out_dir": out_dir, "progress": False, "plot": False},
    }
    for key, value in extra.items():  # "section.field" overrides
        sec, field = key.split("__", 1)
        cfg[sec][field] = value
    return cfg


def make_batches(cfg: dict, dp_size: int = 1, steps: int | None = None) -> list:
    """batches[dp_rank][step] = list of GA global micro-batches (the collator's output)."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.data import TextBatcher

    c = TrainerConfig.from_dict(cfg)
    steps = c.schedule.steps if steps is None else steps
    ga = c.schedule.grad_accum_steps
    out = []
    for dp in range(dp_size):
        b = TextBatcher.from_config(c.data, dp_rank=dp)
        out.append([[b.batch(s * ga + i) for i in range(ga)] for s in range(steps)])
    return out


def reference_batches(batches: list) -> list:
    """The CP=1 single-rank view: micro-batch i of step s = every DP rank's rows concatenated."""
    from hyper_parallel.trainer.data import concat_batches

    steps, ga = len(batches[0]), len(batches[0][0])
    return [[[concat_batches([batches[dp][s][i] for dp in range(len(batches))]) for i in range(ga)]
             for s in range(steps)]]


def run_steps(cfg: dict, batches: list, logits: bool = True, grads: bool = True, params: bool = True,
              fsdp=None):
    """Build a TextTrainer and run len(batches[dp]) steps on the given global micro-batches."""
    from hyper_parallel.trainer.base import StepProbe
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    cls = TextTrainer if fsdp is None else type("Trainer", (TextTrainer,), {"fsdp": fsdp})
    trainer = cls(TrainerConfig.from_dict(cfg))
    probe = StepProbe(logits=logits, grads=grads, params=params)
    dp = trainer.mesh.dp_rank
    steps = []
    for mbs in batches[dp]:
        r = trainer.train_step(mbs, probe)
        steps.append({"loss": r.loss, "tokens": r.valid_tokens, "grad_norm": r.grad_norm,
                      "logits": r.logits, "grads": r.grads, "params": r.params})
    return {"dp_rank": dp, "cp_rank": trainer.mesh.cp_rank, "steps": steps,
            "fsdp": trainer.uses_fsdp, "grad_scale": trainer.grad_scale}


def train_losses(cfg: dict, steps: int | None = None, save_at: int | None = None):
    """trainer.train() with the built-in data stream; optionally save a checkpoint at ``save_at``."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    res = trainer.train(steps=save_at if save_at is not None else steps)
    path = str(trainer.save_checkpoint()) if save_at is not None else None
    return {"losses": [r.loss for r in res], "step": trainer.step, "position": trainer.data.position,
            "path": path}


def build_error(cfg: dict):
    """Construct a trainer and return the error (type name, message) it raises, if any."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    try:
        TextTrainer(TrainerConfig.from_dict(cfg))
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


def plain_hf_loop(cfg: dict, batches: list):
    """The trainer with CP disabled, written by hand: HF ``labels=`` loss, AdamW, the trainer's clipping
    rule (``clip_grad_norm_``'s coefficient on the float64 norm, grad_utils.py)."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.model import HyperAutoModel

    c = TrainerConfig.from_dict(cfg)
    torch.manual_seed(c.schedule.seed)
    model = HyperAutoModel.from_config(c.model)
    o = c.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                            weight_decay=o.weight_decay)
    out = []
    for mbs in batches[0]:
        n = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in mbs))
        total = 0.0
        for b in mbs:
            loss = model(input_ids=b["input_ids"], labels=b["labels"], num_items_in_batch=n).loss
            loss.backward()
            total += float(loss)
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        norm = clip_grad_norm_global(list(model.parameters()), o.grad_clip)   # the trainer's rule (float64 norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append({"loss": total, "grad_norm": float(norm), "grads": grads,
                    "params": {k: p.detach().clone() for k, p in model.named_parameters()}})
    return out
