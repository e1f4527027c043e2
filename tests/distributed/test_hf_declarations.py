"""What transformers declares drives the sharding: decoder layers from ``_no_split_modules``,
the TP plan from ``base_model_tp_plan``.

Tolerances (fp32): logits max |CP - CP=1| <= 1e-5; gradients max |g_cp - g_cp1| over parameters
<= 1e-5 x the reference's largest |g|. Every parity check prints max abs / rel next to them.
"""
import os

import pytest

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.distributed.plan.planner import ShardingPlanner
from hyper_parallel.distributed.tensor_parallel import check_tp_plan, find_decoder_layers, get_tp_plan
from hyper_parallel.distributed.tp_plan_translation import translate_tp_plan

from . import _workers as W

LOGIT_TOL = 1e-5
GRAD_TOL = 1e-5
SIX = ("gpt_neox", "falcon", "bloom", "gpt2", "opt", "mpt")
# Refused before any step, by name: Bloom by the sdpa_hf wrapper's check (ALiBi); MPT (ALiBi in a
# hand-written eager attention that neither calls SDPA nor transformers' attention interface) by the
# wrapper's probe forward at planning (it finds that the wrapper would never run; the CP preflight
# proof refused it at apply before the probe could size a module without a head_dim of its own).
REFUSED = {"bloom": ("transformer.h.0.self_attention", "uses ALiBi"),
           "mpt": ("transformer.blocks.0.attn", "misfire")}      # the plan's probe (its own matmuls)


def check(results):
    for r in results:
        assert "refused" not in r, r["refused"]
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].rsplit("::", 1)[-1]
    print(f"{test} logits: max abs {max(r['logits'] for r in results):.2e} "
          f"rel {max(r['logits_rel'] for r in results):.2e} (tol abs {LOGIT_TOL:g}); "
          f"grads: max abs {max(r['grads_abs'] for r in results):.2e} "
          f"rel {max(r['grads'] for r in results):.2e} (tol rel {GRAD_TOL:g})")
    for r in results:
        assert r["logits"] <= LOGIT_TOL, r
        assert r["grads"] <= GRAD_TOL, r
    return results[0]


# ------------------------------------------------------------------------ (a) decoder layers
@pytest.mark.parametrize("arch", SIX + ("llama",))
def test_decoder_layers_from_no_split_modules(arch):
    model, _ = W.build(arch)
    want_cls = W.ARCHS[arch][1]
    assert want_cls in model._no_split_modules
    layers = find_decoder_layers(model)
    assert len(layers) == 2, layers          # every tiny config has 2 layers
    assert [type(model.get_submodule(f)).__name__ for f in layers] == [want_cls] * len(layers), layers
    want = [n for n, m in model.named_modules() if type(m).__name__ == want_cls]
    assert layers == want


