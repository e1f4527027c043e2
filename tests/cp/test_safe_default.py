"""Safe by default through the library API: ``ShardingPlanner.plan`` + ``apply_sharding_plan``
with its defaults proves the model (cp > 1), so no architecture returns wrong numbers silently.

Real transformers classes, tiny random configs (nothing downloaded), train() mode, dropout 0,
CP=2 on the warm gloo pool:

* refused with the semantic named: Qwen3-Next declared for its
  attention only (the Gated DeltaNet named, with the token-mixer methods that accept it), MiniMax
  (a linear attention named like attention: its class and the mixer methods, undeclared or
  declared with an attention wrapper);
* a plain Llama applied with the defaults equals CP=1 (logits and every gradient);
* ``sdpa_qkv`` cores: ``is_causal=False`` is full attention over the global keys (padding and
  packed documents kept) and equals CP=1 for every method of the style; a caller-given
  ``attn_mask`` is refused at the call (and at apply when every call carries one), naming the
  module, ``attn_mask`` and the fix;
* ``preflight_proof=False`` skips the proof (the undeclared hybrid is then applied).
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from hyper_parallel.distributed.context_parallel import catalogue

ATTN = {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self"}
TOL = 2e-5          # fp32: max |cp - ref| relative to max |ref| (logits) / to the largest gradient


# ============================================================================ models
def _common():
    return dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", attention_dropout=0.0)


def build(kind: str):
    import transformers as T

    torch.manual_seed(0)
    if kind == "minimax":
        cfg = T.MiniMaxConfig(**_common(), head_dim=16, num_local_experts=2, num_experts_per_tok=1, block_size=16,
                              layer_types=["linear_attention", "full_attention"])
        return T.AutoModelForCausalLM.from_config(cfg).train()
    from tests.cp.test_model_proof import build_model

    return build_model(kind).train()


class KeyMaskCore(nn.Module):
    """``forward(q, k, v, scale=None)`` SDPA core (``is_causal`` fixed per core). Like an HF
    attention, it masks padding keys with the model's ``attention_mask`` when the model is called
    with one (``key_mask``, set by a model pre-hook) — so at CP=1 padding is respected; under CP
    the batch carries padding and the model is called without a mask. ``always_mask``: the core
    builds and passes a causal boolean mask on every call."""

    def __init__(self, num_heads: int, num_key_value_heads: int, causal: bool, always_mask: bool = False):
        super().__init__()
        self.num_heads, self.num_key_value_heads = num_heads, num_key_value_heads
        self.causal, self.always_mask = causal, always_mask
        self.key_mask = None

    def forward(self, q, k, v, scale=None):
        mask = None
        if self.key_mask is not None:
            mask = self.key_mask[:, None, None, :].to(q.device)                 # [B, 1, 1, S] keys
            if self.causal:
                mask = mask & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        elif self.always_mask:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        causal = self.causal and mask is None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=True)


def qkv_llama(causal: bool, always_mask: bool = False):
    """A Llama whose attentions delegate to ``self_attn.core_attention`` (:class:`KeyMaskCore`)."""
    from tests.wrappers._models import to_qkv

    model = to_qkv(build("llama"))
    cfg = model.config
    cores = []
    for layer in model.model.layers:
        layer.self_attn.core_attention = KeyMaskCore(cfg.num_attention_heads, cfg.num_key_value_heads, causal,
                                                     always_mask)
        cores.append(layer.self_attn.core_attention)

    def set_mask(mod, args, kwargs):
        m = kwargs.get("attention_mask")
        for c in cores:
            c.key_mask = None if m is None else m.bool()

    model.register_forward_pre_hook(set_mask, with_kwargs=True)
    return model


# ============================================================================ rank functions
def _plan(model, entries, cp: int = 2):
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.cp.common import mesh_ctx

    mesh = mesh_ctx(cp)
    return ShardingPlanner(plan_overrides=entries).plan(model, mesh, cp_size=cp), mesh


def api_case(kind: str, entries: list, **apply_kwargs) -> dict:
    """Plan + apply with the library defaults (plus ``apply_kwargs``); the outcome, never raises."""
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan

    t0 = time.perf_counter()
    model = build(kind)
    try:
        plan, mesh = _plan(model, entries)
        apply_sharding_plan(model, plan, mesh, **apply_kwargs)
        out = {"ok": True}
    except Exception as exc:  # noqa: BLE001 - the refusal is the subject
        out = {"ok": False, "type": type(exc).__name__, "msg": str(exc)}
    out["time_s"] = time.perf_counter() - t0
    return out


def parity_case(kind: str, wrapper: str, kinds=("plain", "padding", "packed")) -> dict:
    """Apply with the defaults (the proof runs; fsdp off to compare plain gradients), then one
    forward+backward per batch kind against the same weights at CP=1."""
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from tests.cp.test_mixer_cp import parity_step

    t0 = time.perf_counter()
    if kind.startswith("qkv"):
        causal = kind == "qkv_causal"
        model, ref = qkv_llama(causal), qkv_llama(causal)
        entries = [{**ATTN, "inner_target": "core_attention", "inner_wrapper": wrapper}]
    else:
        model, ref = build(kind), build(kind)
        entries = [{**ATTN, "inner_wrapper": wrapper}]
    ref.load_state_dict(model.state_dict())
    plan, mesh = _plan(model, entries)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False)
    t_apply = time.perf_counter() - t0
    steps = [parity_step(model, ref, mesh, plan, k, 30 + i, 10 * i + 3) for i, k in enumerate(kinds)]
    return {"case": f"{kind}/{wrapper}", "steps": steps, "apply_s": t_apply, "time_s": time.perf_counter() - t0}


def mask_refusal_case(wrapper: str = "sdpa_qkv") -> dict:
    """A qkv core given the model's attention_mask under CP: refused at the call, on every rank,
    before any collective of that call (the next call still works); a core that always passes a
    mask is refused at apply (the proof's CP forward)."""
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan

    entries = [{**ATTN, "inner_target": "core_attention", "inner_wrapper": wrapper}]
    out = {}
    model = qkv_llama(causal=True)
    plan, mesh = _plan(model, entries)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False)
    ids = torch.randint(1, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    local = shard_batch_for_cp({"input_ids": ids}, mesh.cp_mesh, plan.batch_policy)
    with cp_batch_context(local.meta):
        try:
            model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                  attention_mask=torch.ones_like(local["input_ids"]))
            out["call"] = None
        except Exception as exc:  # noqa: BLE001
            out["call"] = f"{type(exc).__name__}: {exc}"
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        out["after"] = bool(torch.isfinite(logits).all())
    model = qkv_llama(causal=True, always_mask=True)
    plan, mesh = _plan(model, entries)
    try:
        apply_sharding_plan(model, plan, mesh)
        out["apply"] = None
    except Exception as exc:  # noqa: BLE001
        out["apply"] = f"{type(exc).__name__}: {exc}"
    return out


