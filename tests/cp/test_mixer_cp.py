"""Exact CP for the token mixers of hybrid decoders: the mixer module declared in
plan_overrides next to the attention, on real transformers classes (tiny random configs, nothing
downloaded, train(), dropout 0, fp32).

* ``sequence_gather`` (generic: AllGather, the module's own forward on the global sequence, this
  rank's slice) on Qwen3-Next ``linear_attn`` (Gated DeltaNet), LFM2 ``conv`` (short conv) and
  Falcon-H1 ``mamba`` (Mamba2); ``short_conv_halo`` (halo exchange of k-1 tokens) on LFM2;
* the state-passing methods: Gated DeltaNet (Qwen3-Next) and Mamba2 (Falcon-H1, Bamba, NemotronH,
  Granite 4, Zamba2);
* attention Colossal / Ulysses at cp 2, Colossal / Hybrid (u=2) at cp 4;
* batches: plain, right padding (+ CP padding: S not a multiple of cp), packed documents;
* logits and EVERY parameter gradient vs the same model at CP=1 where every document is its own
  row (for plain / padded batches that is exactly the HF batch, attention_mask included);
  gradient error relative to the model's largest gradient;
* the CP preflight proof passes for the declared models (through apply_sharding_plan);
* Head-Tail + a mixer method is planned; refusals: a mixer method on a torch.nn layer / nested declarations,
  the halo method on a module it is not exact for.
"""
from __future__ import annotations

import time

import pytest
import torch

from tests.cp.test_model_proof import build_model
from tests.wrappers._workers import mesh_ctx

#: fp32 tolerance (relative to max|logits| on valid tokens / to the model's largest gradient).
#: The CP path runs the same module math on the same tokens; what differs is the row layout
#: (documents as their own rows, gathered sequences) and summation order (gradient sums over
#: ranks), i.e. fp32 rounding only (~1e-7 .. 1e-6 measured).
TOL = 2e-5

WRAPPERS = "hyper_parallel.distributed.context_parallel.wrappers."
MIXERS = "hyper_parallel.distributed.context_parallel.mixers."
ATTN = {   # name -> inner_wrapper
    "colossal": "sdpa_hf",
    "ulysses": "sdpa_hf_ulysses",
    "hybrid": {"_target_": WRAPPERS + "sdpa_hf_hybrid_cp_wrapper", "ulysses_degree": 2},
    "head_tail": {"_target_": WRAPPERS + "sdpa_hf_load_balance_cp_wrapper"},
}
MIXER_FQN = {"qwen3_next": "*.linear_attn", "qwen3_next_h4": "*.linear_attn", "qwen3_5": "*.linear_attn",
             "qwen3_5_moe": "*.linear_attn", "lfm2": "*[0-9].conv",
             "falcon_h1": "*.mamba", "falcon_h1_rms": "*.mamba", "bamba": "*.mamba", "granitemoehybrid": "*.mamba",
             "zamba2": "*.mamba", "nemotron_h": "model.layers.0.mixer",
             "kimi_linear": "model.layers.0.self_attn", "minimax": "model.layers.0.self_attn",
             "jamba": "*.mamba", "falcon_mamba": "*.mixer", "recurrent_gemma": "model.layers.0.temporal_block"}
#: the attention modules' match where it is not "*.self_attn" (NemotronH names every mixer "mixer"; Kimi
#: Linear and MiniMax name every mixer "self_attn")
ATTN_FQN = {"nemotron_h": "model.layers.1.mixer", "kimi_linear": "model.layers.1.self_attn",
            "minimax": "model.layers.1.self_attn", "falcon_mamba": None,
            "recurrent_gemma": "model.layers.1.temporal_block"}
MIXER = {"gather": "sequence_gather", "gather_target": {"_target_": MIXERS + "sequence_gather_cp_wrapper"},
         "halo": "short_conv_halo", "gdn_ulysses": "gated_deltanet_ulysses",
         "gdn_sp": "gated_deltanet_state_passing", "m2_sp": "mamba2_state_passing",
         "kda_sp": "kda_state_passing", "lightning_sp": "lightning_state_passing", "m1_sp": "mamba1_state_passing",
         "rglru_sp": "rglru_state_passing",
         "gdn_sp_target": {"_target_": "hyper_parallel.models.qwen3_next.gated_deltanet."
                                       "gated_deltanet_state_passing_cp_wrapper"}}


