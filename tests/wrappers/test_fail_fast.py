"""Declarations that must fail before any step (resolution / planning), with clear messages,
plus the runtime guards of the interception (misfire, double call, threads, re-entrancy)."""
import threading

import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.distributed.context_parallel import inner_wrapper
from hyper_parallel.distributed.context_parallel.interception import CPInterceptionError, intercept_sdpa
from hyper_parallel.distributed.context_parallel.model_spec import (register_cp_model_spec,
                                                                    unregister_cp_model_spec)
from hyper_parallel.distributed.context_parallel.registry import get_registered, registered_names
from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.distributed.plan.applier import apply_sharding_plan
from hyper_parallel.distributed.plan.spec import ModuleShardingSpec
from hyper_parallel.distributed.plan.planner import ShardingPlanner

from . import _models, _workers as W

WR = "hyper_parallel.distributed.context_parallel.wrappers."


def entry(wrapper, inner_target="self", match="*.self_attn", **extra):
    e = {"match": match, "when": "cp", "region_dispatch": False, "inner_target": inner_target,
         "inner_wrapper": wrapper}
    e.update(extra)
    return e


@pytest.fixture(scope="module")
def cfg():
    return _models.load_cfg("examples/cp/colossal.yaml")


@pytest.fixture(scope="module")
def llama(cfg):
    return _models.build_hf(cfg.model)


@pytest.fixture(scope="module")
def llama_flex(cfg):
    return _models.build_hf(cfg.model, "flex_attention")


@pytest.fixture(scope="module")
def llama_kv4():
    return _models.build_hf(_models.load_cfg("examples/cp/colossal.yaml", ("model.config.num_key_value_heads=4",)).model)


def plan(model, overrides, cp=2, **kw):
    return ShardingPlanner(plan_overrides=overrides).plan(model, None, cp_size=cp, **kw)


def raises(model, overrides, cp=2, field=None, module=None, fragments=(), **kw):
    with pytest.raises(CPConfigError) as ei:
        plan(model, overrides, cp, **kw)
    err = ei.value
    if field is not None:
        assert err.field == field, str(err)
    if module is not None:
        assert err.module == module, str(err)
    for f in fragments:
        assert f in str(err), str(err)
    return err


# ---------------------------------------------------------------- registry
def test_builtin_names_and_targets():
    names = {"sdpa_hf", "sdpa_qkv", "sdpa_hf_ulysses", "sdpa_qkv_ulysses", "flex_hf", "flex_qkv",
             "flex_hf_ulysses", "flex_qkv_ulysses"}
    assert names <= set(registered_names())
    from hyper_parallel.distributed.context_parallel import wrappers
    from hyper_parallel.distributed.context_parallel.registry import wrapper_info

    methods = {}
    for fn in ("sdpa_hf_cp_wrapper", "sdpa_hf_ulysses_cp_wrapper", "sdpa_hf_hybrid_cp_wrapper",
               "sdpa_hf_load_balance_cp_wrapper", "sdpa_qkv_cp_wrapper", "sdpa_qkv_ulysses_cp_wrapper",
               "sdpa_qkv_hybrid_cp_wrapper", "sdpa_qkv_load_balance_cp_wrapper"):
        info = wrapper_info(getattr(wrappers, fn))
        assert info is not None and info.validate is not None and not info.is_async
        methods[fn] = (info.method, info.style, info.named_params)
    assert methods["sdpa_hf_hybrid_cp_wrapper"] == ("hybrid", "hf", ("ulysses_degree",))
    assert methods["sdpa_qkv_load_balance_cp_wrapper"] == ("load_balance", "qkv", ())
    assert get_registered("sdpa_hf") is wrappers.sdpa_hf_cp_wrapper


def test_mapping_form_of_design_3_2(llama):
    p = plan(llama, {"model.layers.*.self_attn": ModuleShardingSpec(inner_target="self", inner_wrapper="sdpa_hf",
                                                                    region_dispatch=False)})
    assert sorted(p.module_specs) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert p.batch_policy == "all_gather" and p.decoder_layers == ["model.layers.0", "model.layers.1"]
    assert "sdpa_hf [colossal, sync]" in p.summary()


