"""Exact CP for Qwen3.5 text (transformers ``qwen3_5`` / ``qwen3_5_moe``): a hybrid of Gated DeltaNet
(linear attention) and gated full attention whose RoPE takes 3-D (mrope) positions built from the
1-D ids. Real transformers classes, tiny random configs, train(), dropout 0, fp32, cp 2 on gloo:
the plan (attention ``sdpa_hf`` / ``sdpa_hf_ulysses``, the GDN ``gated_deltanet_state_passing`` /
``gated_deltanet_ulysses``) applied with the preflight proof; logits and every gradient vs CP=1 for
plain, padded and packed rows (tests/cp/test_mixer_cp.py helpers and tolerance)."""
from __future__ import annotations

import time

import torch

from tests.cp.test_mixer_cp import _check, mixer_cases


def test_qwen3_5_text_exact_cp2(ranks):
    """Qwen3.5 text x {Colossal + GDN state passing, Ulysses + GDN Ulysses}; Qwen3.5-MoE x Colossal + GDN Ulysses."""
    t0 = time.perf_counter()
    _check(ranks(2).run(mixer_cases, [
        (("qwen3_5", "colossal", "gdn_sp", 2), {}),
        (("qwen3_5", "ulysses", "gdn_ulysses", 2), {"kinds": ("padding", "packed"), "S": 29}),
        (("qwen3_5_moe", "colossal", "gdn_ulysses", 2), {"kinds": ("plain", "packed")}),
    ], timeout=600.0))
    print(f"wall {time.perf_counter() - t0:.1f}s")


