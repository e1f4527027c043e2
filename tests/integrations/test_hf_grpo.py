"""TRL's GRPOTrainer under CP (hyper_parallel.integrations.hf.grpo): generation and scoring per
data-parallel group with the CP wrappers off, the policy loss's per-token log-probs under CP.

The same script (tests/integrations/_hf_workers.py::grpo_case: a tiny Llama, 16 code prompts, 4
samples each, a reward that varies between samples, gradient accumulation 2) at cp 1
on ``dp`` ranks and at cp 2 on ``2 dp``. Asserted: the same completions (so the same rewards) at
every generation — the last generation batch is compared token for token, after the parameters
have been updated twice —, the logged losses and grad norms within relative 1e-5 (losses
relative to at least 1e-2: on-policy steps log rounding noise around 0), and every parameter within
1e-5 of the largest |parameter| under SGD (lr 0.5), which compares the gradients themselves. Under
AdamW (lr 1e-2) the parameters differ by 2.9e-5 of the largest (test_grpo_adamw): AdamW's g / sqrt(v)
amplifies near-cancelling gradients, as transformers shows against itself
(test_hf_trainer_cp.py::test_adamw_amplifies_summation_order).
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("trl")

from tests.integrations import _hf_workers as W  # noqa: E402

TOL = 1e-5
FULL = os.environ.get("HYPER_PARALLEL_HF", "") == "all"
full_only = pytest.mark.skipif(not FULL, reason="full HF matrix: set HYPER_PARALLEL_HF=all")
SGD = {"optim": "sgd", "learning_rate": 0.5}


def _compare(ranks, dp: int = 1, param_tol: float = TOL, **extra):
    ref = ranks(dp).run(W.grpo_case, 1, timeout=600, **extra)[0]
    got = ranks(2 * dp).run(W.grpo_case, 2, timeout=600, **extra)
    for rank in got[1:]:                 # every rank logs the same (one computation per CP group)
        assert rank["completions"] == got[0]["completions"] and rank["loss"] == got[0]["loss"]
    got = got[0]
    n = len(ref["completions"])          # TRL's log holds one generation batch
    same = got["completions"][-n:] == ref["completions"]
    loss_abs = max(abs(a - b) for a, b in zip(ref["loss"], got["loss"]))
    loss_rel = max(abs(a - b) / max(abs(a), 1e-2) for a, b in zip(ref["loss"], got["loss"]))
    gn_rel = max(abs(a - b) / abs(a) for a, b in zip(ref["grad_norm"], got["grad_norm"]))
    pmax = max(p.abs().max().item() for p in ref["params"].values())
    p_abs, worst = max(((ref["params"][k] - got["params"][k]).abs().max().item(), k) for k in ref["params"])
    moved = max((ref["params"][k] - ref["init"][k]).abs().max().item() for k in ref["params"])
    print(f"GRPO dp {dp}: losses cp1 {ref['loss']}\n  cp2 {got['loss']} (max abs {loss_abs:.1e}, rel {loss_rel:.1e})\n"
          f"  rewards cp1 {ref['reward']} cp2 {got['reward']}; last completions equal: {same}\n"
          f"  grad norms max rel {gn_rel:.2e}; params max abs {p_abs:.2e} = {p_abs / pmax:.2e} of the largest "
          f"({worst}); largest update {moved:.2e}")
    assert len(ref["loss"]) == len(got["loss"]) == 3 and ref["lr"] == got["lr"]
    assert same and ref["reward"] == got["reward"]
    assert loss_rel <= TOL and gn_rel <= TOL and p_abs <= param_tol * pmax
    assert moved > 100 * TOL * pmax, "the parameters did not move: the comparison would prove nothing"
    return ref, got


def test_grpo_policy_loss_under_cp(ranks):
    """Two policy iterations per generation (``num_iterations=2``): the second one's importance ratio is
    not 1, so the clipped policy loss and its gradient are not trivial; the old log-probs come from the
    plain (CP off) forward during generation, the policy's under CP. CP=2 == CP=1."""
    ref, _ = _compare(ranks, num_iterations=2, max_completion_length=48, **SGD)
    assert max(abs(x) for x in ref["loss"]) > 1e-4, ref["loss"]     # a policy loss that is not rounding noise


@full_only
def test_grpo_adamw(ranks):
    """The same under AdamW lr 1e-2: parameters 5e-5 of the largest (measured 2.9e-5, ``lm_head``)."""
    _compare(ranks, num_iterations=2, max_completion_length=48, param_tol=5e-5)


@full_only
def test_grpo_dp2_cp2_with_reference_model(ranks):
    """4 ranks, dp 2 x cp 2, against the plain script on 2 ranks: generation, rewards and advantages per
    DP group (the groups of 4 samples of a prompt span the two DP groups' processes as at CP=1), and a
    KL penalty to the reference model (``beta``), whose log-probs are computed with the generation."""
    _compare(ranks, dp=2, beta=0.04, **SGD)


@pytest.mark.parametrize("field, setting", [("GRPOConfig.use_vllm", {"use_vllm": True}),
                                            ("GRPOConfig.use_transformers_continuous_batching",
                                             {"use_transformers_continuous_batching": True}),
                                            ("model.config.output_router_logits", {"_aux": True})])
def test_grpo_options_not_carried_are_refused(field, setting):
    """The GRPO options the integration does not map to CP groups are refused by field (a local check,
    run by context_parallel on every rank before the first step)."""
    from types import SimpleNamespace

    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.integrations.hf.grpo import check_grpo

    args = SimpleNamespace(use_vllm=False, use_transformers_continuous_batching=False)
    aux = setting.pop("_aux", False)
    vars(args).update(setting)
    with pytest.raises(CPConfigError, match=rf"\[{field}\].*Fix:"):
        check_grpo(SimpleNamespace(args=args, aux_loss_enabled=aux))