def test_cp1_skips_when_cp_entries(llama):
    p = plan(llama, [entry("sdpa_hf")], cp=1)
    assert p.cp_targets == [] and p.batch_policy is None and len(p.resolved.skipped) == 1
    model, info = apply_sharding_plan(_models.build_hf(_models.load_cfg("examples/cp/colossal.yaml").model), p)
    assert all("forward" not in l.self_attn.__dict__ for l in model.model.layers)
    assert not info.sharded and len(info) == len(list(model.parameters()))


# ---------------------------------------------------------------- misfire / double / style
def test_misfire_fails_at_resolution():
    model = _models.ToyModel(_models.NoSDPAAttention)
    raises(model, [entry("sdpa_hf")], field="plan_overrides[0].inner_wrapper", module="layers.0.self_attn",
           fragments=("made no torch.nn.functional.scaled_dot_product_attention call", "misfire"))


def test_double_interception_fails_at_resolution():
    model = _models.ToyModel(_models.TwoSDPAAttention)
    raises(model, [entry("sdpa_hf")], module="layers.0.self_attn", fragments=("made 2", "double interception"))


def test_wrong_inner_target(llama):
    raises(llama, [entry("sdpa_hf", inner_target="q_proj")], field="plan_overrides[0].inner_wrapper",
           module="model.layers.0.self_attn", fragments=("has no 'hidden_states' parameter",))
    raises(llama, [entry("sdpa_hf", inner_target="core_attention")], field="plan_overrides[0].inner_target",
           fragments=("no submodule 'core_attention'",))


def test_wrapper_on_non_attention_module(llama):
    raises(llama, [entry("sdpa_hf", match="*.mlp")], field="plan_overrides[0].match",
           module="model.layers.0.mlp", fragments=("not an attention boundary",))


def test_qkv_wrapper_on_hf_forward(llama):
    raises(llama, [entry("sdpa_qkv")], module="model.layers.0.self_attn",
           fragments=("does not start with (q, k, v)", "*_hf wrapper"))


def test_flex_on_sdpa_model_and_sdpa_on_flex_model(llama, llama_flex):
    raises(llama, [entry("flex_hf")], field="plan_overrides[0].inner_wrapper",
           fragments=("need attn_implementation='flex_attention'", "uses attn_implementation='sdpa'",
                      "sdpa_hf* wrapper"))
    raises(llama, [entry("flex_hf_ulysses")], fragments=("attn_implementation='flex_attention'",))
    raises(llama_flex, [entry({"_target_": WR + "sdpa_hf_cp_wrapper"})],
           fragments=("need attn_implementation='sdpa'", "flex_hf* wrapper"))


def test_eager_model_goes_through_the_attention_interface(cfg):
    """An eager HF attention module calls transformers' attention interface: the sdpa_hf* wrappers
    route it there (transformers refuses SDPA for softcap/sinks models); flex stays flex_hf*."""
    eager = _models.build_hf(cfg.model, "eager")
    assert len(plan(eager, [entry("sdpa_hf")]).cp_targets) == 2
    raises(eager, [entry("flex_hf")], fragments=("uses attn_implementation='eager'",))


def test_attention_dropout_rejected():
    m = _models.build_hf(_models.load_cfg("examples/cp/colossal.yaml", ("model.config.attention_dropout=0.1",)).model)
    raises(m, [entry("sdpa_hf")], fragments=("attention_dropout=0.1",))


# ---------------------------------------------------------------- heads / degrees / combinations
def test_ulysses_head_divisibility(llama, llama_kv4):
    """4 q / 2 kv heads: cp 4 replicates the KV heads (accepted); cp 8 leaves a rank without a query head."""
    plan(llama, [entry("sdpa_hf_ulysses")], cp=4)         # KV heads fewer than the degree: replicated
    raises(llama, [entry("sdpa_hf_ulysses")], cp=8, field="plan_overrides[0].inner_wrapper",
           fragments=("num_q_heads=4 < cp_size (ulysses_degree)=8", "at least one query head"))
    plan(llama_kv4, [entry("sdpa_hf_ulysses")], cp=4)     # 4 q / 4 kv heads: fine