# ============================================================================ multimodal 3-D (mrope) positions
def mm_positions(B: int, S: int, seed: int) -> torch.Tensor:
    """Synthetic ``[3, B, S]`` ids laid out as ``get_rope_index`` does for an image: per row, text
    ``0..a-1``, a ``rows x cols`` vision grid (temporal row constant, height/width over the grid), text
    again from ``1 + max`` of the grid. Rows differ over the grid and the grid crosses the cp edge."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(3, B, S, dtype=torch.int64)
    for b in range(B):
        a = int(torch.randint(3, S // 3, (1,), generator=g))
        cols = 3 + b
        n = min(cols * 4, S - a - 2)
        i = torch.arange(n)
        grid = torch.stack([torch.full_like(i, a), a + i // cols, a + i % cols])
        start = int(grid.max()) + 1
        text = lambda lo, k: torch.arange(lo, lo + k).expand(3, k)  # noqa: E731
        out[:, b] = torch.cat([text(0, a), grid, text(start, S - a - n)], dim=1)
    return out


def packed_doc_ids(n: int, seed: int) -> torch.Tensor:
    """``[3, n]`` ids of one packed document restarting at 0 (a vision grid when n >= 12, else text)."""
    return mm_positions(1, n, seed)[:, 0] if n >= 12 else torch.arange(n).expand(3, n)


def build_qwen3_5_mm(arch: str):
    """test_mixer_cp's tiny Qwen3.5 (``qwen3_5`` / ``qwen3_5_moe``), or ``qwen3_5_full``: two gated
    full-attention layers only (no Gated DeltaNet: the attention-only methods Head-Tail and the
    balanced split apply)."""
    import transformers as T

    from tests.cp.test_mixer_cp import build_qwen3_5
    if arch != "qwen3_5_full":
        return build_qwen3_5(arch)
    torch.manual_seed(0)
    cfg = T.Qwen3_5TextConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, attn_implementation="sdpa", head_dim=16, intermediate_size=64,
                              layer_types=["full_attention", "full_attention"])
    return T.AutoModelForCausalLM.from_config(cfg)


def mrope_case(arch: str, attn: str, mixer, cp: int = 2, kinds=("plain", "padding"), S: int = 30,
               layouts=(3, 4)) -> dict:
    """Plan + apply with the preflight proof; per batch kind and 3-D layout ([3, B, S] ids, or [4, B, S]
    with the text row first) logits and every gradient vs CP=1 fed the same 3-D ids; plus a control that
    the 3-D ids matter (CP=1 logits with 1-D ids differ)."""
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.cp.test_mixer_cp import ATTN, entries, make_batch
    from tests.wrappers._workers import mesh_ctx, parity_errors

    t0 = time.perf_counter()
    model, ref = build_qwen3_5_mm(arch).float().train(), build_qwen3_5_mm(arch).float().train()
    ref.load_state_dict(model.state_dict())
    mesh = mesh_ctx(cp)
    if mixer is None:
        over = [{"when": "cp", "region_dispatch": False, "inner_target": "self", "match": "*.self_attn",
                 "inner_wrapper": ATTN.get(attn, attn)}]
    else:
        over = entries(arch, attn, mixer)
    plan = ShardingPlanner(plan_overrides=over).plan(model, mesh, cp_size=cp)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=True)
    out = {"case": f"{arch}/{attn}+{mixer}/cp{cp}", "policy": plan.batch_policy, "steps": []}
    for i, kind in enumerate(kinds):
        for K in layouts:
            n = S + i
            batch, docs = make_batch(kind, n, model.config.vocab_size, 10 * i + K)
            pos = mm_positions(2, n, 10 * i + K)
            if kind == "packed":    # transformers' convention: text row 0 restarting per document, no seq_lens
                assert K == 4, "with [3, B, S] ids transformers' mask sees no documents"
                del batch["seq_lens"]
                text = torch.cat([torch.arange(ln) for _b, _s, ln in docs]).view(2, n)
                pos = torch.cat([torch.cat([packed_doc_ids(ln, j) for j, (_b, _s, ln) in enumerate(docs)], 1)
                                 .view(3, 2, n)])
                pos = torch.cat([text[None], pos])
            elif K == 4:
                pos = torch.cat([torch.arange(n).expand(1, 2, n), pos])
            batch["position_ids"] = pos
            valid = torch.zeros(2, n, dtype=torch.bool)
            for b, s, ln in docs:
                valid[b, s:s + ln] = True
            ref_in = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "attention_mask")}
            kw = {"use_cache": False} if kind == "packed" else {}   # transformers derives documents only then
            ref_in.update(kw)
            res = parity_errors(model, ref, mesh, plan, batch, ref_in, valid, 10 * i + K + 1, **kw)
            with torch.no_grad():    # control: the same batch with 1-D positions at CP=1
                one_d = ref(**{**ref_in, "position_ids": torch.arange(n).expand(2, n)}).logits
                mm = ref(**ref_in).logits
            res["ids_matter"] = ((one_d - mm).abs() * valid[..., None]).max().item() / mm.abs().max().item()
            out["steps"].append({"kind": kind, "K": K, "S": n, **res})
    out["time_s"] = time.perf_counter() - t0
    return out


def mrope_cases(cases: list) -> list:
    return [mrope_case(*c[0], **c[1]) for c in cases]


def _check_mrope(results: list) -> None:
    from tests.cp.test_mixer_cp import TOL
    for per_rank in zip(*results):
        head = per_rank[0]
        print(f"{head['case']:<40} policy={str(head['policy']):<10} ({head['time_s']:.1f}s)")
        for i, step in enumerate(head["steps"]):
            rel_l = max(r["steps"][i]["logits_rel"] for r in per_rank)
            rel_g = max(r["steps"][i]["grads"] for r in per_rank)
            abs_l = max(r["steps"][i]["logits"] for r in per_rank)
            abs_g = max(r["steps"][i]["grads_abs"] for r in per_rank)
            print(f"    {step['kind']:<8} [{step['K']}, B, {step['S']}] ids: logits max abs {abs_l:.2e} rel {rel_l:.2e};"
                  f" grads max abs {abs_g:.2e} rel(largest grad) {rel_g:.2e}; tolerance {TOL:g}; "
                  f"1-D ids instead change CP=1 logits by {step['ids_matter']:.2e}")
            assert rel_l <= TOL and rel_g <= TOL, (head["case"], step)
            assert step["ids_matter"] > 100 * TOL, step      # the 3-D ids are not a no-op


def test_qwen3_5_multimodal_positions_cp2(ranks):
    """Multimodal 3-D RoPE ids ([3, B, S] and [4, B, S]) exact at cp 2: Qwen3.5 x Colossal + GDN state
    passing, x Ulysses + GDN Ulysses; Qwen3.5-MoE x Colossal; an attention-only Qwen3.5 x Head-Tail and x
    the balanced split (plain and right-padded rows; S not a multiple of the policy: CP pad tokens); packed
    rows in transformers' [4, B, S] convention (text row restarting per document) on the attention-only model."""
    t0 = time.perf_counter()
    _check_mrope(ranks(2).run(mrope_cases, [
        (("qwen3_5", "colossal", "gdn_sp"), {}),
        (("qwen3_5", "ulysses", "gdn_ulysses"), {"S": 29}),
        (("qwen3_5_moe", "colossal", "gdn_ulysses"), {"kinds": ("padding",), "layouts": (3,)}),
        (("qwen3_5_full", "head_tail", None), {"S": 29}),
        (("qwen3_5_full", "sdpa_hf_balanced", None), {"S": 29}),
        (("qwen3_5_full", "colossal", None), {"kinds": ("packed",), "layouts": (4,), "S": 36}),
    ], timeout=600.0))
    print(f"wall {time.perf_counter() - t0:.1f}s")


