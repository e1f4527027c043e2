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
from hyper_parallel.distributed.plan.applier import apply_sharding_plan
from hyper_parallel.distributed.plan.planner import ShardingPlanner

from . import _models

from hyper_parallel.platform import on_release  # noqa: E402

_MESH: dict = {}
on_release(_MESH.clear)     # the harness frees idle groups between tests (platform.release_subgroups)


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
    # flex_hf: the proof's reference is HF's flex path, compiled per shape on CPU (slow); parity is checked below
    model, tp_info = apply_sharding_plan(model, plan, mesh, mode=mode, fsdp=fsdp, activation_checkpointing=ac,
                                         preflight_proof=model_kind != "flex_hf")

    vocab = model.config.vocab_size
    batch = global_batch(B, S, vocab, padding)
    local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy)
    g = torch.Generator().manual_seed(99)
    w = torch.randn(B, local.meta.global_seq_len, vocab, generator=g)
    valid = batch["attention_mask"].bool() if padding else torch.ones(B, S, dtype=torch.bool)
    w[:, :S] *= valid[..., None]          # padded queries carry no loss (their outputs are defined as 0 by CP)
    w[:, S:] = 0
    w_local = w.index_select(1, local.meta.q_index)             # this rank's tokens (any split)
    with cp_batch_context(local.meta):
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        logits = _full(logits)
        if grads:
            (logits * w_local).sum().backward()
    full = gather_from_cp(logits.detach().contiguous(), mesh.cp_mesh, dim=1)
    if local.meta.perm is not None:                               # balanced split: back to global order
        full = full.index_select(1, torch.argsort(local.meta.perm))
    full = full[:, :S]

    ref_logits = ref(**batch).logits
    diff = ((full - ref_logits.detach()).abs() * valid[..., None]).max().item()
    ref_max = (ref_logits.detach().abs() * valid[..., None]).max().item()
    out = {"logits": diff, "logits_rel": diff / max(ref_max, 1e-12), "policy": getattr(plan.batch_policy, "name", plan.batch_policy),
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
        model, _ = apply_sharding_plan(model, plan, mesh, mode=mode, fsdp=False,
                                       preflight_proof=model_kind != "flex_hf")
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
    strategy.attention = lambda q, k, v, *, meta, scale=None, **kw: real(q, k, v, meta=meta, scale=scale, **kw) * 1.01
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
        apply_sharding_plan(model, plan, mesh, fsdp=True, preflight_proof=False)   # the FSDP step is the subject
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
    """The attention stops reaching the wrapper after apply (its module's config switched back to a
    plain implementation, so the call goes to transformers' own eager attention): the first forward
    raises."""
    cfg = _models.load_cfg(cfg_path)
    model, _ = build_pair(cfg, "hf")
    mesh = mesh_ctx(cfg.accelerator.cp_size)
    plan = ShardingPlanner(cfg.plan_overrides).plan(model, mesh, cp_size=cfg.accelerator.cp_size)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False)
    model.config._attn_implementation = "eager"
    for layer in model.model.layers:      # the wrapped modules route through a private config copy
        layer.self_attn.config.__dict__["_attn_implementation_internal"] = "eager"
    batch = global_batch(2, 32, model.config.vocab_size)
    local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy)
    with cp_batch_context(local.meta):
        model(input_ids=local["input_ids"], position_ids=local["position_ids"])


# ------------------------------------------------------------------ attention semantics
WRAPPERS = "hyper_parallel.distributed.context_parallel.wrappers."
METHODS = {   # name -> (cp, inner_wrapper)
    "colossal": (2, "sdpa_hf"),
    "ulysses": (2, "sdpa_hf_ulysses"),
    "head_tail": (2, {"_target_": WRAPPERS + "sdpa_hf_load_balance_cp_wrapper"}),
    "hybrid": (4, {"_target_": WRAPPERS + "sdpa_hf_hybrid_cp_wrapper", "ulysses_degree": 2}),
}
WINDOW = 5          # sliding window < every test sequence
_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)


ATTN_MATCH = {"falcon": "*.self_attention", "falcon_alibi": "*.self_attention", "persimmon": "*.self_attn", "gpt2": "*.attn",
              "bloom": "*.self_attention"}