def cases(fn_name: str, items: list) -> list:
    fn = globals()[fn_name]
    return [fn(*a, **kw) for a, kw in items]


# ============================================================================ tests
def _both(ranks, fn_name: str, items: list, timeout: float = 300.0) -> list:
    res = ranks(2).run(cases, fn_name, items, timeout=timeout)
    return list(zip(*res))      # per item: (rank 0, rank 1)


def _mixer_names() -> set:
    return {o.registry_name for m in catalogue.mixer_methods() for o in m.offers if o.registry_name}


def test_api_refuses_by_default_with_the_semantic_named(ranks):
    """An undeclared Qwen3-Next mixer and MiniMax's linear attention are refused by
    plan + apply with their defaults, on both ranks with the same message."""
    attn = [{**ATTN, "inner_wrapper": "sdpa_hf"}]
    softmax_only = [{**ATTN, "match": "model.layers.1.self_attn", "inner_wrapper": "sdpa_hf"}]
    items = [(("qwen3_next", attn), {}), (("minimax", softmax_only), {}),
             (("minimax", attn), {})]
    out = _both(ranks, "api_case", items)
    for (args, _kw), per_rank in zip(items, out):
        for o in per_rank:
            print(args[0], {k: v for k, v in o.items() if k != "msg"}, o.get("msg", "")[:600])
            assert not o["ok"] and o["type"] == "CPConfigError", o
        assert per_rank[0]["msg"] == per_rank[1]["msg"]
    qwen3_next, minimax_undeclared, minimax_declared = (p[0]["msg"] for p in out)
    assert "'model.layers.0.linear_attn' (Qwen3NextGatedDeltaNet)" in qwen3_next, qwen3_next
    assert "token-mixer methods that accept Qwen3NextGatedDeltaNet" in qwen3_next, qwen3_next
    for name in ("sequence_gather", "gated_deltanet_ulysses", "gated_deltanet_state_passing"):
        assert name in qwen3_next, qwen3_next
    assert "short_conv_halo" not in qwen3_next and "mamba2_state_passing" not in qwen3_next, qwen3_next
    for msg in (minimax_undeclared, minimax_declared):
        assert "MiniMaxLightningAttention" in msg and "model.layers.0.self_attn" in msg, msg
        assert "token mixer (e.g. linear attention), not softmax attention" in msg, msg
        assert "inner_wrapper: sequence_gather" in msg, msg
        assert "attention boundary has no CP method" not in msg, msg
        named = {n for n in _mixer_names() if n in msg}
        assert named and named <= _mixer_names(), msg


