"""Expert parallelism beside CP (docs/expert_parallel.md): one computation at every EP size.

Real transformers MoE classes (tiny random configs, fp32, train() with dropout 0), FSDP2 on: logits
and every gradient (experts' full tensors included) against the one-rank model, relative to the
reference's largest; the trainer's losses against EP=1/CP=1; refusals before anything runs.
"""
from __future__ import annotations

import pytest
import torch.nn as nn

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.distributed.mesh import MeshConfigError, MeshSizes
from hyper_parallel.distributed.plan import ShardingPlanner
from tests.ep import _workers as W
from tests.trainer import _workers as TW

#: fp32, relative to the reference's largest value: the same math, another summation order (~3e-7 measured)
TOL = 1e-5
LOSS_RTOL = 2e-6


def _check(results, what):
    for r in results:
        print(f"{what}: logits {r['logits_abs']:.2e} abs / {r['logits_rel']:.2e} rel, grads {r['grads_abs']:.2e} "
              f"abs / {r['grads']:.2e} rel (worst {r['worst']}); tol {TOL:g}")
        assert r["logits_rel"] <= TOL and r["grads"] <= TOL, (what, r)


@pytest.mark.parametrize("arch, method, documents", [
    ("qwen3_moe", "colossal", "as_transformers"),
    ("mixtral", "ulysses", "as_transformers"),        # sliding window
    ("deepseek_v3", "head_tail", "as_transformers"),  # MLA, shared experts, grouped routing, correction bias
    # sinks, windows, expert biases; its eager mask joins packed documents, so each runs alone
    ("gpt_oss", "colossal", "independent"),
])
def test_dp2_cp2_ep2_equals_one_rank(ranks, arch, method, documents):
    """4 ranks: dp_shard 2 x CP 2, experts split over EP groups of 2 (and FSDP-sharded over the 2 replicas),
    packed rows with padding under the declared meaning of a packed row."""
    res = ranks(4).run(W.ep_step, arch, method, 2, 2, "packed_padding", 24, 3, 1, 1, documents, timeout=300)
    _check(res, f"{arch} {method} dp2 x cp2 x ep2 packed_padding ({documents})")
    assert all(r["local_experts"] == 1 for r in res)     # E/ep = 2 experts per EP rank, halved again by FSDP2


