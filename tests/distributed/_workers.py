"""Rank functions for the transformers-declaration tests (module-level for the warm gloo pool).

Tiny random configs (fp32, dropout 0, ``train()``), nothing downloaded. Each parity function
builds the CP model and its CP=1 reference with identical weights, applies the planner's plan
with FSDP2 + activation checkpointing (and TP where asked), runs one forward/backward on a fresh
random batch and returns this rank's errors.
"""
from __future__ import annotations

import torch

from hyper_parallel.distributed.context_parallel.interception import CPInterceptionError
from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.distributed.plan.applier import apply_sharding_plan
from hyper_parallel.distributed.plan.planner import ShardingPlanner
from tests.wrappers._workers import cp_forward_backward, mesh_ctx

_DENSE = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

# arch -> (attention modules to wrap, the decoder-layer class transformers declares)
ARCHS = {
    "gpt_neox": ("*.attention", "GPTNeoXLayer"),
    "falcon": ("*.self_attention", "FalconDecoderLayer"),
    "bloom": ("*.self_attention", "BloomBlock"),
    "gpt2": ("*.attn", "GPT2Block"),
    "opt": ("*.self_attn", "OPTDecoderLayer"),
    "mpt": ("*.attn", "MptBlock"),
    "llama": ("*.self_attn", "LlamaDecoderLayer"),
    "gemma3": ("*.self_attn", "Gemma3DecoderLayer"),
    "qwen3_moe": ("*.self_attn", "Qwen3MoeDecoderLayer"),
}


def config(arch: str):
    """(tiny transformers config with dropout 0, attn_implementation)."""
    import transformers as T

    if arch == "gpt_neox":
        return T.GPTNeoXConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, rotary_pct=0.5, attention_dropout=0.0, hidden_dropout=0.0,
                               **_IDS), "sdpa"
    if arch == "falcon":
        return T.FalconConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              new_decoder_architecture=False, multi_query=False, alibi=False, hidden_dropout=0.0,
                              attention_dropout=0.0, **_IDS), "sdpa"
    if arch == "bloom":
        return T.BloomConfig(vocab_size=96, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0,
                             attention_dropout=0.0, **_IDS), "eager"
    if arch == "gpt2":
        return T.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0,
                            embd_pdrop=0.0, **_IDS), "sdpa"
    if arch == "opt":
        return T.OPTConfig(vocab_size=96, hidden_size=64, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                           word_embed_proj_dim=64, max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
                           activation_dropout=0.0, layerdrop=0.0, **_IDS), "sdpa"
    if arch == "mpt":
        return T.MptConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, resid_pdrop=0.0, emb_pdrop=0.0,
                           attn_config={"attn_pdrop": 0}, **_IDS), "eager"
    if arch == "llama":
        return T.LlamaConfig(**_DENSE), "sdpa"
    if arch == "gemma3":
        return T.Gemma3TextConfig(sliding_window=5, head_dim=16,
                                  layer_types=["sliding_attention", "full_attention"], **_DENSE), "sdpa"
    if arch == "qwen3_moe":       # layer 0 MoE (experts), layer 1 dense MLP (mlp_only_layers)
        return T.Qwen3MoeConfig(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                mlp_only_layers=[1], **_DENSE), "sdpa"
    raise ValueError(arch)


def build(arch: str, seed: int = 0):
    """(model, CP=1 reference) with identical weights, both ``train()``."""
    import transformers as T

    cfg, impl = config(arch)
    cfg._attn_implementation = impl
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg).float().train()
    ref = T.AutoModelForCausalLM.from_config(cfg).float().train()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grad_errors(model, ref, mesh, tp_info) -> tuple[float, float]:
    """(max |g - g_ref| over parameters, the reference's largest |g|). FSDP2 averages gradients
    over the fsdp ranks (the cp ranks here, each seeing its chunk): scale back by their count;
    ``tp_info.partial_grad`` gradients (TP-local heads) are summed over tp as the trainer does."""
    from hyper_parallel import platform as P

    ref_params = dict(ref.named_parameters())
    gmax = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    scale = float(mesh.fsdp_mesh.size())
    partial = set(tp_info.partial_grad)
    err = 0.0
    for n, p in model.named_parameters():
        g = _full(p.grad) * scale if p.grad is not None else torch.zeros(ref_params[n].shape)
        if n in partial:
            g = P.all_reduce(g.contiguous(), mesh.tp_mesh.get_group())
        rg = ref_params[n].grad if ref_params[n].grad is not None else torch.zeros_like(g)
        err = max(err, (g - rg).abs().max().item())
    return err, gmax


