"""Rank functions of the async CP tests (module-level so the warm gloo pool can run them).

:func:`async_cases` runs, for each (arch, method, batch kind), three copies of one tiny random
transformers model with identical weights: the async adapter wrapper (planner + applier, no
FSDP), its sync counterpart (``sdpa_hf*``) and the CP=1 reference (plain HF on the global
batch), one forward + backward of ``sum(logits * w)`` each, and returns the errors
async-vs-CP=1 and async-vs-sync (logits on valid tokens; every gradient, summed over the CP
group, relative to the reference's largest gradient), the handle count left pending and the
per-tensor launch/wait counts of the trace (forward and backward).
"""
from __future__ import annotations

import torch

from hyper_parallel.distributed.plan.applier import apply_sharding_plan
from hyper_parallel.distributed.plan.planner import ShardingPlanner
from tests.wrappers._workers import _COMMON, WINDOW, arch_config, attention_batch, cp_forward_backward, mesh_ctx

ADAPTERS = {a: f"hyper_parallel.models.{a}.adapter.distributed.context_parallel_async.{a}_async_"
            for a in ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")}
SYNC = "hyper_parallel.distributed.context_parallel.wrappers."
# method -> (cp, async suffix, sync target, named params)
METHODS = {
    "colossal": (2, "colossal_cp_wrapper", "sdpa_hf_cp_wrapper", {}),
    "ulysses": (2, "ulysses_cp_wrapper", "sdpa_hf_ulysses_cp_wrapper", {}),
    "load_balance": (2, "load_balance_cp_wrapper", "sdpa_hf_load_balance_cp_wrapper", {}),
    "hybrid": (4, "hybrid_cp_wrapper", "sdpa_hf_hybrid_cp_wrapper", {"ulysses_degree": 2}),
}


def config(arch: str, heads=None):
    """Tiny fp32 config (GQA 4:2, dropout 0): the shared wrapper-test configs (Llama, Qwen2 and
    Mistral with a sliding window) plus Qwen3 and Qwen3-MoE (QK-norm, Qwen3 with a window).
    ``heads=(Hq, Hk)`` overrides the head counts (head_dim stays 16: q_proj ``64 -> 16*Hq``)."""
    import transformers as T

    common = dict(_COMMON)
    if heads is not None:
        common.update(num_attention_heads=heads[0], num_key_value_heads=heads[1])
    if arch == "qwen3":
        return T.Qwen3Config(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                             **common)
    if arch == "qwen3_moe":
        return T.Qwen3MoeConfig(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                **common)
    cfg, _ = arch_config(arch)
    if heads is not None:
        cfg.num_attention_heads, cfg.num_key_value_heads = heads
        cfg.head_dim = 16
    return cfg


def build(arch: str, n: int, heads=None):
    import transformers as T

    cfg = config(arch, heads)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    first = T.AutoModelForCausalLM.from_config(cfg).float().train()
    out = [first]
    for _ in range(n - 1):
        m = T.AutoModelForCausalLM.from_config(cfg).float().train()
        m.load_state_dict(first.state_dict())
        out.append(m)
    return out


def _apply(model, mesh, cp, target, params):
    entry = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
              "inner_wrapper": {"_target_": target, **params}}]
    plan = ShardingPlanner(plan_overrides=entry).plan(model, mesh, cp_size=cp)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False)
    return model, plan


def _grads(model, group):
    from hyper_parallel import platform as P

    out = {}
    for n, p in model.named_parameters():      # same order on every rank: the all-reduces line up
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out[n] = P.all_reduce(g.contiguous(), group)
    return out


def _err(got: dict, ref: dict) -> tuple:
    """(max abs error over every gradient, that / the reference's largest |gradient|)."""
    gmax = max(g.abs().max().item() for g in ref.values())
    a = max((got[n] - ref[n]).abs().max().item() for n in ref)
    return a, a / max(gmax, 1e-12)


