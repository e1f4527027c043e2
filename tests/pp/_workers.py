"""Pipeline parallelism beside CP on real transformers classes (module-level: picklable for the pool).

Each rank builds the whole tiny model and a one-rank reference with the same weights, cuts its stage,
applies CP (and FSDP2) to it and trains ``steps`` AdamW steps through the pipeline schedule; the
reference trains on the same global batches, one big batch per step, loss = the global token mean.
Returned: per-step losses of both and the largest parameter difference of this rank's stage
(relative to the reference's largest |parameter| change, which is what the steps moved).
"""
from __future__ import annotations

import copy

import torch

from hyper_parallel.distributed.context_parallel import shard_batch_for_cp  # noqa: F401 (import order: package)
from hyper_parallel.distributed.mesh import MeshContext, MeshSizes
from hyper_parallel.distributed.pipeline_parallel import PipelineStep, build_stage, reduce_stage_grads
from hyper_parallel.distributed.plan import ShardingPlanner, apply_sharding_plan

from tests.wrappers._workers import ATTN_MATCH, METHODS, _COMMON, _full, arch_config, attention_batch, build_from_config


#: async CP inside a stage: the model adapters' Targets (cp, inner_wrapper)
ASYNC = {"async_colossal": (2, {"_target_": "hyper_parallel.models.llama.adapter.distributed.context_parallel_async."
                                            "llama_async_colossal_cp_wrapper"}),
         "async_ulysses": (2, {"_target_": "hyper_parallel.models.llama.adapter.distributed.context_parallel_async."
                                           "llama_async_ulysses_cp_wrapper"})}


def _config(arch: str, layers: int):
    import transformers as T

    if arch == "qwen3":
        cfg, impl = T.Qwen3Config(**_COMMON, head_dim=16), "sdpa"
    elif arch == "qwen3_next":      # Gated DeltaNet and attention layers on every stage, MoE with a shared expert
        cfg, impl = T.Qwen3NextConfig(**dict(_COMMON, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                                             linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=32, decoder_sparse_step=1,
                                             layer_types=["linear_attention", "full_attention"])), "sdpa"
    else:
        cfg, impl = arch_config(arch)
    cfg.num_hidden_layers = layers
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = (list(cfg.layer_types) * layers)[:layers]
    cfg.tie_word_embeddings = False
    return cfg, impl


def _batches(steps: int, micro: int, dp: int, S: int, vocab: int, kind: str, seed: int) -> list:
    """[step][dp rank][microbatch] global batches of 2 rows (the reference concatenates them)."""
    out = []
    for s in range(steps):
        per_dp = []
        for d in range(dp):
            mbs = []
            for m in range(micro):
                batch, _ref, _valid = attention_batch(kind, S, vocab, seed + 97 * s + 13 * d + m)
                mbs.append(batch)
            per_dp.append(mbs)
        out.append(per_dp)
    return out


def _ref_loss(ref, batches: list) -> torch.Tensor:
    """Global token mean of next-token CE over every row of every microbatch of every DP rank (the
    labels shifted within each row; padding ignored; packed rows as transformers reads them)."""
    total, n = 0.0, 0
    for mbs in batches:
        for mb in mbs:
            ids = mb["input_ids"]
            labels = ids.clone()
            if "attention_mask" in mb:
                labels[mb["attention_mask"] == 0] = -100
            shift = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
            if "position_ids" in mb:            # a packed row: no target across a document start
                starts = torch.cat([mb["position_ids"][:, 1:] == 0, torch.zeros_like(ids[:, :1], dtype=torch.bool)], 1)
                shift[starts] = -100
            kw = {k: mb[k] for k in ("attention_mask", "position_ids") if k in mb}
            logits = ref(input_ids=ids, use_cache=False, **kw).logits
            total = total + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                              shift.reshape(-1), ignore_index=-100, reduction="sum")
            n += int((shift != -100).sum())
    return total / n


def pp_cp_train(arch: str, method: str = "colossal", pp: int = 2, dp_shard: int = 1, schedule: str = "1f1b",
                micro: int = 2, steps: int = 2, layers: int = 4, S: int = 24, kind: str = "packed",
                fsdp: bool = True, seed: int = 5, optim: str = "sgd") -> dict:
    cp, wrapper = METHODS[method] if method in METHODS else ASYNC[method]
    cfg, impl = _config(arch, layers)
    model, ref = build_from_config(cfg, impl)
    mesh = MeshContext.shared(MeshSizes(pp=pp, dp_shard=dp_shard, cp=cp))
    pp_rank = mesh.pp_mesh.get_local_rank()
    stage = build_stage(model, pp_rank, pp, virtual=2 if schedule == "interleaved_1f1b" else 1)
    entry = [{"match": ATTN_MATCH.get(arch, "*.self_attn"), "when": "cp", "region_dispatch": False,
              "inner_target": "self", "inner_wrapper": wrapper}]
    if arch == "qwen3_next":
        entry.append(dict(entry[0], match="*.linear_attn", inner_wrapper="gated_deltanet_ulysses"))
    plan = ShardingPlanner(plan_overrides=entry).plan(stage, mesh, cp_size=cp)
    stage, _tp = apply_sharding_plan(stage, plan, mesh, fsdp=fsdp, preflight_proof=False)
    n_dense = dp_shard * cp
    runner = PipelineStep(stage, mesh, schedule, policy=plan.batch_policy, packed_documents="as_transformers",
                          grad_scale=n_dense if fsdp else 1)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.5), "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[optim]
    opt, ref_opt = make(stage.parameters()), make(ref.parameters())
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    data = _batches(steps, micro, dp_shard, S, cfg.vocab_size, kind, seed)
    d = mesh.dp_mesh.get_local_rank()
    losses, ref_losses = [], []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        losses.append(float(runner(data[s][d])))
        if not fsdp:
            reduce_stage_grads(stage, mesh)
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        loss = _ref_loss(ref, data[s])
        loss.backward()
        ref_opt.step()
        ref_losses.append(float(loss))
    ref_params = dict(ref.named_parameters())
    moved = max((p.detach() - start[n]).abs().max().item() for n, p in ref_params.items())
    err, worst, names = 0.0, "", []
    for name, p in stage.named_parameters():
        e = (_full(p.detach()) - ref_params[name].detach()).abs().max().item()
        names.append(name)
        if e >= err:
            err, worst = e, name
    return {"losses": losses, "ref_losses": ref_losses, "params": err / moved, "params_abs": err, "worst": worst,
            "layers": [i for r in stage.layer_chunks for i in r], "names": len(names), "pp_rank": pp_rank}


def pp_setup(layers: int) -> list:
    """Plan and cut a PP=2 x CP=2 tiny Llama of ``layers`` decoder layers (this rank's value) through
    setup_distributed; -> the layers of this rank's stage."""
    from hyper_parallel.distributed.config import AcceleratorConfig
    from hyper_parallel.distributed.infrastructure import setup_distributed

    cfg, impl = _config("llama", layers)
    model, _ref = build_from_config(cfg, impl)
    entry = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
              "inner_wrapper": METHODS["colossal"][1]}]
    setup = setup_distributed(AcceleratorConfig(cp_size=2, pp_size=2), entry, model)
    return [i for r in setup.stage.layer_chunks for i in r]


def train_router(cfg: dict) -> dict:
    """The trainer's per-step losses, router losses and tokens per expert over ``schedule.steps``."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    res = TextTrainer(TrainerConfig.from_dict(cfg)).train()
    return {"losses": [r.loss for r in res], "router": [r.router_loss for r in res],
            "tokens": res[-1].expert_load["tokens_per_expert"]}
