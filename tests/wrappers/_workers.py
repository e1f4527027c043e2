"""Rank functions for the wrapper tests (module-level so the warm gloo pool can run them).

Every parity function builds the YAML's model twice with the same seed: the CP=1 reference
(plain HF, full global sequence, one process) and the CP model (plan -> apply -> local
shard inside ``cp_batch_context``); CP logits are gathered back to global order and
compared on every valid position.
"""
from __future__ import annotations

import torch

from hyper_parallel.distributed.context_parallel.batch import gather_from_cp, shard_batch_for_cp
from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
from hyper_parallel.distributed.mesh import MeshContext, MeshSizes
from hyper_parallel.distributed.sharding_applier import apply_sharding_plan
from hyper_parallel.distributed.sharding_planner import ShardingPlanner

from . import _models

_MESH: dict = {}


def mesh_ctx(cp: int, tp: int = 1, hybrid=(), dp_replicate: int = 1) -> MeshContext:
    key = (cp, tp, dp_replicate)
    if key not in _MESH:
        _MESH[key] = MeshContext(MeshSizes(cp=cp, tp=tp, dp_replicate=dp_replicate), hybrid_degrees=hybrid)
    mesh = _MESH[key]
    mesh.ensure_hybrid(hybrid)
    return mesh


def global_batch(B: int, S: int, vocab: int, padding: bool = False) -> dict:
    g = torch.Generator().manual_seed(1234)
    batch = {"input_ids": torch.randint(0, vocab, (B, S), generator=g)}
    if padding:
        mask = torch.ones(B, S, dtype=torch.int64)
        mask[0, S - 5:] = 0
        mask[-1, S - 11:] = 0
        batch["attention_mask"] = mask
    return batch


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def build_pair(cfg, model_kind: str):
    """(cp model, CP=1 reference) with identical weights."""
    torch.manual_seed(0)
    if model_kind == "flex_hf":
        model = _models.build_hf(cfg.model, "flex_attention")
    else:
        model = _models.build_hf(cfg.model)
    ref = _models.build_hf(cfg.model, "sdpa")
    ref.load_state_dict(model.state_dict())
    if model_kind in ("qkv", "qkv_repeat", "flex_qkv"):
        _models.to_qkv(model, {"qkv": "sdpa", "qkv_repeat": "sdpa_repeat", "flex_qkv": "flex"}[model_kind])
    return model, ref


def cp_parity(cfg_path: str, overrides=(), *, model_kind: str = "hf", mode: str = "production", S: int = 32,
              B: int = 2, grads: bool = False, padding: bool = False, fsdp=None, ac: bool = False,
              plan_overrides=None):
    """-> dict(logits=max|diff|, logits_rel=that / max|ref|, grads=max over parameters of
    max|diff| / max|ref| (grads_abs: max|diff|), policy, summary) on this rank."""
    cfg = _models.load_cfg(cfg_path, overrides)
    acc = cfg.accelerator
    model, ref = build_pair(cfg, model_kind)
    specs = cfg.plan_overrides if plan_overrides is None else plan_overrides
    mesh = mesh_ctx(acc.cp_size, acc.tp_size, dp_replicate=acc.dp_replicate_size)
    plan = ShardingPlanner(plan_overrides=specs).plan(model, mesh, tp_size=acc.tp_size, cp_size=acc.cp_size)
    model, tp_info = apply_sharding_plan(model, plan, mesh, mode=mode, fsdp=fsdp, activation_checkpointing=ac)

    vocab = model.config.vocab_size
    batch = global_batch(B, S, vocab, padding)
    local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy)
    g = torch.Generator().manual_seed(99)
    w = torch.randn(B, local.meta.global_seq_len, vocab, generator=g)
    valid = batch["attention_mask"].bool() if padding else torch.ones(B, S, dtype=torch.bool)
    w[:, :S] *= valid[..., None]          # padded queries carry no loss (their outputs are defined as 0 by CP)
    w[:, S:] = 0
    lo = local.meta.cp_rank * local.meta.local_seq_len
    w_local = w[:, lo:lo + local.meta.local_seq_len]
    with cp_batch_context(local.meta):
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        logits = _full(logits)
        if grads:
            (logits * w_local).sum().backward()
    full = gather_from_cp(logits.detach().contiguous(), mesh.cp_mesh, dim=1)[:, :S]

    ref_logits = ref(**batch).logits
    diff = ((full - ref_logits.detach()).abs() * valid[..., None]).max().item()
    ref_max = (ref_logits.detach().abs() * valid[..., None]).max().item()
    out = {"logits": diff, "logits_rel": diff / max(ref_max, 1e-12), "policy": plan.batch_policy,
           "summary": plan.summary(),
           "fsdp_dims": tuple(mesh.fsdp_mesh.mesh_dim_names or ()),
           "sharded": len(tp_info.sharded), "replicated": len(tp_info.replicated)}
    if grads:
        (ref_logits * w[:, :S]).sum().backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        uses_fsdp = any(type(m).__name__.startswith("FSDP") for m in model.modules())
        # FSDP2 averages over every fsdp rank; each of the dp_replicate replicas saw the same batch here
        scale = float(mesh.fsdp_mesh.size()) / acc.dp_replicate_size if uses_fsdp else 1.0
        worst = worst_abs = 0.0
        for n, p in model.named_parameters():
            gp = _full(p.grad) * scale
            if not uses_fsdp and mesh.cp_size > 1:
                from hyper_parallel import platform as P
                gp = P.all_reduce(gp.contiguous(), mesh.cp_mesh.get_group())
            rg = ref_grads[n]
            err = (gp - rg).abs().max()
            worst_abs = max(worst_abs, err.item())
            worst = max(worst, (err / rg.abs().max().clamp_min(1e-12)).item())
        out["grads"], out["grads_abs"] = worst, worst_abs
    return out