def compare_async(model_a, plan_a, model_s, plan_s, ref, mesh, kind: str, S: int, seed: int) -> dict:
    """One traced forward+backward of the async model and one of the sync model on the same ``kind``
    batch of S tokens, against CP=1's ``ref``: logits and every gradient (summed over CP) as max abs
    and relative to the reference's largest |logit| / |gradient|, the handles left pending after the
    async forward+backward, the per-name trace counts, the layer count and the local length."""
    from hyper_parallel.distributed.context_parallel.async_collectives import async_trace
    from hyper_parallel.platform import pending_handles

    batch, ref_inputs, valid = attention_batch(kind, S, model_a.config.vocab_size)
    with async_trace() as trace:
        full_a, w, meta = cp_forward_backward(model_a, mesh, plan_a, batch, valid, seed=seed, use_cache=False)
    pending = pending_handles()
    full_s, _, _ = cp_forward_backward(model_s, mesh, plan_s, batch, valid, seed=seed, use_cache=False)
    ref_logits = ref(**ref_inputs).logits
    (ref_logits * w).sum().backward()
    ref_logits = ref_logits.detach()
    group = mesh.cp_mesh.get_group()
    g_a, g_s = _grads(model_a, group), _grads(model_s, group)
    g_ref = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in ref.named_parameters()}
    vmask = valid[..., None]
    rmax = (ref_logits.abs() * vmask).max().item()
    la_cp1 = ((full_a - ref_logits).abs() * vmask).max().item()
    la_sync = ((full_a - full_s).abs() * vmask).max().item()
    counts = {}
    for ev, name, _t in trace:
        counts[(ev, name)] = counts.get((ev, name), 0) + 1
    return {"local_seq_len": meta.local_seq_len,
            "logits_abs_cp1": la_cp1, "logits_rel_cp1": la_cp1 / rmax,
            "logits_abs_sync": la_sync, "logits_rel_sync": la_sync / rmax,
            "grads_cp1": _err(g_a, g_ref), "grads_sync": _err(g_a, g_s), "sync_cp1": _err(g_s, g_ref),
            "pending": pending, "counts": counts, "layers": model_a.config.num_hidden_layers}


def async_cases(cases) -> list:
    """[(arch, method, kind, S[, (Hq, Hk)])] on this rank -> one result dict per case (see the module
    doc); the optional head counts override the config's 4/2 (MQA, uneven query heads)."""
    out = []
    for i, (arch, method, kind, S, *heads) in enumerate(cases):
        heads = tuple(heads[0]) if heads else None
        cp, suffix, sync_name, params = METHODS[method]
        mesh = mesh_ctx(cp, hybrid=(2,) if method == "hybrid" else ())
        model_a, model_s, ref = build(arch, 3, heads)
        model_a, plan_a = _apply(model_a, mesh, cp, ADAPTERS[arch] + suffix, params)
        model_s, plan_s = _apply(model_s, mesh, cp, SYNC + sync_name, params)
        assert plan_a.batch_policy == plan_s.batch_policy
        r = compare_async(model_a, plan_a, model_s, plan_s, ref, mesh, kind, S, seed=i)
        out.append({
            "case": f"{arch}/{method}/{kind}/S={S}" + (f"/heads={heads[0]}:{heads[1]}" if heads else ""),
            "logits_vs_cp1": r["logits_rel_cp1"], "logits_vs_sync": r["logits_rel_sync"],
            "grads_vs_cp1": r["grads_cp1"][1], "grads_vs_sync": r["grads_sync"][1], "sync_vs_cp1": r["sync_cp1"][1],
            "pending": r["pending"], "counts": r["counts"], "layers": r["layers"],
        })
    return out