def entries(arch: str, attn: str, mixer: str) -> list:
    base = {"when": "cp", "region_dispatch": False, "inner_target": "self"}
    attn_fqn = ATTN_FQN.get(arch, "*.self_attn")        # None: a model without attention (Falcon-Mamba)
    return [{**base, "match": attn_fqn, "inner_wrapper": ATTN[attn]}] * (attn_fqn is not None) + [
        {**base, "match": MIXER_FQN[arch], "inner_wrapper": MIXER[mixer]}]


# ============================================================================ rank functions
def build_mamba2_family(arch: str):
    """A tiny random Bamba / NemotronH / Granite 4 / Zamba2 (first layer Mamba2, second attention;
    4 SSM heads in 2 groups, chunk 16)."""
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  attn_implementation="sdpa", num_hidden_layers=2)
    ssm = dict(mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)
    if arch == "bamba":
        cfg = T.BambaConfig(**common, **ssm, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32,
                            mamba_n_groups=2, mamba_chunk_size=16)
    elif arch == "nemotron_h":
        cfg = T.NemotronHConfig(**common, hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=16,
                                ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, head_dim=16)
    elif arch == "granitemoehybrid":
        cfg = T.GraniteMoeHybridConfig(**common, **ssm, layer_types=["mamba", "attention"], mamba_n_heads=4,
                                       mamba_d_head=32, mamba_n_groups=2, mamba_chunk_size=16, num_local_experts=4,
                                       num_experts_per_tok=2)
    else:
        cfg = T.Zamba2Config(**common, **ssm, layers_block_type=["mamba", "hybrid"], n_mamba_heads=4,
                             mamba_headdim=32, mamba_ngroups=2, chunk_size=16, attention_head_dim=16)
    return T.AutoModelForCausalLM.from_config(cfg)


def build_qwen3_5(arch: str):
    """A tiny random Qwen3.5 text model (``qwen3_5``: dense MLP; ``qwen3_5_moe``: sparse MoE):
    layers linear / full / linear attention (Gated DeltaNet with 2 key, 4 value heads; gated full
    attention with 3-D (mrope) RoPE positions built from the 1-D ids)."""
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  attn_implementation="sdpa", head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "full_attention", "linear_attention"])
    if arch == "qwen3_5_moe":
        cfg = T.Qwen3_5MoeTextConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=32)
    else:
        cfg = T.Qwen3_5TextConfig(**common, intermediate_size=64)
    return T.AutoModelForCausalLM.from_config(cfg)


def make_state_visible(model) -> None:
    """A slow SSM decay (A = -0.5, dt ~ softplus(-2); default init forgets within ~15 tokens) and a
    mixer output not ~1e-4 of the residual stream, so a test can tell whether the state crossed a
    rank edge."""
    from hyper_parallel.distributed.context_parallel.mixers.mamba2 import MAMBA2_FAMILIES

    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__ in MAMBA2_FAMILIES:
                mod.A_log.fill_(-0.6931)
                mod.dt_bias.fill_(-2.0)
                mod.in_proj.weight.mul_(10.0)
                mod.out_proj.weight.mul_(30.0)


def build(arch: str):
    """test_model_proof's tiny models, plus Qwen3-Next with 4 linear key heads (Gated DeltaNet
    Ulysses at cp 4) and the Mamba2 families."""
    import transformers as T

    if arch in ("kimi_linear", "minimax", "jamba", "falcon_mamba", "recurrent_gemma"):
        from tests.cp.linear_attention_models import build_linear_attention
        return build_linear_attention(arch)
    if arch in ("bamba", "nemotron_h", "granitemoehybrid", "zamba2"):
        model = build_mamba2_family(arch)
        make_state_visible(model)
        return model
    if arch.startswith("falcon_h1"):
        if arch == "falcon_h1_rms":      # Falcon-H1 with the gated RMS norm after the scan, 2 SSM groups
            torch.manual_seed(0)
            cfg = T.FalconH1Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                                   head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                                   mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=True)
            model = T.AutoModelForCausalLM.from_config(cfg)
        else:
            model = build_model(arch)
        make_state_visible(model)
        return model
    if arch.startswith("qwen3_5"):
        return build_qwen3_5(arch)
    if arch != "qwen3_next_h4":
        return build_model(arch)
    torch.manual_seed(0)
    cfg = T.Qwen3NextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", head_dim=16,
                            linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=8, linear_conv_kernel_dim=4,
                            layer_types=["linear_attention", "full_attention"], num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return T.AutoModelForCausalLM.from_config(cfg)