def test_ulysses_heads_checked_per_tp_rank(llama):
    """tp 2 leaves 2 q / 1 kv heads per rank: Ulysses cp 2 replicates the KV head, cp 4 is rejected."""
    plan(llama, [entry("sdpa_hf_ulysses")], cp=4)
    plan(llama, [entry("sdpa_hf_ulysses")], cp=2, tp_size=2)
    raises(llama, [entry("sdpa_hf_ulysses")], cp=4, tp_size=2, fragments=("num_q_heads=2 < cp_size", "tp_size=2"))


@pytest.mark.parametrize("degree,fragment", [(4, "1 < ulysses_degree < cp_size"), (3, "1 < ulysses_degree"),
                                             ("2", "must be an integer")])
def test_hybrid_degree(llama, degree, fragment):
    raises(llama, [entry({"_target_": WR + "sdpa_hf_hybrid_cp_wrapper", "ulysses_degree": degree})], cp=4,
           fragments=(fragment,))


def test_hybrid_requires_degree(llama):
    raises(llama, [entry({"_target_": WR + "sdpa_hf_hybrid_cp_wrapper"})], cp=4,
           field="plan_overrides[0].inner_wrapper.ulysses_degree", fragments=("requires parameter(s)",))


def test_ulysses_plus_head_tail_rejected(llama):
    err = raises(llama, [entry({"_target_": WR + "sdpa_hf_load_balance_cp_wrapper"}, match="*.0.self_attn"),
                         entry("sdpa_hf_ulysses", match="*.1.self_attn")],
                 fragments=("Head-Tail load balance cannot be combined with Ulysses",))
    assert err.module == "model.layers.0.self_attn"
    raises(llama, [entry({"_target_": WR + "sdpa_hf_ulysses_cp_wrapper", "load_balance": True})],
           field="plan_overrides[0].inner_wrapper.load_balance", fragments=("has no parameter(s)",))
    raises(llama, [entry({"_target_": WR + "sdpa_hf_load_balance_cp_wrapper"}, match="*.0.self_attn"),
                   entry("sdpa_hf", match="*.1.self_attn")], fragments=("cannot be mixed",))