def fsdp_ac_parity(arch: str, cp: int = 2, tp: int = 1, S: int = 32, seed: int = 3, proof: bool = True,
                   wrapper: str = "sdpa_hf") -> dict:
    """Plan (sdpa_hf, colossal) -> apply with FSDP2 + activation checkpointing (+ TP) and the CP
    preflight proof (``proof``; before FSDP, as the trainer does by default) -> one
    forward/backward vs the CP=1 reference on a fresh random batch. -> errors on this rank, or
    ``{"refused": message}`` when the planner / applier refuses the model."""
    model, ref = build(arch)
    match, _ = ARCHS[arch]
    entry = [{"match": match, "when": "cp", "region_dispatch": False, "inner_target": "self",
              "inner_wrapper": wrapper}]
    mesh = mesh_ctx(cp, tp)
    try:
        plan = ShardingPlanner(plan_overrides=entry).plan(model, mesh, tp_size=tp, cp_size=cp)
        model, tp_info = apply_sharding_plan(model, plan, mesh, fsdp=True, activation_checkpointing=True,
                                             preflight_proof=proof)
    except (CPConfigError, CPInterceptionError) as exc:
        return {"refused": str(exc)}
    uses_fsdp = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
    untied = _untied(ref)
    ac = sum(hasattr(model.get_submodule(f).__dict__.get("forward"), "__wrapped__") for f in plan.decoder_layers)
    g = torch.Generator().manual_seed(seed + S)
    ids = torch.randint(3, model.config.vocab_size, (2, S), generator=g)
    valid = torch.ones(2, S, dtype=torch.bool)
    full, w, _ = cp_forward_backward(model, mesh, plan, {"input_ids": ids}, valid, seed)
    ref_logits = ref(input_ids=ids, use_cache=False).logits
    (ref_logits * w).sum().backward()
    ref_logits = ref_logits.detach()
    diff = (full - ref_logits).abs().max().item()
    gerr, gmax = _grad_errors(model, ref, mesh, tp_info)
    return {"logits": diff, "logits_rel": diff / max(ref_logits.abs().max().item(), 1e-12), "grads_abs": gerr,
            "grads": gerr / max(gmax, 1e-12), "layers": list(plan.decoder_layers), "fsdp_modules": uses_fsdp,
            "untied": untied,
            "fsdp_embeddings": [type(m).__name__.startswith("FSDP")
                                for m in (model.get_input_embeddings(), model.get_output_embeddings())],
            "ac_layers": ac, "tp_plan": dict(plan.tp_layer_plan), "sharded": sorted(tp_info.sharded),
            "partial": sorted(tp_info.partial_grad), "policy": plan.batch_policy,
            "local_heads": [getattr(m, "__hp_local_heads__", None) for f in plan.attention_boundaries
                            for m in [model.get_submodule(f)]]}


def fsdp_ac_dp2(arch: str, S: int = 24, seed: int = 5) -> dict:
    """No CP: FSDP2 over 2 data-parallel ranks on the declared decoder layers + activation
    checkpointing; rank r trains row r of a 2-row batch, the reference both rows. FSDP2 averages
    over the 2 ranks, so its gradient x 2 must equal the reference's."""
    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes

    key = ("dp_shard", 2)
    if key not in _DP_MESH:
        _DP_MESH[key] = MeshContext(MeshSizes(dp_shard=2))
    mesh = _DP_MESH[key]
    model, ref = build(arch)
    plan = ShardingPlanner().plan(model, mesh)
    model, tp_info = apply_sharding_plan(model, plan, mesh, fsdp=True, activation_checkpointing=True)
    fsdp = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
    untied = _untied(ref)
    ac = sum(hasattr(model.get_submodule(f).__dict__.get("forward"), "__wrapped__") for f in plan.decoder_layers)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (2, S), generator=g)
    w = torch.randn(2, S, model.config.vocab_size, generator=g)
    r = mesh.fsdp_mesh.get_local_rank()
    logits = _full(model(input_ids=ids[r:r + 1]).logits)
    (logits * w[r:r + 1]).sum().backward()
    ref_logits = ref(input_ids=ids, use_cache=False).logits
    (ref_logits * w).sum().backward()
    diff = (logits.detach() - ref_logits.detach()[r:r + 1]).abs().max().item()
    ref_params = dict(ref.named_parameters())
    gmax = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    gerr = max((_full(p.grad) * 2 - ref_params[n].grad).abs().max().item() for n, p in model.named_parameters())
    return {"logits": diff, "logits_rel": diff / ref_logits.abs().max().item(), "grads_abs": gerr,
            "grads": gerr / gmax, "layers": list(plan.decoder_layers), "fsdp_modules": fsdp, "ac_layers": ac,
            "untied": untied}


def _untied(model) -> bool:
    """Whether the model's input embedding and output head are separate parameters (each then an
    FSDP unit of its own)."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is not model.get_input_embeddings().weight


from hyper_parallel.platform import on_release  # noqa: E402

_DP_MESH: dict = {}
on_release(_DP_MESH.clear)     # the harness frees idle groups between tests (platform.release_subgroups)