def arch_config(arch: str):
    """A tiny random transformers config (fp32, dropout 0) and its attn_implementation."""
    import transformers as T

    c = dict(_COMMON)
    w = WINDOW
    two = ["sliding_attention", "full_attention"]
    if arch == "llama":
        return T.LlamaConfig(**c), "sdpa"
    if arch == "llama_eager":
        return T.LlamaConfig(**c), "eager"
    if arch == "mistral":
        return T.MistralConfig(sliding_window=w, **c), "sdpa"
    if arch == "mixtral":
        return T.MixtralConfig(sliding_window=w, num_local_experts=4, num_experts_per_tok=2, **c), "sdpa"
    if arch == "phi3":
        return T.Phi3Config(sliding_window=w, resid_pdrop=0.0, embd_pdrop=0.0, **c), "sdpa"
    if arch == "starcoder2":
        return T.Starcoder2Config(sliding_window=w, residual_dropout=0.0, embedding_dropout=0.0, **c), "sdpa"
    if arch == "qwen2":
        return T.Qwen2Config(use_sliding_window=True, sliding_window=w, max_window_layers=1, **c), "sdpa"
    if arch == "gemma3":
        return T.Gemma3TextConfig(sliding_window=w, head_dim=16, layer_types=two, **c), "sdpa"
    if arch == "cohere2":
        return T.Cohere2Config(sliding_window=w, layer_types=two, **c), "sdpa"
    if arch == "gemma2":       # softcap + window: transformers refuses SDPA, eager through the interface
        return T.Gemma2Config(sliding_window=w, head_dim=16, attn_logit_softcapping=2.0, layer_types=two,
                              **c), "eager"
    if arch == "gpt_oss":      # sinks + window, eager
        return T.GptOssConfig(sliding_window=w, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                              layer_types=two, **c), "eager"
    if arch == "deepseek_v3":  # MLA: v_head_dim != qk head dim
        c.update(num_key_value_heads=4)
        return T.DeepseekV3Config(moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                                  first_k_dense_replace=1, n_group=1, topk_group=1, **c), "sdpa"
    if arch == "qwen3_mqa":    # 3 query heads over 1 KV head: Ulysses splits them 2/1 and replicates the KV head
        return T.Qwen3Config(**dict(c, num_attention_heads=3, num_key_value_heads=1, head_dim=16)), "sdpa"
    if arch == "falcon":
        return T.FalconConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              new_decoder_architecture=False, multi_query=False, alibi=False,
                              hidden_dropout=0.0, attention_dropout=0.0), "sdpa"
    if arch == "persimmon":
        return T.PersimmonConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0), "sdpa"
    if arch == "phi":          # partial rotary
        return T.PhiConfig(partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0, **c), "sdpa"
    if arch == "stablelm":     # partial rotary
        return T.StableLmConfig(partial_rotary_factor=0.25, hidden_dropout=0.0, **c), "sdpa"
    if arch == "falcon_alibi":
        return T.FalconConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              alibi=True, hidden_dropout=0.0, attention_dropout=0.0), "sdpa"
    if arch == "gpt2":         # default attn_pdrop=0.1
        return T.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4), "sdpa"
    if arch == "bloom":
        return T.BloomConfig(vocab_size=96, hidden_size=64, n_layer=2, n_head=4), "eager"
    raise ValueError(arch)


def build_arch(arch: str):
    """(CP model, CP=1 reference) with identical weights, both train() (dropout is 0)."""
    return build_from_config(*arch_config(arch))


def build_from_config(cfg, impl: str):
    """:func:`build_arch` for a given transformers config and attn_implementation."""
    import transformers as T

    cfg._attn_implementation = impl
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg).float().train()
    ref = T.AutoModelForCausalLM.from_config(cfg).float().train()
    ref.load_state_dict(model.state_dict())
    return model, ref


def attention_batch(kind: str, S: int, vocab: int, seed: int = 7):
    """(CP global batch, CP=1 reference inputs, valid [B, S]).

    ``plain``; ``padding`` (right padding, attention_mask); ``packed`` (transformers' convention:
    position_ids restarting inside the rows, no seq_lens); ``packed_padding`` (the same plus a
    right-padded tail in the CP batch's attention_mask; the CP=1 reference gets the tail as one
    more restarting document, which no real token sees)."""
    g = torch.Generator().manual_seed(seed + S)
    ids = torch.randint(3, vocab, (2, S), generator=g)
    batch, ref = {"input_ids": ids}, {"input_ids": ids, "use_cache": False}   # HF packs only without a cache
    valid = torch.ones(2, S, dtype=torch.bool)
    if kind == "padding":
        mask = torch.ones(2, S, dtype=torch.int64)
        mask[0, S - 5:] = 0
        mask[1, S - 11:] = 0
        batch["attention_mask"] = ref["attention_mask"] = mask
        valid = mask.bool()
    elif kind in ("packed", "packed_padding"):
        docs = [[S // 3, S // 4, S - S // 3 - S // 4], [7, S - 7 - 6, 6]]
        pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in docs])
        batch["position_ids"] = ref["position_ids"] = pos
        if kind == "packed_padding":
            mask = torch.ones(2, S, dtype=torch.int64)
            mask[0, S - 4:] = 0          # the tail of the last document becomes padding
            mask[1, S - 6:] = 0          # the whole last document becomes padding
            batch["attention_mask"] = mask
            rp = pos.clone()
            rp[0, S - 4:] = torch.arange(4)
            ref["position_ids"] = rp
            valid = mask.bool()
    return batch, ref, valid


