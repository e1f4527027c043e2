"""Trainer Level-0 parity (design 7.1/7.2): CP>1 trainer == CP=1 trainer, step by step.

Every case runs the real :class:`TextTrainer` for 3 optimizer steps (fixed seed, AdamW,
grad clipping on) on identical global micro-batches and compares, per step, against a CP=1
reference computed by a separate 1-rank run of the same trainer on the same data (every DP
rank's rows concatenated):

  logits      gathered over CP with ``gather_from_cp`` (valid positions: padding carries no loss)
  loss        the logged global token mean
  tokens      the global valid-token count (also checked against a direct count of the batch)
  gradients   every parameter, ``full_tensor()`` for DTensors, before clipping
  grad norm   the clipped-by global norm
  parameters  every parameter after the optimizer step; identical on every rank

fp32 tolerances (bound = ATOL + RTOL * |reference|, elementwise) are stated below; every
failure reports the max abs / max rel error and the worst element.
"""
from __future__ import annotations

import pytest
import torch

from hyper_parallel.trainer.data import count_valid_targets

from . import _workers as W

# fp32 tolerances (observed errors are ~10x below these)
TOL = {
    "logits": (2e-5, 1e-4),
    "grads": (2e-6, 1e-4),
    "params": (5e-6, 1e-4),
}
LOSS_ATOL = 1e-5
GRAD_NORM_RTOL = 1e-4
BF16_LOSS_RTOL = 2e-2

CASES = {
    "colossal_cp2": dict(cp=2, method="colossal"),
    "ulysses_cp2": dict(cp=2, method="ulysses"),
    "hybrid_cp4_u2": dict(cp=4, method="hybrid"),
    "head_tail_cp2": dict(cp=2, method="head_tail"),
    "fsdp_dp2_cp2": dict(cp=2, dp_shard=2, method="colossal"),
    "tp2_cp2": dict(cp=2, tp=2, method="colossal"),
}

VARIANTS = {  # tiny Llama
    "colossal_cp2_grad_accum2": dict(cp=2, ga=2),
    "colossal_cp2_activation_checkpointing": dict(cp=2, ac=True),
    "colossal_cp2_padding_heavy": dict(cp=2, min_doc_len=4, seq_len=62),
    "head_tail_cp2_padding_heavy": dict(cp=2, method="head_tail", min_doc_len=4, seq_len=62),
    "ulysses_cp2_padding_heavy": dict(cp=2, method="ulysses", min_doc_len=4, seq_len=61),
    "hybrid_cp4_u2_padding_heavy": dict(cp=4, method="hybrid", min_doc_len=4, seq_len=62),
    "hsdp_rep2_cp2": dict(cp=2, dp_replicate=2),
    "fsdp_dp2_cp2_grad_accum2_ac": dict(cp=2, dp_shard=2, ga=2, ac=True),
}

_REF_CACHE: dict = {}


def _world(kw: dict) -> int:
    return kw.get("dp_replicate", 1) * kw.get("dp_shard", 1) * kw.get("cp", 1) * kw.get("tp", 1)


def _data_kw(kw: dict) -> dict:
    return {k: kw[k] for k in ("ga", "min_doc_len", "seq_len", "mp") if k in kw}


def _reference(ranks, arch: str, kw: dict, batches: list):
    """CP=1 single-rank run on every DP rank's rows concatenated (cached per data set)."""
    dp = kw.get("dp_replicate", 1) * kw.get("dp_shard", 1)
    key = (arch, dp, tuple(sorted(_data_kw(kw).items())))
    if key not in _REF_CACHE:
        cfg = W.make_cfg(arch, cp=1, **_data_kw(kw))
        [_REF_CACHE[key]] = ranks(1).run(W.run_steps, cfg, W.reference_batches(batches), timeout=300)
    return _REF_CACHE[key]


def _check(what: str, got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, where: str) -> None:
    assert got.shape == ref.shape, f"{where}: {what} shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    err = (got - ref).abs()
    bound = atol + rtol * ref.abs()
    if bool((err > bound).any()):
        nz = ref.abs() > 0
        rel = (err[nz] / ref.abs()[nz]).max().item() if bool(nz.any()) else float("inf")
        worst = int(torch.argmax(err - bound))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
        raise AssertionError(
            f"{where}: {what} differs from the CP=1 reference beyond atol={atol:g} rtol={rtol:g}: "
            f"max abs err {err.max().item():.3e}, max rel err {rel:.3e}; worst at {idx}: "
            f"got {got[idx].item():.8e} ref {ref[idx].item():.8e}")


def _max_err(res_steps, ref_steps, field: str) -> float:
    return max(max((a[field][k] - b[field][k]).abs().max().item() for k in b[field])
               for a, b in zip(res_steps, ref_steps))