def make_batch(kind: str, S: int, vocab: int, seed: int):
    """(CP global batch, documents [(row, start, length)]) for plain / padding / packed."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, S), generator=g)
    batch = {"input_ids": ids}
    if kind == "plain":
        docs = [(0, 0, S), (1, 0, S)]
    elif kind == "padding":
        mask = torch.ones(2, S, dtype=torch.int64)
        mask[0, S - 5:] = 0
        mask[1, S - 11:] = 0
        batch["attention_mask"] = mask
        docs = [(0, 0, S - 5), (1, 0, S - 11)]
    elif kind == "packed":     # documents as seq_lens (positions restart per document)
        lens = [[S // 3, S // 4, S - S // 3 - S // 4], [7, S - 13, 6]]
        batch["seq_lens"] = torch.tensor(lens)
        docs = []
        for b, row in enumerate(lens):
            start = 0
            for n in row:
                docs.append((b, start, n))
                start += n
    else:
        raise ValueError(kind)
    return batch, docs


def parity_step(model, ref, mesh, plan, kind: str, S: int, seed: int) -> dict:
    """One forward+backward under CP and at CP=1 (every document its own right-padded row with
    attention_mask); max errors on this rank."""
    from tests.wrappers._workers import document_parity

    batch, docs = make_batch(kind, S, model.config.vocab_size, seed)
    r = document_parity(model, ref, mesh, plan, batch, docs, seed + 1)
    return {"kind": kind, "S": S, "logits_abs": r["logits_abs"], "logits_rel": r["logits_rel"],
            "grads_abs": r["grads_abs"], "grads": r["grads"], "worst_param": r["worst"],
            "cp_pad": r["meta"].global_seq_len - S}


def mixer_case(arch: str, attn: str, mixer: str, cp: int, kinds=("plain", "padding", "packed"),
               S: int = 30, proof: bool = True, proof_tol: float = 1e-5) -> dict:
    """Plan (attention + mixer declared), apply with the preflight proof, then parity per batch kind.
    ``proof_tol``: the bound asserted on the proof's worst relative error (its own refusal bound is
    looser: a layer update may differ by ``rtol/10`` of the layer output, the residual stream)."""
    from hyper_parallel.distributed.context_parallel.model_proof import prove_cp_model
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    t0 = time.perf_counter()
    model, ref = build(arch).float().train(), build(arch).float().train()
    ref.load_state_dict(model.state_dict())
    mesh = mesh_ctx(cp, hybrid=(2,) if attn == "hybrid" else ())
    plan = ShardingPlanner(plan_overrides=entries(arch, attn, mixer)).plan(model, mesh, cp_size=cp)
    out = {"case": f"{arch}/{attn}+{mixer}/cp{cp}", "policy": plan.batch_policy,
           "mixers": sorted({t.inner_fqn for t in plan.cp_targets if t.info.mixer})}
    # the proof runs inside apply (a refusal would raise here and roll the install back)
    model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=proof)
    names = dict(model.named_modules())
    out["installed"] = sorted({getattr(names[f].forward, "__hp_mixer__", None) for f in out["mixers"]})
    if proof:   # the number it measured (one more probe; the model is left unchanged by it)
        out["proof_rel"] = prove_cp_model(model, plan, mesh).max_rel_error
        out["proof_tol"] = proof_tol
    out["steps"] = [parity_step(model, ref, mesh, plan, k, S + i, 10 * i + 3) for i, k in enumerate(kinds)]
    out["time_s"] = time.perf_counter() - t0
    return out


def mixer_cases(cases: list) -> list:
    return [mixer_case(*c[0], **c[1]) for c in cases]


def broken_halo_case(cp: int = 2) -> dict:
    """Negative control: LFM2 + short_conv_halo whose received halo is zeroed (the exchange still
    runs, so backward stays symmetric). The proof must refuse it naming the conv as a declared
    method that differs, and the parity step must see the error."""
    from hyper_parallel.distributed.context_parallel.mixers import halo as mixers
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    real = mixers.halo_exchange

    def broken(x, cp_mesh, h):
        ext = real(x, cp_mesh, h)
        return torch.cat([ext[:, :h] * 0, ext[:, h:]], dim=1)

    mixers.halo_exchange = broken
    try:
        model, ref = build_model("lfm2").float().train(), build_model("lfm2").float().train()
        ref.load_state_dict(model.state_dict())
        mesh = mesh_ctx(cp)
        plan = ShardingPlanner(plan_overrides=entries("lfm2", "colossal", "halo")).plan(model, mesh, cp_size=cp)
        try:
            apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=True)
            refused = None
        except Exception as exc:  # noqa: BLE001 - the refusal is the subject
            refused = f"{type(exc).__name__}: {exc}"
        model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=False)   # the broken one
        return {"refused": refused, "step": parity_step(model, ref, mesh, plan, "plain", 30, 3)}
    finally:
        mixers.halo_exchange = real


# ============================================================================ tests
def _check(results: list) -> None:
    for per_rank in zip(*results):
        for res in per_rank[:1]:
            print(f"{res['case']:<42} policy={res['policy']:<10} proof={res.get('proof_rel', float('nan')):.1e} "
                  f"({res['time_s']:.1f}s)")
        for i, step in enumerate(per_rank[0]["steps"]):
            worst_l = max(r["steps"][i]["logits_rel"] for r in per_rank)
            worst_g = max(r["steps"][i]["grads"] for r in per_rank)
            abs_l = max(r["steps"][i]["logits_abs"] for r in per_rank)
            abs_g = max(r["steps"][i]["grads_abs"] for r in per_rank)
            print(f"    {step['kind']:<8} S={step['S']} cp_pad={step['cp_pad']}: logits max abs {abs_l:.2e} rel "
                  f"{worst_l:.2e}; grads max abs {abs_g:.2e} rel(largest grad) {worst_g:.2e} "
                  f"[{step['worst_param']}]; tolerance {TOL:g}")
            assert worst_l <= TOL and worst_g <= TOL, (per_rank[0]["case"], step)
        for res in per_rank:
            method = res["case"].split("+")[1].split("/")[0]
            want = {"halo": "short_conv_halo_cp_wrapper", "gdn_ulysses": "gated_deltanet_ulysses_cp_wrapper",
                    "gdn_sp": "gated_deltanet_state_passing_cp_wrapper",
                    "m2_sp": "mamba2_state_passing_cp_wrapper", "kda_sp": "kda_state_passing_cp_wrapper",
                    "lightning_sp": "lightning_state_passing_cp_wrapper", "m1_sp": "mamba1_state_passing_cp_wrapper",
                    "rglru_sp": "rglru_state_passing_cp_wrapper",
                    "gdn_sp_target": "gated_deltanet_state_passing_cp_wrapper"}
            assert res["mixers"] and res["installed"] == [want.get(method, "sequence_gather_cp_wrapper")], res
            if "proof_rel" in res:
                assert res["proof_rel"] < res["proof_tol"], res


def test_mixers_exact_cp2(ranks):
    """cp=2: the three hybrids x generic gather (Colossal and Ulysses attention), LFM2 x halo."""
    t0 = time.perf_counter()
    cases = [
        (("qwen3_next", "colossal", "gather", 2), {}),
        (("qwen3_next", "ulysses", "gather_target", 2), {"kinds": ("padding", "packed"), "S": 29}),
        (("qwen3_next", "ulysses", "gdn_ulysses", 2), {}),
        (("qwen3_next", "colossal", "gdn_ulysses", 2), {"kinds": ("padding", "packed"), "S": 29}),
        (("lfm2", "colossal", "gather", 2), {"S": 29}),
        (("lfm2", "ulysses", "halo", 2), {}),
        (("lfm2", "colossal", "halo", 2), {"S": 29, "proof": False}),
        (("falcon_h1", "colossal", "gather", 2), {}),
        (("falcon_h1", "ulysses", "gather", 2), {"kinds": ("padding", "packed"), "S": 29}),
    ]
    pool = ranks(2)
    _check(pool.run(mixer_cases, cases, timeout=600.0))
    for res in pool.run(broken_halo_case, timeout=300.0):     # the checks above can fail
        print("broken halo (negative control):", res["step"], res["refused"][:300])
        assert res["step"]["logits_rel"] > 10 * TOL and res["step"]["grads"] > 10 * TOL, res
        assert res["refused"].startswith("CPConfigError: [plan_overrides[1].inner_wrapper]"), res["refused"]
        assert "'model.layers.0.conv' (Lfm2ShortConv), covered by plan_overrides[1]" in res["refused"]
        assert "declared CP method differs from the module's own computation" in res["refused"]
    print(f"wall {time.perf_counter() - t0:.1f}s")


def test_mixers_exact_cp4(ranks):
    """cp=4 (CP padding: S not a multiple of 4): Colossal and Hybrid (u=2) attention."""
    t0 = time.perf_counter()
    cases = [
        (("qwen3_next", "hybrid", "gather", 4), {"kinds": ("padding", "packed"), "S": 34}),
        (("qwen3_next_h4", "hybrid", "gdn_ulysses", 4), {"kinds": ("padding", "packed"), "S": 34}),
        (("lfm2", "colossal", "halo", 4), {"kinds": ("plain", "packed"), "S": 34}),
        (("lfm2", "hybrid", "gather", 4), {"kinds": ("padding",), "S": 34, "proof": False}),
        (("falcon_h1", "colossal", "gather", 4), {"kinds": ("padding", "packed"), "S": 34}),
    ]
    _check(ranks(4).run(mixer_cases, cases, timeout=600.0))
    print(f"wall {time.perf_counter() - t0:.1f}s")


def dropped_state_case(arch: str, mixer: str) -> dict:
    """Negative control: the state-passing method with the incoming state dropped (the exchange still
    runs, so backward stays symmetric) must be visibly wrong on a plain batch (one document spanning
    both ranks)."""
    from hyper_parallel.distributed.context_parallel.mixers import state_passing as mixers

    real = mixers.exchange_states

    def dropped(*a, **kw):
        anchor, s_in = real(*a, **kw)
        return anchor, None if s_in is None else s_in * 0

    mixers.exchange_states = dropped
    try:
        return mixer_case(arch, "colossal", mixer, 2, kinds=("plain",), S=30, proof=False)
    finally:
        mixers.exchange_states = real


def test_gated_deltanet_state_passing_exact(ranks):
    """Gated DeltaNet state passing (the incoming recurrent state composed from every earlier rank's
    affine map; conv halo): cp 2 and cp 4, plain / padded / packed rows whose documents cross one or
    several rank edges, with Ulysses / Colossal / Hybrid attention. At cp 4 the model has 2 linear key
    heads (Ulysses over linear heads is refused there; state passing has no head rule)."""
    t0 = time.perf_counter()
    _check(ranks(2).run(mixer_cases, [
        (("qwen3_next", "ulysses", "gdn_sp", 2), {}),
        (("qwen3_next", "colossal", "gdn_sp_target", 2), {"kinds": ("padding", "packed"), "S": 29}),
    ], timeout=600.0))
    _check(ranks(4).run(mixer_cases, [
        (("qwen3_next", "colossal", "gdn_sp", 4), {"kinds": ("plain", "padding", "packed"), "S": 34}),
        (("qwen3_next_h4", "hybrid", "gdn_sp", 4), {"kinds": ("packed",), "S": 45, "proof": False}),
    ], timeout=600.0))
    for arch, mixer in (("qwen3_next", "gdn_sp"), ("falcon_h1", "m2_sp")):   # the checks above can fail
        for res in ranks(2).run(dropped_state_case, arch, mixer, timeout=300.0):
            step = res["steps"][0]
            print(f"{arch} {mixer} with the incoming state dropped (negative control): logits rel "
                  f"{step['logits_rel']:.2e}, grads {step['grads']:.2e}")
            assert step["logits_rel"] > 10 * TOL or step["grads"] > 10 * TOL, step
    print(f"wall {time.perf_counter() - t0:.1f}s")


def test_mamba2_state_passing_exact(ranks):
    """Mamba2 state passing on Falcon-H1 (scalar decay per head: the incoming SSM state's
    contribution is one einsum; conv halo): cp 2 and cp 4, plain / padded / packed rows whose
    documents cross rank edges, several scan chunks per rank (chunk 16), gated RMS norm variant."""
    t0 = time.perf_counter()
    _check(ranks(2).run(mixer_cases, [
        (("falcon_h1", "ulysses", "m2_sp", 2), {"S": 45}),
        (("falcon_h1_rms", "colossal", "m2_sp", 2), {"kinds": ("packed",), "S": 70}),
    ], timeout=600.0))
    _check(ranks(4).run(mixer_cases, [
        (("falcon_h1", "colossal", "m2_sp", 4), {"kinds": ("plain", "padding", "packed"), "S": 66}),
    ], timeout=600.0))
    print(f"wall {time.perf_counter() - t0:.1f}s")


def test_mamba2_state_passing_families_exact(ranks):
    """The same method on the other transformers Mamba2 mixers (Bamba, NemotronH, Granite 4, Zamba2:
    ``in_proj`` -> conv -> scan -> gated group RMS norm -> ``out_proj``; 4 heads in 2 SSM groups,
    chunk 16): cp 2 with plain / padded / packed rows for each, cp 4 for Bamba, and the incoming
    state dropped (negative control) visibly wrong."""
    t0 = time.perf_counter()
    _check(ranks(2).run(mixer_cases, [
        # proof_tol: the proof's worst checkpoint is a layer update compared with the residual
        # stream the (scaled-up) mixer made large: fp32 rounding of the stream (1.1e-5 .. 2.3e-5)
        (("bamba", "colossal", "m2_sp", 2), {"S": 45, "proof_tol": 5e-5}),
        (("nemotron_h", "ulysses", "m2_sp", 2), {"S": 45, "proof_tol": 5e-5}),
        (("granitemoehybrid", "colossal", "m2_sp", 2), {"S": 45, "proof_tol": 5e-5}),
        (("zamba2", "colossal", "m2_sp", 2), {"S": 45}),
    ], timeout=600.0))
    _check(ranks(4).run(mixer_cases, [
        (("bamba", "colossal", "m2_sp", 4), {"kinds": ("plain", "padding", "packed"), "S": 66, "proof": False}),
    ], timeout=600.0))
    for res in ranks(2).run(dropped_state_case, "nemotron_h", "m2_sp", timeout=300.0):
        step = res["steps"][0]
        print(f"nemotron_h m2_sp with the incoming state dropped (negative control): logits rel "
              f"{step['logits_rel']:.2e}, grads {step['grads']:.2e}")
        assert step["logits_rel"] > 10 * TOL or step["grads"] > 10 * TOL, step
    print(f"wall {time.perf_counter() - t0:.1f}s")

# ---------------------------------------------------------------------------- refusals (plan time, local)
def _plan(arch: str, plan_overrides: list, cp: int = 2):
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    return ShardingPlanner(plan_overrides=plan_overrides).plan(build_model(arch), None, cp_size=cp)


def test_head_tail_with_mixer_method_is_planned():
    """Head-Tail keeps the contiguous layout at the module boundary, so a mixer method runs next to it
    unchanged (parity: tests/cp/test_mixers_balanced.py)."""
    plan = _plan("qwen3_next", entries("qwen3_next", "head_tail", "gather"))
    assert plan.batch_policy == "load_balance", plan.batch_policy
    assert [t.inner_fqn for t in plan.cp_targets if t.info.mixer] == ["model.layers.0.linear_attn"]


def test_mixer_declaration_mistakes_are_refused():
    from hyper_parallel.distributed.errors import CPConfigError

    base = {"when": "cp", "region_dispatch": False, "inner_target": "self"}
    attn = {**base, "match": "*.self_attn", "inner_wrapper": "sdpa_hf"}
    # '*.conv' also matches LFM2's inner nn.Conv1d 'conv.conv'
    with pytest.raises(CPConfigError, match=r"declared on a torch\.nn layer \(Conv1d\).*'\*\[0-9\]\.conv'"):
        _plan("lfm2", [attn, {**base, "match": "*.conv", "inner_wrapper": "sequence_gather"}])
    # the halo method is exact only for LFM2's short conv
    with pytest.raises(CPConfigError, match=r"short_conv_halo_cp_wrapper is exact only for .*"
                                            r"Qwen3NextGatedDeltaNet is not one of them"):
        _plan("qwen3_next", [attn, {**base, "match": "*.linear_attn", "inner_wrapper": "short_conv_halo"}])
    # Gated DeltaNet Ulysses: linear heads (2 key heads) must divide cp
    with pytest.raises(CPConfigError, match=r"linear_num_key_heads=2, linear_num_value_heads=4 \(both must be "
                                            r"divisible by cp_size\)"):
        _plan("qwen3_next", entries("qwen3_next", "colossal", "gdn_ulysses"), cp=4)
    with pytest.raises(CPConfigError, match=r"gated_deltanet_ulysses_cp_wrapper re-runs the forward of "
                                            r"Qwen3NextGatedDeltaNet.*FalconH1Mixer is not one"):
        _plan("falcon_h1", [attn, {**base, "match": "*.mamba", "inner_wrapper": "gated_deltanet_ulysses"}])
    # a mixer method around a declared attention (the whole decoder layer)
    with pytest.raises(CPConfigError, match=r"'model.layers.1.self_attn' is inside 'model.layers.1'"):
        _plan("lfm2", [attn, {**base, "match": "model.layers.1", "inner_wrapper": "sequence_gather"}])
    # without a mixer method the mixer module is still not an attention boundary
    with pytest.raises(CPConfigError, match=r"is not an attention boundary.*declare a mixer method"):
        _plan("falcon_h1", [attn, {**base, "match": "*.mamba", "inner_wrapper": "sdpa_hf"}])
    plan = _plan("falcon_h1", entries("falcon_h1", "colossal", "gather"))
    assert plan.batch_policy == "all_gather" and len(plan.cp_targets) == 4
    assert plan.attention_boundaries == ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def test_mamba2_state_passing_refusals():
    """The method is refused, naming the class and the field, on a mixer it does not cover or a
    layout the family's lines would not reproduce."""
    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    def plan(model, arch):
        return ShardingPlanner(plan_overrides=entries(arch, "colossal", "m2_sp")).plan(model, None, cp_size=2)

    plan(build_mamba2_family("bamba"), "bamba")         # accepted as built
    model = build_mamba2_family("bamba")
    model.model.layers[0].mamba.n_groups = 3
    with pytest.raises(CPConfigError, match=r"BambaMixer\.n_groups = 3 does not divide num_heads = 4"):
        plan(model, "bamba")
    model = build_mamba2_family("zamba2")
    model.model.layers[0].mamba.norm.group_size = 48
    with pytest.raises(CPConfigError, match=r"Zamba2MambaMixer\.norm is not a gated RMS norm"):
        plan(model, "zamba2")
    with pytest.raises(CPConfigError, match=r"mamba2_state_passing_cp_wrapper re-runs the forward of FalconH1Mixer, "
                                            r"BambaMixer.*Lfm2ShortConv is not one of them"):
        _plan("lfm2", entries("lfm2", "colossal", "m2_sp"))

