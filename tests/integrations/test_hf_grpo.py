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
    loss_rel = max(abs(a - b) / max(abs(a), 1e-2) for a, b in zip(ref["loss"], got["loss"]))   # on-policy ~ 0
    gn_rel = max(abs(a - b) / abs(a) for a, b in zip(ref["grad_norm"], got["grad_norm"]))
    pmax, p_abs, worst, moved = W.param_gap(ref, got)
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
    plain (CP off) forward during generation, the policy's under CP with the balanced split (each rank's
    tokens permuted across the row, so the gathered log-probs must be put back in row order).
    CP=2 == CP=1."""
    ref, _ = _compare(ranks, num_iterations=2, max_completion_length=48, plan="llama_balanced", **SGD)
    # step 2 scores step 1's completions with the updated policy: a ratio that is not 1, a loss that is
    # not rounding noise (on-policy steps log ~1e-8)
    assert abs(ref["loss"][1]) > 1e-3, ref["loss"]


@full_only
def test_grpo_adamw(ranks):
    """The same under AdamW lr 1e-2 (Colossal, contiguous shards): parameters 5e-5 of the largest."""
    _compare(ranks, num_iterations=2, max_completion_length=48, param_tol=5e-5)


@full_only
def test_grpo_dp2_cp2_with_reference_model(ranks):
    """4 ranks, dp 2 x cp 2, against the plain script on 2 ranks: generation, rewards and advantages per
    DP group (the groups of 4 samples of a prompt span the two DP groups' processes as at CP=1), and a
    KL penalty to the reference model (``beta``), whose log-probs are computed with the generation."""
    _compare(ranks, dp=2, beta=0.04, **SGD)


@pytest.mark.parametrize("field, setting", [
    ("GRPOConfig.use_vllm", {"use_vllm": True}),
    ("GRPOConfig.use_transformers_continuous_batching", {"use_transformers_continuous_batching": True}),
    ("GRPOTrainer.model", {"_vlm": True}),
    # 3 rows x 2 groups x 1 = 6 rows are not whole groups of 4 (TRL checked 3 x 4 ranks = 12)
    ("GRPOConfig.num_generations", {"per_device_train_batch_size": 3}),
    ("GRPOConfig.per_device_eval_batch_size", {"do_eval": True, "eval_strategy": "steps",
                                                "per_device_eval_batch_size": 3})])
def test_grpo_options_not_carried_are_refused(field, setting):
    """What the GRPO integration does not map to CP groups, and a batch geometry that holds whole prompt
    groups for all ranks but not for world / cp processes, are refused by field (a local check, run
    by context_parallel on every rank before the first step); 4 ranks, cp 2."""
    from types import SimpleNamespace

    from hyper_parallel.distributed.errors import CPConfigError
    from hyper_parallel.integrations.hf.grpo import check_grpo

    def trainer(**changes):
        args = dict(use_vllm=False, use_transformers_continuous_batching=False, world_size=4,
                    per_device_train_batch_size=4, steps_per_generation=1, do_eval=False, eval_strategy="no",
                    per_device_eval_batch_size=4, num_generations_eval=None)
        vlm = changes.pop("_vlm", False)
        return SimpleNamespace(args=SimpleNamespace(**{**args, **changes}), _is_vlm=vlm, num_generations=4)

    check_grpo(trainer(), 2)             # the unchanged geometry is taken
    with pytest.raises(CPConfigError, match=rf"\[{field}\].*Fix:"):
        check_grpo(trainer(**setting), 2)
