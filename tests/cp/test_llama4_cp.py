"""Llama 4 text under CP=2 (gloo) through ``ShardingPlanner.plan`` + ``apply_sharding_plan`` (the
proof on, its default): chunked attention (``attention_chunk_size=6`` smaller than a rank's chunk, so
chunks cross the rank edge) and temperature tuning on the NoPE layers equal CP=1 — logits and every
gradient — for plain, right-padded and packed rows, with each synchronous ``*_hf`` method.

The reference is CP=1 through transformers with every document its own right-padded row (the
proof's reference): packed documents are independent, their chunks and temperature positions
count from the document start (CP reads both from the batch's position ids)."""
from __future__ import annotations

import time

import torch

ATTN = {"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self"}
TOL = 1e-5          # fp32: max |cp - ref| relative to max |ref| (logits) / to the largest gradient
HEAD_TAIL = {"_target_": "hyper_parallel.distributed.context_parallel.wrappers.sdpa_hf_load_balance_cp_wrapper"}
METHODS = ("sdpa_hf", "sdpa_hf_ulysses", HEAD_TAIL)


def build():
    import transformers as T

    torch.manual_seed(0)
    cfg = T.Llama4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_local_experts=2, interleave_moe_layer_step=2, no_rope_layers=[1, 0, 1, 0],
                             attention_chunk_size=6, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
                             attention_dropout=0.0, attn_implementation="sdpa")
    assert cfg.layer_types == ["chunked_attention", "full_attention"] * 2, cfg.layer_types
    return T.Llama4ForCausalLM(cfg).train()


def case(wrapper) -> dict:
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.cp.common import mesh_ctx
    from tests.cp.test_mixer_cp import parity_step

    t0 = time.perf_counter()
    model, ref = build(), build()
    ref.load_state_dict(model.state_dict())
    mesh = mesh_ctx(2)
    plan = ShardingPlanner(plan_overrides=[{**ATTN, "inner_wrapper": wrapper}]).plan(model, mesh, cp_size=2)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False)
    steps = [parity_step(model, ref, mesh, plan, k, 30, 10 * i + 3) for i, k in enumerate(("plain", "padding", "packed"))]
    return {"case": wrapper if isinstance(wrapper, str) else "head_tail (sdpa_hf_load_balance_cp_wrapper)", "steps": steps, "time_s": time.perf_counter() - t0}


def cases(items: list) -> list:
    return [case(w) for w in items]


def test_llama4_text_cp2_matches_cp1(ranks):
    """Every synchronous method: logits and every gradient equal CP=1 (chunks + temperature tuning)."""
    t0 = time.perf_counter()
    out = ranks(2).run(cases, list(METHODS), timeout=300.0)
    for per_rank in zip(*out):
        print(f"{per_rank[0]['case']}: {max(r['time_s'] for r in per_rank):.1f}s")
        for i, st in enumerate(per_rank[0]["steps"]):
            rel_l = max(r["steps"][i]["logits_rel"] for r in per_rank)
            rel_g = max(r["steps"][i]["grads"] for r in per_rank)
            abs_l = max(r["steps"][i]["logits_abs"] for r in per_rank)
            abs_g = max(r["steps"][i]["grads_abs"] for r in per_rank)
            print(f"    {st['kind']:<8} S={st['S']}: logits max abs {abs_l:.2e} rel {rel_l:.2e}; grads max abs "
                  f"{abs_g:.2e} rel(largest grad) {rel_g:.2e}; tolerance {TOL:g}")
            assert rel_l <= TOL and rel_g <= TOL, (per_rank[0]["case"], st)
    print(f"total {time.perf_counter() - t0:.1f}s")