# ---------------------------------------------------------------------------- trainer (YAML-level)
def test_trainer_lfm2_declared_mixer_same_losses_as_cp1(ranks, tmp_path):
    """The trainer (preflight proof on by default) builds LFM2 with the attention and the short
    conv declared, and its losses equal the same config at cp_size 1, step for step."""
    from tests.cp.test_model_proof import LFM2_TINY
    from tests.trainer import _workers as TW

    cfg = TW.make_cfg("llama", cp=2, steps=3, out_dir=str(tmp_path / "cp2"))
    cfg["model"] = {"architecture": "lfm2", "config": dict(LFM2_TINY), "seed": 0}
    cfg["plan_overrides"].append({"match": "*[0-9].conv", "when": "cp", "region_dispatch": False,
                                  "inner_target": "self", "inner_wrapper": "short_conv_halo"})
    one = dict(cfg, accelerator=dict(cfg["accelerator"], cp_size=1),
               logging=dict(cfg["logging"], out_dir=str(tmp_path / "cp1")))
    cp2 = ranks(2).run(TW.train_losses, cfg, timeout=300.0)
    cp1 = ranks(1).run(TW.train_losses, one, timeout=300.0)[0]["losses"]
    print("cp1", cp1, "cp2", cp2[0]["losses"])
    assert cp2[0]["losses"] == cp2[1]["losses"] and len(cp1) == 3
    for a, b in zip(cp1, cp2[0]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (cp1, cp2[0]["losses"])
