"""Expert parallelism beside CP on real transformers MoE classes (module-level: picklable for the pool).

One step of the EP x CP (x dp_shard) model under FSDP2 against the one-rank model: logits over every
valid token and every gradient (full tensors, experts included), relative to the reference's largest.
"""
from __future__ import annotations

import torch

from hyper_parallel.distributed.config import AcceleratorConfig
from hyper_parallel.distributed.context_parallel import shard_batch_for_cp
from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
from hyper_parallel.distributed.infrastructure import setup_distributed
from hyper_parallel.distributed.plan import apply_sharding_plan

from tests.wrappers._workers import (ATTN_MATCH, METHODS, _COMMON, _full, arch_config, attention_batch,
                                     build_from_config, document_rows)

def moe_config(arch: str):
    import transformers as T

    if arch == "qwen3_moe":
        return T.Qwen3MoeConfig(**dict(_COMMON, head_dim=16), moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1), "sdpa"
    return arch_config(arch)


def build_moe(arch: str):
    """(model, one-rank reference) with identical weights; router and correction biases random (zero at
    init), since routing depends on them."""
    model, ref = build_from_config(*moe_config(arch))
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias") or name.endswith("router.bias"):
                t.copy_(torch.randn(t.shape) * 0.5)
    ref.load_state_dict(model.state_dict())
    return model, ref


def _each_document_alone(ref, batch: dict, valid):
    """[B, S, vocab] logits of the one-rank model running every packed document (restarting
    position_ids, its valid prefix) as its own right-padded row; zeros elsewhere."""
    pos = batch["position_ids"]
    B, S = pos.shape
    docs = []
    for b in range(B):
        starts = (pos[b] == 0).nonzero().flatten().tolist() + [S]
        for a, e in zip(starts[:-1], starts[1:]):
            n = int(valid[b, a:e].sum())
            if n:
                docs.append((b, a, n))
    ids, mask = document_rows(batch, docs)
    out = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
    full = torch.zeros(B, S, out.shape[-1])
    for r, (b, a, n) in enumerate(docs):
        full = full.index_put((torch.full((n,), b), torch.arange(a, a + n)), out[r, :n])
    return full


def ep_step(arch: str, method: str, ep: int, dp_shard: int = 1, kind: str = "packed_padding", S: int = 24,
            seed: int = 3, tp: int = 1, dp_replicate: int = 1, documents: str = "as_transformers") -> dict:
    """One forward+backward of ``arch`` at cp (the method's) x dp_shard with ep, FSDP2 on, against the
    one-rank reference on the same global batch. Returns this rank's errors and the split it ran.
    ``documents``: what a packed row means (``independent``: the reference runs each document alone)."""
    import torch.distributed as dist

    cp, wrapper = METHODS[method]
    model, ref = build_moe(arch)
    entry = [{"match": ATTN_MATCH.get(arch, "*.self_attn"), "when": "cp", "region_dispatch": False,
              "inner_target": "self", "inner_wrapper": wrapper}]
    accel = AcceleratorConfig(cp_size=cp, dp_shard_size=dp_shard, ep_size=ep, tp_size=tp,
                              dp_replicate_size=dp_replicate)
    setup = setup_distributed(accel, entry, model)
    mesh, plan = setup.mesh, setup.plan
    model, tp_info = apply_sharding_plan(model, plan, mesh, fsdp=True, preflight_proof=False)
    vocab = model.config.vocab_size
    dp = dp_shard * dp_replicate
    parts = [attention_batch(kind, S, vocab, seed + i) for i in range(max(1, dp // 2))]   # 2 rows each
    batch, ref_inputs = ({k: torch.cat([p[j][k] for p in parts]) if torch.is_tensor(parts[0][j][k]) else parts[0][j][k]
                          for k in parts[0][j]} for j in (0, 1))
    valid = torch.cat([p[2] for p in parts])
    B = batch["input_ids"].shape[0]
    w = torch.randn(B, S, vocab, generator=torch.Generator().manual_seed(seed)) * valid[..., None]
    # this data-parallel rank's rows (B / dp of them), sharded over cp
    d = mesh.dp_mesh.get_local_rank() if dp > 1 else 0
    rows = slice(d * B // dp, (d + 1) * B // dp)
    mine = {k: v[rows] for k, v in batch.items()}
    local = shard_batch_for_cp(mine, mesh.cp_mesh, plan.batch_policy, packed_documents=documents)
    meta = local.meta
    w_mine = torch.zeros(B // dp, meta.global_seq_len, vocab)
    w_mine[:, :S] = w[rows]
    n = dist.get_world_size() // tp   # the dense ranks (TP ranks hold the same tokens)
    with cp_batch_context(meta):
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        # FSDP2 averages gradients over the n dense ranks: scale so the average is the global sum
        (logits * w_mine.index_select(1, meta.q_index)).sum().mul(n).backward()
    if tp > 1:      # parameters on TP-local heads: each tp rank's gradient is a partial sum (what the trainer does)
        from hyper_parallel.trainer.tp_sync import sync_tp_partial_grads, tp_partial_params

        sync_tp_partial_grads(tp_partial_params(model, plan, tp_info), mesh.tp_mesh)
    if documents == "independent":
        ref_logits = _each_document_alone(ref, batch, valid)
    else:
        ref_logits = ref(**ref_inputs).logits
    (ref_logits * w).sum().backward()
    # logits: this rank's tokens against the reference's
    q = meta.q_index
    keep = q < S
    got = logits.detach()[:, keep]
    want = ref_logits.detach()[rows][:, q[keep]]
    ok = valid[rows][:, q[keep]]
    diff = ((got - want).abs() * ok[..., None]).max().item()
    ref_max = (ref_logits.abs() * valid[..., None]).max().item()
    ref_params = dict(ref.named_parameters())
    gmax = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    gerr, worst = 0.0, ""
    for name, p in model.named_parameters():
        g = _full(p.grad) if p.grad is not None else torch.zeros(p.shape)
        rg = ref_params[name].grad
        rg = rg if rg is not None else torch.zeros_like(g)
        e = (g - rg).abs().max().item()
        if e >= gerr:
            gerr, worst = e, name
    experts = plan.ep_targets[0]
    local_rows = getattr(dict(model.named_modules())[experts.fqn], experts.params[0])
    return {"logits_abs": diff, "logits_rel": diff / max(ref_max, 1e-12), "grads_abs": gerr,
            "grads": gerr / max(gmax, 1e-12), "worst": worst, "experts": experts.num_experts,
            "local_experts": int(local_rows.to_local().shape[0]) if hasattr(local_rows, "to_local") else None}


def train_export(cfg: dict) -> dict:
    """The trainer's losses over ``schedule.steps`` and its HF export (``<out_dir>/hf``)."""
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    trainer = TextTrainer(TrainerConfig.from_dict(cfg))
    res = trainer.train()
    return {"losses": [r.loss for r in res], "hf": str(trainer.export_hf()), "expert_load": res[-1].expert_load}


def ep_setup(ep: int) -> int:
    """Plan and build the meshes for a CP=2 Qwen3-MoE at ``ep`` (this rank's value); -> experts per rank."""
    model, _ = build_moe("qwen3_moe")
    entry = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
              "inner_wrapper": METHODS["colossal"][1]}]
    setup = setup_distributed(AcceleratorConfig(cp_size=2, ep_size=ep), entry, model)
    return setup.plan.ep_targets[0].num_experts // ep