def test_one_expert_per_rank_ep4_on_4_and_8_ranks(ranks):
    """Qwen3-MoE with its 4 experts one per rank of the EP group: dp_shard 2 x CP 2 (4 ranks) and
    dp_shard 4 x CP 2 (8 ranks, two EP groups)."""
    for world in (4, 8):
        res = ranks(world).run(W.ep_step, "qwen3_moe", "colossal", 4, world // 2, "packed_padding", timeout=300)
        _check(res, f"qwen3_moe dp{world // 2} x cp2 x ep4")


@pytest.mark.parametrize("tp, dp_replicate", [(2, 1), (1, 2)])
def test_tp_or_hsdp_with_cp2_ep2_equals_one_rank(ranks, tp, dp_replicate):
    """TP inside attention as without EP (the experts stay whole over tp: their input is the replicated
    residual stream, so every tp rank dispatches the same rows to the same EP peer); HSDP (the experts
    replicated over dp_replicate and sharded over the dense ranks holding them)."""
    res = ranks(4).run(W.ep_step, "qwen3_moe", "colossal", 2, 1, "packed_padding", 24, 3, tp, dp_replicate,
                       timeout=300)
    _check(res, f"qwen3_moe tp{tp} x dp_replicate{dp_replicate} x cp2 x ep2")


@pytest.mark.parametrize("example", ["async_qwen3_moe_load_balance.yaml", "qwen3_next_cp2.yaml"])
def test_ep_beside_async_cp_and_a_mixer_method(ranks, tmp_path, example):
    """EP touches only the experts, so it combines with the other kinds of CP method: async Head-Tail
    (the Qwen3-MoE adapter's handoff) and a hybrid model's Gated DeltaNet method beside attention
    (Qwen3-Next, MoE with a shared expert). The shipped example at CP=2 x EP=2 gives the CP=1 losses."""
    from tests.trainer.test_cp_examples import _cfg

    ep2 = ranks(2).run(TW.train_losses, _cfg(example, tmp_path / "ep2", "accelerator.ep_size=2"), timeout=600)
    [one] = ranks(1).run(TW.train_losses, _cfg(example, tmp_path / "cp1", "accelerator.cp_size=1"), timeout=600)
    got, want = ep2[0]["losses"], one["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"{example}: cp2 x ep2 {got}\n  cp1 {want}\n  max rel {rel:.2e} (tol {LOSS_RTOL:g})")
    assert len(got) == len(want) == 3 and rel <= LOSS_RTOL


def test_trainer_cp2_ep2_same_losses_and_export_as_one_rank(ranks, tmp_path):
    """5 optimizer steps of the trainer (meta build, FSDP2, AdamW, router loss) at CP=2 x EP=2 against
    CP=1 / EP=1 on the same data; both HF exports load as plain transformers models with the same weights."""
    import torch
    import transformers as T

    losses, exported, load = {}, {}, {}
    for world in (2, 1):
        cfg = TW.make_cfg("qwen3_moe", cp=world, steps=5, out_dir=str(tmp_path / f"w{world}"),
                          accelerator__ep_size=world, model__config={"output_router_logits": True})
        res = ranks(world).run(W.train_export, cfg, timeout=600)
        assert all(r["losses"] == res[0]["losses"] for r in res)
        losses[world] = res[0]["losses"]
        exported[world] = T.AutoModelForCausalLM.from_pretrained(res[0]["hf"]).state_dict()
        load[world] = res[0]["expert_load"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses[2], losses[1]))
    print(f"trainer qwen3_moe: ep1 {losses[1]}\n  cp2 x ep2 {losses[2]}\n  max rel {rel:.2e} (tol {LOSS_RTOL:g})")
    assert len(losses[2]) == 5 and rel <= LOSS_RTOL
    assert exported[2].keys() == exported[1].keys()
    experts = [k for k in exported[1] if ".experts." in k]
    assert experts and all(exported[2][k].shape == exported[1][k].shape for k in experts)
    werr = max((exported[2][k] - exported[1][k]).abs().max().item() for k in exported[1])
    print(f"exported weights: max abs difference {werr:.2e}")
    # the step record logs what each EP rank's experts received: the tokens per expert, grouped by EP rank
    print(f"expert load at ep 2: {load[2]}")
    assert "rows_per_ep_rank" not in load[1]
    t = load[2]["tokens_per_expert"]
    assert load[2]["rows_per_ep_rank"] == [round(sum(t[:2]), 1), round(sum(t[2:]), 1)] and t == load[1]["tokens_per_expert"]
    assert werr <= 1e-5      # AdamW (lr 1e-3) turns ~1e-7 gradient differences into ~1e-6 weight differences


# ---------------------------------------------------------------------------------------- refusals
def _plan(model, **sizes):
    return ShardingPlanner([]).plan(model, **sizes)


def test_a_model_without_an_ep_plan_is_refused():
    from tests.wrappers._workers import build_arch

    model, _ = build_arch("llama")
    with pytest.raises(CPConfigError, match=r"accelerator\.ep_size.*declares no 'ep_dispatch_experts'"):
        _plan(model, ep_size=2)


def test_ep_that_does_not_divide_the_experts_is_refused_naming_the_module():
    model, _ = W.build_moe("qwen3_moe")
    with pytest.raises(CPConfigError, match=r"model\.layers\.0\.mlp\.experts.*ep_size=3 does not divide the 4 experts"):
        _plan(model, ep_size=3)
    assert len(_plan(model, ep_size=4).ep_targets) == 2


def test_an_adapter_inside_the_experts_is_refused():
    model, _ = W.build_moe("qwen3_moe")
    model.model.layers[1].mlp.experts.lora_A = nn.Linear(4, 4)     # what an adapter on the experts adds
    with pytest.raises(CPConfigError, match=r"model\.layers\.1\.mlp\.experts.*adapter \(LoRA\)"):
        _plan(model, ep_size=2)


def test_ep_that_does_not_divide_the_dense_ranks_is_refused():
    MeshSizes(dp_replicate=2, cp=2, ep=2).check(4)
    with pytest.raises(MeshConfigError, match=r"must divide dp_shard\(1\) x cp\(2\)"):
        MeshSizes(cp=2, ep=4).check(2)


def test_a_checkpoint_written_at_ep2_resumes_at_ep1_and_ep4(ranks, tmp_path):
    """Saved at CP=2 x EP=2 after 2 steps, resumed at EP=1 (one rank) and at CP=4 x EP=4 (one expert
    per rank): the next losses equal an uninterrupted one-rank run's (experts are saved as their
    global tensors, so the checkpoint does not depend on the EP size)."""
    def cfg(world, ep, name, **kw):
        return TW.make_cfg("qwen3_moe", cp=world, steps=4, out_dir=str(tmp_path / name), accelerator__ep_size=ep,
                           **kw)

    [straight] = ranks(1).run(TW.train_losses, cfg(1, 1, "straight"), timeout=600)
    first = ranks(2).run(TW.train_losses, cfg(2, 2, "ep2"), None, 2, timeout=600)[0]
    assert first["step"] == 2
    for world in (1, 4):
        second = ranks(world).run(TW.train_losses, cfg(world, world, f"resume{world}",
                                                        schedule__resume_from=first["path"]), timeout=600)[0]
        got = first["losses"] + second["losses"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, straight["losses"]))
        print(f"resumed at ep {world}: {got}\n  uninterrupted {straight['losses']}\n  max rel {rel:.2e}")
        assert second["step"] == 4 and len(got) == 4 and rel <= LOSS_RTOL


def test_a_bad_ep_size_on_one_rank_fails_every_rank_before_any_collective(ranks):
    from hyper_parallel.distributed.errors import PreflightError

    pool = ranks(2)
    outs = pool.outcomes(W.ep_setup, rank_args=[(2,), (3,)], timeout=120)
    assert isinstance(outs[1], CPConfigError) and "ep_size" in str(outs[1]), outs
    assert isinstance(outs[0], PreflightError) and "rank 1" in str(outs[0]), outs
    assert pool.run(W.ep_setup, 2) == [2, 2]


@pytest.mark.parametrize("sizes", [{"ep_size": 2}, {"cp_size": 2}])
def test_router_jitter_noise_is_refused_when_tokens_are_split(sizes):
    """Mixtral's router jitter draws a random factor per token in training: split over ranks it draws
    other numbers than one rank, so it is refused (it is 0 by default, and then runs)."""
    from tests.wrappers._workers import arch_config

    import transformers as T

    cfg, _ = arch_config("mixtral")
    cfg.router_jitter_noise = 0.1
    model = T.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(CPConfigError, match=r"router_jitter_noise.*model\.layers\.0\.mlp.*random noise"):
        _plan(model, **sizes)
    _plan(model)                    # one rank: transformers' own computation