def trace_run(arch: str, method: str, S: int = 32) -> list:
    """One forward+backward of the async adapter; the ``async_trace`` events ``(event, name)``."""
    from hyper_parallel.distributed.context_parallel.async_collectives import async_trace

    cp, suffix, _sync, params = METHODS[method]
    mesh = mesh_ctx(cp, hybrid=(2,) if method == "hybrid" else ())
    [model] = build(arch, 1)
    model, plan = _apply(model, mesh, cp, ADAPTERS[arch] + suffix, params)
    batch, _ref, valid = attention_batch("padding", S, model.config.vocab_size)
    with async_trace() as trace:
        cp_forward_backward(model, mesh, plan, batch, valid, seed=0, use_cache=False)
    return [(e, n) for e, n, _t in trace]


def custom_adapter_parity(S: int = 16, wrapper=None) -> dict:
    """The docs' worked example (examples/cp/async_custom_adapter_example.py) at cp 2: its attention's
    output and every gradient (summed over CP) equal the same module on the whole sequence.
    ``wrapper``: an async Target for that attention (default: the example's own)."""
    import transformers as T

    from examples.cp.async_custom_adapter_example import TinyAttention, tiny_async_colossal_cp_wrapper
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.platform import all_gather, all_reduce

    cfg = T.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ref, attn = TinyAttention(cfg), TinyAttention(cfg)
    attn.load_state_dict(ref.state_dict())
    rope = T.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    mesh = mesh_ctx(2)
    wrapper = wrapper or tiny_async_colossal_cp_wrapper
    wrapper.__hp_inner_wrapper__.validate(attn, cp_size=2)
    attn.forward = wrapper(attn, mesh, None, mesh.cp_mesh, None)
    h = torch.randn(2, S, 64, generator=torch.Generator().manual_seed(3))
    dout = torch.randn(2, S, 64, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(S)[None].expand(2, -1)
    out_ref, _ = ref(h, rope(h, pos), is_causal=True)
    out_ref.backward(dout)
    local = shard_batch_for_cp({"input_ids": torch.zeros(2, S, dtype=torch.long)}, mesh.cp_mesh, "all_gather")
    lo, L = local.meta.cp_rank * local.meta.local_seq_len, local.meta.local_seq_len
    hl = h[:, lo:lo + L]
    with cp_batch_context(local.meta):
        out, _ = attn(hidden_states=hl, position_embeddings=rope(hl, local["position_ids"]))
        out.backward(dout[:, lo:lo + L])
    full = all_gather(out.detach(), mesh.cp_group, dim=1)
    g = {n: all_reduce(p.grad, mesh.cp_group) for n, p in attn.named_parameters()}
    gref = dict(ref.named_parameters())
    return {"out": (full - out_ref.detach()).abs().max().item() / out_ref.abs().max().item(),
            "grads": max((g[n] - gref[n].grad).abs().max().item() / gref[n].grad.abs().max().item() for n in g)}


def validate_mode_catches_wrong_attention(arch: str = "llama") -> str:
    """mode='validate' with the async consumer's engine output scaled by 1.01 (the methods' async
    loops call ``methods.base.engine_attention`` at call time): the comparison with the module on the
    gathered sequence must raise (returns the message)."""
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.context_parallel.methods import base as AH
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp

    cp, suffix, _sync, params = METHODS["colossal"]
    mesh = mesh_ctx(cp)
    [model] = build(arch, 1)
    entry = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
              "inner_wrapper": {"_target_": ADAPTERS[arch] + suffix}}]
    plan = ShardingPlanner(plan_overrides=entry).plan(model, mesh, cp_size=cp)
    model, _ = apply_sharding_plan(model, plan, mesh, mode="validate", fsdp=False)
    batch, _ref, _valid = attention_batch("padding", 32, model.config.vocab_size)
    local = shard_batch_for_cp(batch, mesh.cp_mesh, plan.batch_policy)
    real = AH.engine_attention

    def wrong(*a, **k):     # (out, lse) of the pipelined Colossal chunks: only out is scaled
        r = real(*a, **k)
        return (r[0] * 1.01, r[1]) if isinstance(r, tuple) else r * 1.01
    AH.engine_attention = wrong
    try:
        with cp_batch_context(local.meta):
            model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        AH.engine_attention = real
    return "no error"