def validate_vs_production(cfg_path: str, overrides=(), *, model_kind: str = "hf", S: int = 32):
    """Logits and gradients of mode='validate' equal mode='production' (bitwise)."""
    res = {}
    for mode in ("production", "validate"):
        cfg = _models.load_cfg(cfg_path, overrides)
        acc = cfg.accelerator
        model, _ = build_pair(cfg, model_kind)
        mesh = mesh_ctx(acc.cp_size, acc.tp_size)
        plan = ShardingPlanner(cfg.plan_overrides).plan(model, mesh, tp_size=acc.tp_size, cp_size=acc.cp_size)
        model, _ = apply_sharding_plan(model, plan, mesh, mode=mode, fsdp=False)
        batch = global_batch(2, S, model.config.vocab_size)
        local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy)
        with cp_batch_context(local.meta):
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            logits.square().mean().backward()
        res[mode] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp, gp), (lv, gv) = res["production"], res["validate"]
    return torch.equal(lp, lv) and all(torch.equal(gp[n], gv[n]) for n in gp)


def validate_detects_mismatch(cfg_path: str):
    """validate mode raises on every CP rank when the CP path is wrong (a broken strategy)."""
    cfg = _models.load_cfg(cfg_path)
    model, _ = build_pair(cfg, "hf")
    mesh = mesh_ctx(cfg.accelerator.cp_size)
    plan = ShardingPlanner(cfg.plan_overrides).plan(model, mesh, cp_size=cfg.accelerator.cp_size)
    model, _ = apply_sharding_plan(model, plan, mesh, mode="validate", fsdp=False)
    attn = model.model.layers[1].self_attn
    strategy = attn.forward.__hp_strategy__
    real = strategy.attention
    strategy.attention = lambda q, k, v, *, meta, scale=None: real(q, k, v, meta=meta, scale=scale) * 1.01
    batch = global_batch(2, 32, model.config.vocab_size)
    local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy)
    with cp_batch_context(local.meta):
        model(input_ids=local["input_ids"], position_ids=local["position_ids"])


def plan_only(cfg_path: str, overrides=(), *, model_kind: str = "hf", plan_overrides=None, apply: bool = False):
    """Resolve + plan (and optionally apply) on every rank; used by the fail-fast tests."""
    cfg = _models.load_cfg(cfg_path, overrides)
    acc = cfg.accelerator
    model, _ = build_pair(cfg, model_kind)
    specs = cfg.plan_overrides if plan_overrides is None else plan_overrides
    mesh = mesh_ctx(acc.cp_size, acc.tp_size)
    plan = ShardingPlanner(specs).plan(model, mesh, tp_size=acc.tp_size, cp_size=acc.cp_size)
    if apply:
        apply_sharding_plan(model, plan, mesh, fsdp=False)
    return plan.summary()


def custom_wrapper_parity(cfg_path: str, S: int = 32):
    import examples.cp.custom_wrapper_example  # noqa: F401  (registers "my_allgather")

    by_target = cp_parity(cfg_path, S=S, grads=True, fsdp=False)
    entry = {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self"}
    by_name = cp_parity(cfg_path, S=S, grads=True, plan_overrides=[{**entry, "inner_wrapper": "my_allgather"}])
    shortcut = cp_parity(cfg_path, S=S, grads=True, plan_overrides=[
        {**entry, "inner_wrapper": {"_target_": "examples.cp.custom_wrapper_example.my_sdpa_wrapper"}}])
    return {k: max(r[k] for r in (by_target, by_name, shortcut)) for k in ("logits", "logits_rel", "grads", "grads_abs")}


def rollback_on_failure(cfg_path: str):
    """A later failure (FSDP on a model without decoder layers is forced here) restores every forward."""
    cfg = _models.load_cfg(cfg_path)
    model, _ = build_pair(cfg, "hf")
    mesh = mesh_ctx(cfg.accelerator.cp_size)
    plan = ShardingPlanner(cfg.plan_overrides).plan(model, mesh, cp_size=cfg.accelerator.cp_size)
    plan.decoder_layers = []             # make the FSDP step fail after the CP install
    before = [dict(l.self_attn.__dict__).get("forward") for l in model.model.layers]
    cfg_before = [l.self_attn.config for l in model.model.layers]
    try:
        apply_sharding_plan(model, plan, mesh, fsdp=True)
    except Exception as exc:  # noqa: BLE001
        err = str(exc)
    else:
        err = None
    after = [dict(l.self_attn.__dict__).get("forward") for l in model.model.layers]
    restored = before == after and all(a.config is c for a, c in zip([l.self_attn for l in model.model.layers],
                                                                        cfg_before))
    wrapped = any("__hp_cp_wrapped__" in l.self_attn.__dict__ for l in model.model.layers)
    return err, restored and not wrapped


def runtime_misfire(cfg_path: str):
    """The model stops calling SDPA after apply (switched to eager): the first forward raises."""
    cfg = _models.load_cfg(cfg_path)
    model, _ = build_pair(cfg, "hf")
    mesh = mesh_ctx(cfg.accelerator.cp_size)
    plan = ShardingPlanner(cfg.plan_overrides).plan(model, mesh, cp_size=cfg.accelerator.cp_size)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False)
    model.config._attn_implementation = "eager"
    batch = global_batch(2, 32, model.config.vocab_size)
    local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy)
    with cp_batch_context(local.meta):
        model(input_ids=local["input_ids"], position_ids=local["position_ids"])