def cp_forward_backward(model, mesh, plan, batch: dict, valid, seed: int, **model_kwargs):
    """Shard ``batch`` by the plan's batch contract, run the CP model on this rank's chunk and
    backpropagate ``sum(logits * w)`` for a random weight ``w`` ([B, global_seq_len, vocab], zero
    on invalid and CP-padding tokens, seeded by ``seed``). Every parameter's ``.grad`` is reset
    first. -> (CP logits gathered to [B, S, vocab], ``w[:, :S]`` for the reference's backward,
    the batch meta)."""
    S = batch["input_ids"].shape[1]
    vocab = model.config.vocab_size
    # the references of these tests run each packed document alone (unless the plan declares otherwise)
    local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy,
                               packed_documents=getattr(plan, "packed_documents", None) or "independent")
    meta = local.meta
    w = torch.randn(batch["input_ids"].shape[0], meta.global_seq_len, vocab,
                    generator=torch.Generator().manual_seed(seed))
    w[:, :S] *= valid[..., None]
    w[:, S:] = 0
    for p in model.parameters():
        p.grad = None
    with cp_batch_context(meta):
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], **model_kwargs).logits
        (logits * w.index_select(1, meta.q_index)).sum().backward()    # this rank's tokens (any split)
    full = gather_from_cp(logits.detach().contiguous(), mesh.cp_mesh, dim=1)
    if meta.perm is not None:                                           # balanced split: back to global order
        full = full.index_select(1, torch.argsort(meta.perm))
    return full[:, :S], w[:, :S], meta


def document_rows(batch: dict, docs: list):
    """(input_ids, attention_mask) ``[len(docs), longest]``: every document ``(row, start, length)`` of
    ``batch`` as its own right-padded row."""
    n_max = max(n for _b, _s, n in docs)
    ids = torch.zeros(len(docs), n_max, dtype=torch.int64)
    mask = torch.zeros(len(docs), n_max, dtype=torch.int64)
    for r, (b, s, n) in enumerate(docs):
        ids[r, :n] = batch["input_ids"][b, s:s + n]
        mask[r, :n] = 1
    return ids, mask


def document_parity(model, ref, mesh, plan, batch: dict, docs: list, seed: int) -> dict:
    """CP forward+backward of ``batch`` against a CP=1 reference that runs every document
    ``(row, start, length)`` of ``docs`` as its own right-padded row (attention_mask). Errors on
    this rank: logits over the documents' tokens (abs, rel to the reference's largest), gradients
    summed over the CP group (abs, rel to the reference's largest |grad|), the worst parameter,
    how many reference gradients are non-zero, and the batch ``meta``."""
    from hyper_parallel import platform as P

    S = batch["input_ids"].shape[1]
    valid = torch.zeros(batch["input_ids"].shape[0], S, dtype=torch.bool)
    for b, s, n in docs:
        valid[b, s:s + n] = True
    full, w_valid, meta = cp_forward_backward(model, mesh, plan, batch, valid, seed)
    for p in ref.parameters():
        p.grad = None
    ids, mask = document_rows(batch, docs)
    ref_logits = ref(input_ids=ids, attention_mask=mask).logits
    rows = torch.tensor([r for r, (_b, _s, n) in enumerate(docs) for _ in range(n)])
    cols = torch.tensor([j for _b, _s, n in docs for j in range(n)])
    gb = torch.tensor([b for b, _s, n in docs for _ in range(n)])
    gs = torch.tensor([s + j for _b, s, n in docs for j in range(n)])
    ref_tok = ref_logits[rows, cols]                                   # [tokens, V]
    (ref_tok * w_valid[gb, gs]).sum().backward()
    diff = (full[gb, gs] - ref_tok.detach()).abs().max().item()
    gmax = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    ref_params, gerr, worst, n_grads = dict(ref.named_parameters()), 0.0, "", 0
    for n, p in model.named_parameters():
        g = P.all_reduce((p.grad if p.grad is not None else torch.zeros_like(p)).contiguous(),
                         mesh.cp_mesh.get_group())
        rg = ref_params[n].grad if ref_params[n].grad is not None else torch.zeros_like(p)
        n_grads += int(rg.abs().max().item() > 0)
        e = (g - rg).abs().max().item()
        if e >= gerr:
            gerr, worst = e, n
    return {"logits_abs": diff, "logits_rel": diff / max(ref_tok.abs().max().item(), 1e-12), "grads_abs": gerr,
            "grads": gerr / max(gmax, 1e-12), "worst": worst, "n_grads": n_grads, "meta": meta}


