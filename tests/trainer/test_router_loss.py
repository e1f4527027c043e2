"""MoE router load-balancing loss: the model's own objective, exact under CP and DP.

* CP=1: the trainer's loss, router loss and every gradient equal transformers' own
  ``model(labels, attention_mask, num_items_in_batch, output_router_logits=True)`` (Qwen3-MoE, Mixtral).
* CP=2/4 (Colossal, Ulysses, Head-Tail, async Colossal): loss, router loss and every gradient (router
  weights included) equal CP=1 over 3 trainer steps on right-padded rows and on packed + padded
  micro-batches (GA 2).
* The per-rank-mean shortcut differs from the whole-sequence loss by far more than the tolerance
  (so these tests can tell), and the reduced statistics reproduce transformers' formula exactly.
"""
from __future__ import annotations

import pytest
import torch

from . import _router_workers as R
from . import _workers as W
from .test_cp1_batch_path import _packed_batches

# Step 1 (no optimizer step yet): only the fp32 reduction order differs -> tight. Steps 2-3 follow AdamW
# updates, which turn a ~1e-7 gradient difference of a near-zero-gradient parameter (an expert or router
# row that barely trains) into a difference of order lr in that parameter: the trajectories drift apart
# by ~1e-5 relative (measured: 2.4e-6 on the loss, 1.6e-5 on the router loss at step 3), so later steps
# are compared at the gradient tolerance. A router loss in the wrong domain or scale is off by >= 1e-2.
# Gradients are compared at steps 1 and 2: after two updates drifted by ~1e-5, a token whose two top
# experts nearly tie may be routed differently at CP=1 and CP=2 (measured at step 3 with the meta
# build's init: embed_tokens gradient off by 2.4 % of the largest), a discontinuity of top-k routing,
# not of CP.
STEP1_ATOL = 1e-5
ROUTER_ATOL = 1e-5   # single-forward router-loss comparisons (no optimizer step)
LATER_RTOL = 1e-4
GRAD_REL_TOL = 1e-4   # max abs error / the model's largest gradient (fp32, as test_parity.py)


def _check_grads(got: dict, ref: dict, what: str) -> None:
    assert set(got) == set(ref), what
    scale = max(float(v.abs().max()) for v in ref.values())
    for k in ref:
        err = float((got[k].double() - ref[k].double()).abs().max())
        assert err <= GRAD_REL_TOL * scale, f"{what}: grad {k} max err {err:.3e} (scale {scale:.3e})"
    routers = [k for k in ref if k.endswith("gate.weight")]
    assert routers and all(float(ref[k].abs().max()) > 0 for k in routers), "router weights get gradient"


def _compare(got_steps: list, ref_steps: list, what: str) -> None:
    assert len(got_steps) == len(ref_steps) == 3
    for i, (g, r) in enumerate(zip(got_steps, ref_steps)):
        def tol(ref):
            return STEP1_ATOL if i == 0 else LATER_RTOL * abs(ref)

        assert abs(g["loss"] - r["loss"]) <= tol(r["loss"]), (what, i, g["loss"], r["loss"])
        assert g["router_loss"] is not None and abs(g["router_loss"] - r["router_loss"]) <= tol(r["router_loss"]), \
            (what, i, g["router_loss"], r["router_loss"])
        if i < 2:   # see below: from step 3 on a token may pick another expert (top-k is discontinuous)
            _check_grads(g["grads"], r["grads"], f"{what} step {i + 1}")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_cp1_router_loss_equals_transformers_own_objective(ranks, arch, tmp_path):
    cfg = R.moe_cfg(arch, cp=1, steps=3, ga=2, min_doc_len=16, plan=False, out_dir=str(tmp_path))
    batches = W.make_batches(cfg)
    [got] = ranks(1).run(R.run_moe_steps, cfg, batches)
    ref = R.hf_reference(cfg, batches)
    _compare(got["steps"], ref, f"{arch} cp=1 vs transformers")
    rec = got["steps"][0]["record"]
    assert rec["router_loss"] == got["steps"][0]["router_loss"]
    load = rec["expert_load"]
    assert len(load["tokens_per_expert"]) == 4 and load["max"] >= load["mean"] > 0
    # 2 layers x top-2 x valid input tokens of the step (padding excluded)
    valid = sum(int(b["attention_mask"].sum()) for b in batches[0][0])
    assert sum(load["tokens_per_expert"]) == pytest.approx(2 * 2 * valid)