def run_parity(ranks, arch: str, kw: dict, tol: dict = TOL, loss_atol: float = LOSS_ATOL, fsdp=None):
    cfg = W.make_cfg(arch, **kw)
    dp = kw.get("dp_replicate", 1) * kw.get("dp_shard", 1)
    batches = W.make_batches(cfg, dp_size=dp)
    ref = _reference(ranks, arch, kw, batches)
    results = ranks(_world(kw)).run(W.run_steps, cfg, batches, True, True, True, fsdp, timeout=300)
    B = cfg["data"]["micro_batch_size"]
    for rank, res in enumerate(results):
        d = res["dp_rank"]
        if fsdp is False:  # replicated parameters, one SUM all-reduce of gradients over dp_cp
            assert not res["fsdp"] and res["grad_scale"] == 1.0
        else:  # FSDP2 averages over dp_replicate x dp_shard x cp: grad_scale = that size
            assert res["fsdp"] and res["grad_scale"] == kw.get("dp_replicate", 1) * kw.get("dp_shard", 1) * kw["cp"]
        for s, (got, exp) in enumerate(zip(res["steps"], ref["steps"])):
            where = f"{arch}/{kw} rank {rank} (dp {d}, cp {res['cp_rank']}) step {s + 1}"
            n_direct = sum(count_valid_targets(mb) for r in range(dp) for mb in batches[r][s])
            assert got["tokens"] == exp["tokens"] == n_direct, \
                f"{where}: valid tokens {got['tokens']} vs CP=1 {exp['tokens']} vs direct count {n_direct}"
            assert abs(got["loss"] - exp["loss"]) <= loss_atol, \
                f"{where}: loss {got['loss']:.8f} vs CP=1 {exp['loss']:.8f} (abs err {abs(got['loss'] - exp['loss']):.3e})"
            assert abs(got["grad_norm"] - exp["grad_norm"]) <= GRAD_NORM_RTOL * exp["grad_norm"], \
                f"{where}: grad norm {got['grad_norm']:.8f} vs CP=1 {exp['grad_norm']:.8f}"
            for i, (lg, mb) in enumerate(zip(got["logits"], batches[d][s])):
                ref_lg = exp["logits"][i][d * B:(d + 1) * B]
                valid = mb["attention_mask"].bool()
                _check("logits", lg[valid], ref_lg[valid], *tol["logits"], f"{where} micro-batch {i}")
            assert set(got["grads"]) == set(exp["grads"]), f"{where}: parameter names differ"
            for name in exp["grads"]:
                _check(f"grad of {name}", got["grads"][name], exp["grads"][name], *tol["grads"], where)
            for name in exp["params"]:
                _check(f"{name} after the optimizer step", got["params"][name], exp["params"][name],
                       *tol["params"], where)
    # replicated parameters are identical on every rank (every CP rank, every DP rank) after each step
    for rank, res in enumerate(results[1:], start=1):
        for s, (a, b) in enumerate(zip(res["steps"], results[0]["steps"])):
            for name in b["params"]:
                assert torch.equal(a["params"][name], b["params"][name]), \
                    f"{name} differs between rank {rank} and rank 0 after step {s + 1}"
    return {f: _max_err(results[0]["steps"], ref["steps"], f) for f in ("grads", "params")}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_trainer_parity(ranks, arch, case):
    run_parity(ranks, arch, CASES[case])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trainer_parity_variants(ranks, variant):
    run_parity(ranks, "llama", VARIANTS[variant])


def test_trainer_parity_without_fsdp_sum_allreduce(ranks):
    """CP without FSDP: replicated parameters, gradients SUM-all-reduced over dp_cp (grad_scale 1)."""
    run_parity(ranks, "llama", dict(cp=2, method="colossal", min_doc_len=8), fsdp=False)


def test_padding_heavy_batches_really_are_padded():
    cfg = W.make_cfg("llama", **VARIANTS["colossal_cp2_padding_heavy"])
    batches = W.make_batches(cfg)
    mask = torch.cat([mb["attention_mask"] for step in batches[0] for mb in step])
    assert mask.float().mean() < 0.75, "expected mostly padding-heavy rows"
    assert cfg["data"]["seq_len"] % 4, "odd length: the CP policies must pad S themselves"


def test_bf16_mixed_precision_keeps_cp1_semantics(ranks):
    kw = dict(cp=2, mp="bf16")
    cfg = W.make_cfg("llama", **kw)
    batches = W.make_batches(cfg)
    ref = _reference(ranks, "llama", kw, batches)
    res = ranks(2).run(W.run_steps, cfg, batches, False, False, True)
    for s, (got, exp) in enumerate(zip(res[0]["steps"], ref["steps"])):
        assert got["tokens"] == exp["tokens"]
        assert got["loss"] == pytest.approx(exp["loss"], rel=BF16_LOSS_RTOL), f"step {s + 1}"
        for name, p in got["params"].items():
            assert p.dtype == torch.float32, f"{name}: master weights must stay fp32"
            assert torch.equal(p, res[1]["steps"][s]["params"][name])