def test_decoder_layers_fallback_without_declaration():
    """A model that declares nothing keeps the layer-list heuristic."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = nn.Linear(4, 4)

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

    assert find_decoder_layers(Toy()) == ["layers.0", "layers.1"]


# ------------------------------------------------------------------------ translation (local)
def test_declared_plans_translate():
    """Llama: the dense decoder table; Gemma3: + q_norm/k_norm replicated_with_grad_allreduce;
    Qwen3-MoE: attention + the dense layer's MLP, the experts replicated (exact); GPT-NeoX: fused
    QKV colwise; embeddings / lm_head replicated."""
    model, _ = W.build("llama")
    assert get_tp_plan(model) == {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                                  "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
                                  "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
    model, _ = W.build("gemma3")
    plan = get_tp_plan(model)
    assert plan["self_attn.q_norm"] == plan["self_attn.k_norm"] == "replicated_with_grad_allreduce"
    model, _ = W.build("qwen3_moe")
    tr = translate_tp_plan(model, find_decoder_layers(model))
    assert tr.plan["mlp.gate_proj"] == "colwise" and not any("experts" in k for k in tr.plan), tr.plan
    assert {"model.layers.0.mlp.experts", "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj"} <= set(tr.replicated), tr.replicated
    assert tr.replicated["model.layers.0.mlp.experts"][0] == "moe_tp_experts"
    assert "lm_head" in tr.replicated and "model.embed_tokens" in tr.replicated
    check_tp_plan(model, find_decoder_layers(model), tr.plan, 2)   # mlp.gate_proj only in layer 1: fine
    model, _ = W.build("gpt_neox")
    assert get_tp_plan(model)["attention.query_key_value"] == "colwise"


def test_registered_plan_overrides_declaration(monkeypatch):
    from hyper_parallel.distributed import tensor_parallel

    model, _ = W.build("llama")
    monkeypatch.setitem(tensor_parallel._TP_PLANS, "llama", {"self_attn.o_proj": "rowwise"})
    assert get_tp_plan(model) == {"self_attn.o_proj": "rowwise"}


# ------------------------------------------------------------------------ (d) refused styles
@pytest.mark.parametrize("key,style,module,why", [
    ("layers.*.input_layernorm", "sequence_parallel", "model.layers.0.input_layernorm", "CP already shards"),
    ("layers.*.self_attn.q_proj", "colwise_rep", "model.layers.0.self_attn.q_proj", "only ["),
    ("layers.*.post_attention_layernorm", "colwise", "model.layers.0.post_attention_layernorm",
     "only plain nn.Linear"),
    ("norm", "sequence_parallel", "model.norm", "CP already shards"),
])
def test_refused_style_names_style_and_module(key, style, module, why):
    import transformers as T

    cfg, _ = W.config("llama")
    cfg.base_model_tp_plan = {**cfg.base_model_tp_plan, key: style}
    model = T.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(CPConfigError) as ei:
        ShardingPlanner().plan(model, tp_size=2, cp_size=1)
    msg = str(ei.value)
    assert f"'{style}'" in msg and f"module '{module}'" in msg and why in msg, msg
    assert msg.startswith("[accelerator.tp_size]") and "Fix:" in msg, msg


# ------------------------------------------------------------------------ (b) FSDP2 + AC + CP 2
@pytest.mark.parametrize("arch", SIX)
def test_fsdp_ac_cp2_parity(ranks, arch):
    """FSDP2 on the declared layers + activation checkpointing + CP 2 (sdpa_hf, Colossal, preflight
    proof on) equals CP=1 for GPT-NeoX, Falcon, GPT-2 and OPT; Bloom and MPT are refused by name."""
    res = ranks(2).run(W.fsdp_ac_parity, arch)
    if arch in REFUSED:
        for r in res:
            assert "refused" in r and all(f in r["refused"] for f in REFUSED[arch]), r
        print(f"{arch}: refused at preflight: {res[0]['refused'][:300]}")
        return
    r = check(res)
    n = len(r["layers"])
    # a unit per decoder layer, the root, and an untied embedding and head each their own
    assert n == 2 and r["ac_layers"] == n and r["fsdp_modules"] == n + 1 + 2 * r["untied"], r
    assert r["fsdp_embeddings"] == [r["untied"]] * 2, r


# ------------------------------------------------------------------------ (c) TP 2 x CP 2
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe", "gpt_neox"])
def test_tp2_cp2_declared_plan_parity(ranks, arch):
    """TP 2 from the declared plan x CP 2 (Colossal) + FSDP2 + AC on 4 ranks equals CP=1. Qwen3-MoE:
    attention TP in both layers, the dense MLP of layer 1 TP, layer 0's experts replicated;
    GPT-NeoX: the fused (per-head interleaved) query_key_value split colwise."""
    r = check(ranks(4).run(W.fsdp_ac_parity, arch, 2, 2))
    sharded = r["sharded"]
    if arch == "gpt_neox":
        assert "gpt_neox.layers.0.attention.query_key_value.weight" in sharded, sharded
        assert "gpt_neox.layers.1.mlp.dense_4h_to_h.weight" in sharded, sharded
        assert r["local_heads"] == [(2, 2), (2, 2)], r["local_heads"]       # 4 heads / tp 2, fused QKV
        return
    assert "model.layers.0.self_attn.q_proj.weight" in sharded and "model.layers.1.self_attn.o_proj.weight" in sharded
    if arch == "qwen3_moe":
        assert "model.layers.1.mlp.gate_proj.weight" in sharded and not any("experts" in s for s in sharded), sharded
    if arch in ("gemma3", "qwen3_moe"):
        assert "model.layers.0.self_attn.q_norm.weight" in r["partial"], r["partial"]


@pytest.mark.parametrize("arch", SIX)
def test_fsdp_ac_dp2_without_cp(ranks, arch):
    """FSDP2 (2 data-parallel ranks, one row each) on the declared layers + activation checkpointing
    equals one process on both rows, for all six, including Bloom and MPT whose attention CP refuses."""
    r = check(ranks(2).run(W.fsdp_ac_dp2, arch))
    assert len(r["layers"]) == 2 and r["ac_layers"] == 2 and r["fsdp_modules"] == 3 + 2 * r["untied"], r


def test_tp2_cp2_ulysses_on_tp_local_heads(ranks):
    """GPT-NeoX: Ulysses (sdpa_hf_ulysses) splits the TP-local heads (4 -> 2 per tp rank -> 1 per cp
    rank); the local count comes from the fused colwise query_key_value."""
    r = check(ranks(4).run(W.fsdp_ac_parity, "gpt_neox", 2, 2, wrapper="sdpa_hf_ulysses"))
    assert r["policy"] == "ulysses", r