CASES = [("qwen3_moe", 2, "colossal"), ("qwen3_moe", 2, "ulysses"), ("mixtral", 2, "colossal"),
         ("mixtral", 2, "ulysses"), ("qwen3_moe", 2, "head_tail"), ("mixtral", 2, "head_tail"),
         ("qwen3_moe", 2, "async_colossal"), ("qwen3_moe", 4, "colossal"), ("mixtral", 4, "head_tail")]


@pytest.mark.parametrize("arch,cp,method", CASES)
def test_cp_router_loss_and_grads_equal_cp1_padded_rows(ranks, arch, cp, method, tmp_path):
    kw = dict(steps=3, ga=1, min_doc_len=16, out_dir=str(tmp_path))
    ref_cfg = R.moe_cfg(arch, cp=1, plan=False, **kw)
    batches = W.make_batches(ref_cfg)
    [ref] = ranks(1).run(R.run_moe_steps, ref_cfg, batches)
    outs = ranks(cp).run(R.run_moe_steps, R.moe_cfg(arch, cp=cp, method=method, **kw), batches)
    for o in outs:
        _compare(o["steps"], ref["steps"], f"{arch} cp={cp} {method} rank {o['cp_rank']}")
        assert o["steps"][0]["expert_load"] == ref["steps"][0]["expert_load"] or \
            o["steps"][0]["expert_load"]["tokens_per_expert"] == ref["steps"][0]["expert_load"]["tokens_per_expert"]


@pytest.mark.parametrize("arch,method", [("qwen3_moe", "colossal"), ("mixtral", "ulysses")])
def test_cp2_router_loss_equals_cp1_on_packed_padded_batches_ga2(ranks, arch, method, tmp_path):
    steps = [_packed_batches(seed=7 + s)[0] for s in range(3)]   # 3 steps x GA 2 micro-batches
    batches = [steps]
    kw = dict(steps=3, ga=2, out_dir=str(tmp_path))
    [ref] = ranks(1).run(R.run_moe_steps, R.moe_cfg(arch, cp=1, plan=False, **kw), batches)
    outs = ranks(2).run(R.run_moe_steps, R.moe_cfg(arch, cp=2, method=method, **kw), batches)
    for o in outs:
        _compare(o["steps"], ref["steps"], f"{arch} packed cp=2 {method} rank {o['cp_rank']}")
    # padding is excluded: 2 layers x top-2 x real input tokens of the step's micro-batches
    real = sum(int((mb["input_ids"] != 0).sum()) for mb in steps[0])
    assert sum(ref["steps"][0]["expert_load"]["tokens_per_expert"]) == pytest.approx(4 * real)