def grad_error(model, ref, mesh) -> tuple[float, float]:
    """(max over parameters of max |CP grad summed over the CP group - reference grad|, the
    reference's largest |grad|); a parameter without a grad on one side counts as zeros."""
    from hyper_parallel import platform as P

    ref_params = dict(ref.named_parameters())
    gmax = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    gerr = 0.0
    for n, p in model.named_parameters():
        if p.grad is None and ref_params[n].grad is None:
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = P.all_reduce(g.contiguous(), mesh.cp_mesh.get_group())
        rg = ref_params[n].grad if ref_params[n].grad is not None else torch.zeros_like(p)
        gerr = max(gerr, (g - rg).abs().max().item())
    return gerr, gmax


def parity_errors(model, ref, mesh, plan, batch: dict, ref_inputs: dict, valid, seed: int,
                  **model_kwargs) -> dict:
    """One forward+backward of the CP model and the CP=1 reference (``ref(**ref_inputs)``);
    errors on this rank (logits over valid tokens; gradients: max |g_cp - g_ref| over parameters
    / the reference's largest |g|)."""
    full, w, _meta = cp_forward_backward(model, mesh, plan, batch, valid, seed, **model_kwargs)
    for p in ref.parameters():
        p.grad = None
    ref_logits = ref(**ref_inputs).logits
    (ref_logits * w).sum().backward()
    ref_logits = ref_logits.detach()
    diff = ((full - ref_logits).abs() * valid[..., None]).max().item()
    ref_max = (ref_logits.abs() * valid[..., None]).max().item()
    gerr, gmax = grad_error(model, ref, mesh)
    return {"logits": diff, "logits_rel": diff / max(ref_max, 1e-12), "grads_abs": gerr,
            "grads": gerr / max(gmax, 1e-12)}


def semantics_step(model, ref, mesh, plan, batch: dict, ref_inputs: dict, valid, seed: int) -> dict:
    """:func:`parity_errors` without a KV cache (transformers derives packed documents only then)."""
    return parity_errors(model, ref, mesh, plan, batch, ref_inputs, valid, seed, use_cache=False)


def semantics_cases(method: str, cases, *, mode: str = "production", proof: bool = False) -> list:
    """[(arch, kind, S)] -> one result dict per case (or {"case", "refused": message}). One model
    pair per arch (consecutive cases of one arch reuse it)."""
    from hyper_parallel.distributed.errors import CPConfigError

    cp, wrapper = METHODS[method]
    mesh = mesh_ctx(cp, hybrid=(2,) if method == "hybrid" else ())
    out, built = [], None
    for i, (arch, kind, S) in enumerate(cases):
        name = f"{method}/{arch}/{kind}/S={S}"
        if built is None or built[0] != arch:
            model, ref = build_arch(arch)
            entry = [{"match": ATTN_MATCH.get(arch, "*.self_attn"), "when": "cp", "region_dispatch": False,
                      "inner_target": "self", "inner_wrapper": wrapper}]
            try:
                plan = ShardingPlanner(plan_overrides=entry).plan(model, mesh, cp_size=cp)
                model, _ = apply_sharding_plan(model, plan, mesh, mode=mode, fsdp=False, preflight_proof=proof)
            except (CPConfigError, ValueError) as exc:
                built = (arch, None)
                out.append({"case": name, "refused": str(exc)})
                continue
            built = (arch, (model, ref, plan))
        if built[1] is None:
            out.append({"case": name, "refused": out[-1].get("refused")})
            continue
        model, ref, plan = built[1]
        batch, ref_inputs, valid = attention_batch(kind, S, model.config.vocab_size)
        out.append({"case": name, **semantics_step(model, ref, mesh, plan, batch, ref_inputs, valid, i)})
    return out


def validate_detects_dropped_window():
    """validate mode raises on every CP rank when the strategy drops the window (Mistral)."""
    cp, wrapper = METHODS["colossal"]
    model, _ = build_arch("mistral")
    mesh = mesh_ctx(cp)
    entry = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
              "inner_wrapper": wrapper}]
    plan = ShardingPlanner(plan_overrides=entry).plan(model, mesh, cp_size=cp)
    model, _ = apply_sharding_plan(model, plan, mesh, mode="validate", fsdp=False)
    for layer in model.model.layers:
        strategy = layer.self_attn.forward.__hp_strategy__
        real = strategy.attention
        strategy.attention = (lambda q, k, v, *, meta, scale=None, window=None, _real=real, **kw:
                              _real(q, k, v, meta=meta, scale=scale, **kw))
    batch, _, _ = attention_batch("plain", 32, model.config.vocab_size)
    local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy)
    with cp_batch_context(local.meta):
        model(input_ids=local["input_ids"], position_ids=local["position_ids"])