def build_qwen3_5_vlm():
    """A tiny Qwen3.5 with its vision tower (``Qwen3_5ForConditionalGeneration``; builds on CPU)."""
    import transformers as T

    torch.manual_seed(0)
    text = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=64, layer_types=["linear_attention", "full_attention"],
                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    cfg = T.Qwen3_5Config(text_config=text, vision_config=vision)
    cfg._attn_implementation = "sdpa"
    return T.Qwen3_5ForConditionalGeneration(cfg).float().train()


def vlm_plans() -> dict:
    """The full multimodal class planned at cp 2 (its tower is registered, models/qwen3_5/vision.py):
    without declarations, with the language model's attention + GDN declared, and with the vision
    attention declared too -> the refusal message, or the planned CP targets."""
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.wrappers._workers import mesh_ctx

    model, mesh, out = build_qwen3_5_vlm(), mesh_ctx(2), {}
    base = {"when": "cp", "region_dispatch": False, "inner_target": "self"}
    text = [{**base, "match": "*.self_attn", "inner_wrapper": "sdpa_hf"},
            {**base, "match": "*.linear_attn", "inner_wrapper": "gated_deltanet_state_passing"}]
    for name, over in (("none", None), ("text", text), ("all", text + [{**base, "match": "*.blocks.*.attn",
                                                                          "inner_wrapper": "sdpa_hf"}])):
        try:
            plan = ShardingPlanner(plan_overrides=over).plan(model, mesh, cp_size=2)
            out[name] = sorted(t.fqn for t in plan.cp_targets)
        except Exception as exc:  # noqa: BLE001 - the refusal is the subject
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def test_qwen3_5_vlm_planned_cp2(ranks):
    """Qwen3_5ForConditionalGeneration (vision tower, registered) at cp 2: the language model's attention
    and GDN declared -> planned on those only (the tower runs per rank, tests/vlm/test_vlm_families.py);
    undeclared -> refused naming the language model's attention; a method declared on the tower's
    attention -> refused naming it (the tower is never under CP)."""
    for res in ranks(2).run(vlm_plans, timeout=300.0):
        for name, msg in res.items():
            print(name, "->", msg)
        assert res["text"] == ["model.language_model.layers.0.linear_attn", "model.language_model.layers.1.self_attn"]
        assert isinstance(res["none"], str) and res["none"].startswith("CPConfigError"), res
        assert "model.language_model.layers.1.self_attn" in res["none"] and "no CP method" in res["none"], res
        assert isinstance(res["all"], str) and res["all"].startswith("CPConfigError"), res
        assert "model.visual.blocks.0.attn" in res["all"] and "only modules of the vision tower" in res["all"], res