def test_dp2_cp2_global_domain_equals_cp1_on_concatenated_rows(ranks, tmp_path):
    """Default domain with DP: FSDP over dp_shard 2 x cp 2 equals CP=1 on one rank with both DP ranks'
    rows concatenated (the trainer's CP=1 reference), router loss and gradients included."""
    kw = dict(steps=3, ga=1, min_doc_len=16, micro_batch_size=1, out_dir=str(tmp_path))
    cfg = R.moe_cfg("qwen3_moe", cp=2, dp_shard=2, **kw)
    batches = W.make_batches(cfg, dp_size=2)
    [ref] = ranks(1).run(R.run_moe_steps, R.moe_cfg("qwen3_moe", cp=1, plan=False, **kw),
                         W.reference_batches(batches))
    outs = ranks(4).run(R.run_moe_steps, cfg, batches)
    assert sorted((o["dp_rank"], o["cp_rank"]) for o in outs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for o in outs:
        _compare(o["steps"], ref["steps"], f"dp2 cp2 rank ({o['dp_rank']}, {o['cp_rank']})")


def test_per_rank_mean_shortcut_differs_and_reduced_stats_match_transformers():
    """Whole-sequence aux (transformers) vs the mean of per-shard aux: the shortcut is off by far more
    than ROUTER_ATOL; this module's sums reduced over the shards reproduce transformers exactly."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from hyper_parallel.trainer.router_loss import (RouterLossSpec, RouterStats, local_router_stats,
                                                    router_aux_from_stats)

    g = torch.Generator().manual_seed(0)
    E, k, T, C = 4, 2, 64, 2
    # a router that is skewed differently on the two halves of the sequence (as real text drifts)
    logits = [torch.randn(T, E, generator=g) + torch.cat([torch.tensor([2., 0, 0, 0]).expand(T // 2, E),
                                                           torch.tensor([0, 0, 0, 2.]).expand(T // 2, E)])
              for _ in range(2)]
    mask = torch.ones(T)
    mask[-5:] = 0   # padding
    ref = float(load_balancing_loss_func(tuple(logits), E, k, attention_mask=mask.unsqueeze(0)))
    spec = RouterLossSpec(E, k, 0.01)
    shards = [local_router_stats([x[i * T // C:(i + 1) * T // C] for x in logits], spec,
                                 mask[i * T // C:(i + 1) * T // C]) for i in range(C)]
    shortcut = sum(float(router_aux_from_stats(s, spec, None)[0]) for s in shards) / C
    summed = RouterStats(*(sum(getattr(s, f) for s in shards) for f in ("counts", "prob_sum", "rows")))
    exact, counts = router_aux_from_stats(summed, spec, None)
    assert abs(float(exact) - ref) < 1e-6
    assert abs(shortcut - ref) > 100 * ROUTER_ATOL, (shortcut, ref)
    assert float(counts.sum()) == 2 * k * (T - 5)


def test_router_loss_off_and_bad_config_refused(ranks, tmp_path):
    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.trainer.config import LossConfig
    from hyper_parallel.trainer.router_loss import router_loss_spec
    from transformers import MixtralConfig, MixtralForCausalLM

    tiny = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    on = MixtralForCausalLM(MixtralConfig(output_router_logits=True, router_aux_loss_coef=0.02, **tiny))
    spec = router_loss_spec(on, LossConfig())
    assert (spec.num_experts, spec.top_k, spec.coef, spec.domain) == (4, 2, 0.02, "global_micro_batch")
    assert router_loss_spec(on, LossConfig(router_loss=False)) is None
    assert router_loss_spec(MixtralForCausalLM(MixtralConfig(**tiny)), LossConfig()) is None
    on.config.router_z_loss_coef = 0.001
    with pytest.raises(CPConfigError, match="router_z_loss_coef"):
        router_loss_spec(on, LossConfig())


def test_dp2_cp2_local_domain_equals_per_dp_rank_transformers_loss(ranks, tmp_path):
    """``loss.router_balance_domain: local_micro_batch``: each DP rank's rows balanced on their own
    (over its CP group), the step value the mean over DP ranks — equal to transformers' per-rank
    loss averaged over DP, and different from the default (global) domain."""
    kw = dict(steps=3, ga=1, min_doc_len=16, micro_batch_size=1, out_dir=str(tmp_path))
    cfg = R.moe_cfg("qwen3_moe", cp=2, dp_shard=2, loss__router_balance_domain="local_micro_batch", **kw)
    batches = W.make_batches(cfg, dp_size=2)
    ref = R.hf_reference_per_dp(R.moe_cfg("qwen3_moe", cp=1, plan=False, **kw), batches)
    outs = ranks(4).run(R.run_moe_steps, cfg, batches)
    for o in outs:
        _compare(o["steps"], ref, f"dp2 cp2 local domain rank ({o['dp_rank']}, {o['cp_rank']})")
    glob = R.hf_reference(R.moe_cfg("qwen3_moe", cp=1, plan=False, **kw), W.reference_batches(batches))
    assert abs(glob[0]["router_loss"] - ref[0]["router_loss"]) > 10 * ROUTER_ATOL   # measured 2.3e-4