@inner_wrapper(method="colossal", style="hf", is_async=True)
def async_without_adapter(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    return None


@inner_wrapper(method="colossal", style="hf", is_async=True, model_adapter="qwen3_moe")
def async_for_qwen3_moe(target_module, mesh, tp_mesh, cp_mesh, ep_mesh):
    return None


def test_async_needs_model_adapter(llama):
    raises(llama, [entry({"_target_": f"{__name__}.async_without_adapter"})],
           field="plan_overrides[0].inner_wrapper", fragments=("is async but declares no model_adapter",))
    raises(llama, [entry({"_target_": f"{__name__}.async_for_qwen3_moe"})],
           fragments=("async adapter for ['qwen3_moe']", "'llama'"))


def test_model_spec_restricts_wrappers(llama):
    register_cp_model_spec(architecture="llama", attention_targets=("*.self_attn",),
                           wrappers=("sdpa_hf", WR + "sdpa_hf_hybrid_cp_wrapper"))
    try:
        plan(llama, [entry("sdpa_hf")])
        plan(llama, [entry({"_target_": WR + "sdpa_hf_hybrid_cp_wrapper", "ulysses_degree": 2})], cp=4)
        raises(llama, [entry("sdpa_hf_ulysses")], field="plan_overrides[0].inner_wrapper",
               fragments=("not among the wrappers registered for architecture 'llama'",))
    finally:
        unregister_cp_model_spec("llama")


@pytest.mark.parametrize("kw,field", [({"sequence_parallel": True}, "accelerator.sequence_parallel"),
                                      ({"loss_parallel": True}, "accelerator.loss_parallel"),
                                      ({"ep_size": 2}, "accelerator.ep_size")])
def test_unsupported_topology_flags(llama, kw, field):
    raises(llama, [entry("sdpa_hf")], field=field, **kw)


def test_apply_mode_checked(llama):
    p = plan(llama, [entry("sdpa_hf")], cp=1)
    with pytest.raises(CPConfigError, match="unknown apply mode"):
        apply_sharding_plan(llama, p, None, mode="debug")


def test_multirank_fail_fast_before_any_step(ranks):
    """A bad declaration fails on every rank during planning (no forward, no hang)."""
    res = ranks(2).outcomes(W.plan_only, "examples/cp/ulysses.yaml", (), model_kind="hf",
                            plan_overrides=[entry("flex_hf")])
    assert all(isinstance(r, CPConfigError) and "flex_attention" in str(r) for r in res), res


# ---------------------------------------------------------------- interception runtime guards
def _q(S=4):
    return torch.randn(1, 2, S, 8)


def test_runtime_misfire_and_double():
    mod = torch.nn.Identity()
    with pytest.raises(CPInterceptionError, match="without calling torch.nn.functional.scaled_dot_product_attention"):
        with intercept_sdpa("m", mod, lambda call: call.q):
            torch.ones(1)
    q = _q()
    with pytest.raises(CPInterceptionError, match="second torch.nn.functional.scaled_dot_product_attention"):
        with intercept_sdpa("m", mod, lambda call: call.q):
            F.scaled_dot_product_attention(q, q, q)
            F.scaled_dot_product_attention(q, q, q)


def test_interception_is_scoped_and_reentrant():
    q = _q()
    seen = []

    def handler(call):
        seen.append(call.q.shape)
        # a handler (strategy / engine) may itself use SDPA: it must pass through untouched
        return F.scaled_dot_product_attention(call.q, call.k, call.v) * 0 + 7

    with intercept_sdpa("outer", torch.nn.Identity(), handler):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.all(out == 7) and len(seen) == 1
    ref = F.scaled_dot_product_attention(q, q, q)          # outside the scope: the real SDPA
    assert not torch.all(ref == 7)

    def outer_handler(call):
        return call.q * 0 + 1

    with intercept_sdpa("outer", torch.nn.Identity(), outer_handler):
        with intercept_sdpa("inner", torch.nn.Identity(), lambda call: call.q * 0 + 2):
            inner = F.scaled_dot_product_attention(q, q, q)
        outer = F.scaled_dot_product_attention(q, q, q)
    assert torch.all(inner == 2) and torch.all(outer == 1)


def test_interception_is_thread_local():
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def work(tag, value):
        try:
            q = _q()
            with intercept_sdpa(tag, torch.nn.Identity(), lambda call: call.q * 0 + value):
                barrier.wait(timeout=10)
                out = F.scaled_dot_product_attention(q, q, q)
                barrier.wait(timeout=10)
            results[tag] = out
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(f"t{i}", i + 3)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert torch.all(results["t0"] == 3) and torch.all(results["t1"] == 4)


def test_gqa_repeat_kv_is_unrepeated_without_copy():
    from hyper_parallel.distributed.context_parallel.interception import AttentionCall
    from hyper_parallel.distributed.context_parallel.wrappers import unrepeat_kv
    from transformers.integrations.sdpa_attention import repeat_kv

    k = torch.randn(2, 2, 6, 8)
    call = AttentionCall(q=torch.randn(2, 4, 6, 8), k=repeat_kv(k, 2), v=repeat_kv(k, 2), kv_groups=2)
    ku, _ = unrepeat_kv(call)
    assert torch.equal(ku, k) and ku.data_ptr() == call.k.data_ptr()
    call = AttentionCall(q=torch.randn(2, 4, 6, 8), k=k, v=k, kv_groups=2, enable_gqa=True)
    assert unrepeat_kv(call)[0] is k