def test_api_default_llama_matches_cp1_and_opt_out(ranks):
    """A plain Llama through plan + apply (defaults: the proof runs and passes) equals CP=1; with
    preflight_proof=False the undeclared hybrid is applied (the opt-out skips the proof)."""
    t0 = time.perf_counter()
    out = _both(ranks, "parity_case", [(("llama", "sdpa_hf"), {})])
    _check(out)
    opt = _both(ranks, "api_case", [(("qwen3_next", [{**ATTN, "inner_wrapper": "sdpa_hf"}]),
                                     {"preflight_proof": False, "fsdp": False})])
    for o in opt[0]:
        assert o["ok"], o
    print(f"total {time.perf_counter() - t0:.1f}s")


def _check(out) -> None:
    for per_rank in out:
        res = per_rank[0]
        print(f"{res['case']}: apply (with the proof) {max(r['apply_s'] for r in per_rank):.2f}s, "
              f"total {res['time_s']:.1f}s")
        for i, step in enumerate(res["steps"]):
            rel_l = max(r["steps"][i]["logits_rel"] for r in per_rank)
            rel_g = max(r["steps"][i]["grads"] for r in per_rank)
            abs_l = max(r["steps"][i]["logits_abs"] for r in per_rank)
            abs_g = max(r["steps"][i]["grads_abs"] for r in per_rank)
            print(f"    {step['kind']:<8} S={step['S']}: logits max abs {abs_l:.2e} rel {rel_l:.2e}; grads max abs "
                  f"{abs_g:.2e} rel(largest grad) {rel_g:.2e}; tolerance {TOL:g}")
            assert rel_l <= TOL and rel_g <= TOL, (res["case"], step)


def test_sdpa_qkv_non_causal_exact_and_mask_refused(ranks):
    """is_causal=False through every sdpa_qkv method equals CP=1 (full attention over the global
    keys, padding and packed documents respected); the causal core still does; attn_mask refused."""
    t0 = time.perf_counter()
    wrappers = [o.registry_name or {"_target_": o.target} for m in catalogue.attention_methods()
                if m.degree != "param" for o in m.offers if o.style == "qkv" and o.entry]   # Hybrid needs cp 4
    items = [(("qkv_noncausal", w), {}) for w in wrappers] + [(("qkv_causal", "sdpa_qkv"), {"kinds": ("padding",)})]
    _check(_both(ranks, "parity_case", items))
    res = _both(ranks, "mask_refusal_case", [((), {})])[0]
    for o in res:
        print(o)
        assert o["call"] is not None and o["apply"] is not None, o
        for msg in (o["call"], o["apply"]):
            assert "module 'model.layers.0.self_attn.core_attention'" in msg, msg
            assert "passes attn_mask" in msg and "Fix: call SDPA without attn_mask" in msg, msg
        assert o["call"].startswith("ValueError") and o["apply"].startswith("CPConfigError"), o
        assert o["after"], o
    assert res[0]["call"] == res[1]["call"]
    print(f"total {time.perf_counter() - t0:.1f}s")


def test_3d_rope_positions_pass_preflight_text_only():
    """A rotary module taking 3-D (multimodal mrope) positions passes the RoPE preflight that
    apply_sharding_plan runs first (cp > 1): it is probed with text-only [3, 1, L] positions; real
    multimodal rows are refused at run time (tests/cp/test_rope.py, local, no ranks)."""
    import transformers as T

    from hyper_parallel.distributed.context_parallel.rope import check_rotary_modules

    cfg = T.Qwen3VLTextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                               "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    model = T.Qwen3VLTextModel(cfg)
    assert check_rotary_modules(model, 2) == ["rotary_emb"]
    assert check_rotary_modules(model, 1) == []
