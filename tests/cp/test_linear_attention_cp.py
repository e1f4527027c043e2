"""Exact CP for the linear-attention / recurrent mixers of Kimi Linear (KDA, ``kda_state_passing``),
MiniMax (lightning attention, ``lightning_state_passing``), Jamba and Falcon-Mamba (Mamba1,
``mamba1_state_passing``), RecurrentGemma (RG-LRU, ``rglru_state_passing``): the recurrent state
passed between ranks through the same affine-state composition as the Gated DeltaNet's. Real
transformers classes, tiny random configs (tests/cp/linear_attention_models.py), train(), dropout
0, fp32; the softmax attention declared with Colossal / Ulysses / Hybrid (Head-Tail is refused next
to a mixer method); logits and EVERY gradient vs CP=1 for plain, padded and packed rows, the
preflight proof passing (tests/cp/test_mixer_cp.py helpers and tolerance); the incoming state
dropped is visibly wrong (negative control)."""
from __future__ import annotations

import time

import pytest

from tests.cp.test_mixer_cp import TOL, _check, dropped_state_case, mixer_cases


@pytest.mark.parametrize("arch,mixer,attn2", [("kimi_linear", "kda_sp", "ulysses"),
                                              ("minimax", "lightning_sp", "ulysses"),
                                              ("jamba", "m1_sp", "ulysses"),
                                              ("falcon_mamba", "m1_sp", "colossal"),
                                              ("recurrent_gemma", "rglru_sp", "ulysses")])
def test_linear_attention_state_passing_exact_cp2(ranks, arch, mixer, attn2):
    """cp 2: Colossal attention on plain / padded / packed rows (S=45: documents cross the rank edge,
    MiniMax runs several lightning blocks per rank), Ulysses on padded / packed (Falcon-Mamba has no
    attention); the incoming state dropped must be visibly wrong."""
    t0 = time.perf_counter()
    pool = ranks(2)
    _check(pool.run(mixer_cases, [
        ((arch, "colossal", mixer, 2), {"S": 45}),
        ((arch, attn2, mixer, 2), {"kinds": ("padding", "packed"), "S": 37}),
    ], timeout=600.0))
    for res in pool.run(dropped_state_case, arch, mixer, timeout=300.0):
        step = res["steps"][0]
        print(f"{arch} {mixer} with the incoming state dropped (negative control): logits rel "
              f"{step['logits_rel']:.2e}, grads {step['grads']:.2e}")
        assert step["logits_rel"] > 10 * TOL or step["grads"] > 10 * TOL, step
    print(f"wall {time.perf_counter() - t0:.1f}s")


def test_linear_attention_state_passing_exact_cp4(ranks):
    """cp 4 (CP padding, S=66): plain rows and packed documents spanning up to four ranks, so the
    incoming state is composed through the affine maps of several earlier ranks; Hybrid (u=2) and
    Colossal attention."""
    t0 = time.perf_counter()
    _check(ranks(4).run(mixer_cases, [
        (("kimi_linear", "hybrid", "kda_sp", 4), {"kinds": ("plain", "packed"), "S": 66, "proof": False}),
        (("minimax", "colossal", "lightning_sp", 4), {"kinds": ("plain", "packed"), "S": 66, "proof": False}),
    ], timeout=600.0))
    print(f"wall {time.perf_counter() - t0:.1f}s")


# ---------------------------------------------------------------------------- refusals (plan time, local)
@pytest.mark.parametrize("arch,mixer,other", [("kimi_linear", "kda_sp", "lightning_state_passing"),
                                              ("minimax", "lightning_sp", "kda_state_passing")])
def test_linear_attention_refusals(arch, mixer, other):
    """Head-Tail with a state-passing mixer is planned (contiguous at the module boundary). Refused
    before any step, each message naming the module, the semantic and what to declare: the other family's method on this
    class; the softmax wrapper on the linear-attention module (both families name it ``self_attn``);
    the linear-attention module left undeclared."""
    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.cp.test_mixer_cp import build, entries

    cls = {"kimi_linear": "KimiLinearDeltaAttention", "minimax": "MiniMaxLightningAttention"}[arch]
    own = {"kda_sp": "kda_state_passing", "lightning_sp": "lightning_state_passing"}[mixer]
    base = {"when": "cp", "region_dispatch": False, "inner_target": "self"}
    attn = {**base, "match": "model.layers.1.self_attn", "inner_wrapper": "sdpa_hf"}

    def plan(overrides):
        return ShardingPlanner(plan_overrides=overrides).plan(build(arch), None, cp_size=2)

    ok = plan(entries(arch, "colossal", mixer))
    assert [t.inner_fqn for t in ok.cp_targets if t.info.mixer] == ["model.layers.0.self_attn"]
    ht = plan(entries(arch, "head_tail", mixer))      # Head-Tail keeps the contiguous layout at the boundary
    assert ht.batch_policy == "load_balance" and [t.inner_fqn for t in ht.cp_targets if t.info.mixer] == [
        "model.layers.0.self_attn"]
    with pytest.raises(CPConfigError, match=rf"'model.layers.0.self_attn'.*{other}_cp_wrapper re-runs the forward "
                                            rf"of .*; {cls} is not one of them"):
        plan([attn, {**base, "match": "model.layers.0.self_attn", "inner_wrapper": other}])
    for overrides in ([{**attn, "match": "*.self_attn"}], [attn]):
        with pytest.raises(CPConfigError) as err:
            plan(overrides)
        msg = str(err.value)
        print(msg)
        assert "'model.layers.0.self_attn'" in msg, msg
        assert f"if {cls} is a token mixer" in msg or f"({cls}) is a token mixer" in msg, msg
        assert f"sequence_gather | {own}" in msg, msg


def test_recurrent_state_passing_refusals():
    """Mamba1 / RG-LRU state passing refused, naming the method and the class, on a mixer whose
    forward they do not re-run (Falcon-H1's Mamba2, Jamba's Mamba1 for RG-LRU); accepted as built."""
    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.distributed.plan.planner import ShardingPlanner
    from tests.cp.test_mixer_cp import build, entries

    def plan(arch, mixer, model_arch=None):
        return ShardingPlanner(plan_overrides=entries(arch, "colossal", mixer)).plan(
            build(model_arch or arch), None, cp_size=2)

    assert plan("jamba", "m1_sp").batch_policy == "all_gather"
    assert plan("recurrent_gemma", "rglru_sp").batch_policy == "all_gather"
    with pytest.raises(CPConfigError, match=r"mamba1_state_passing_cp_wrapper re-runs the forward of JambaMambaMixer, "
                                            r"FalconMambaMixer .*FalconH1Mixer is not one of them"):
        plan("falcon_h1", "m1_sp")
    with pytest.raises(CPConfigError, match=r"rglru_state_passing_cp_wrapper re-runs the forward of "
                                            r"RecurrentGemmaRecurrentBlock .*JambaMambaMixer is not one of them"):
        plan("jamba", "rglru_sp")
