"""Trainer Level-0 parity: CP>1 trainer == CP=1 trainer, step by step.

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

fp32 and bf16 tolerances (bound = ATOL + RTOL * |reference|, elementwise) are stated below.
Every run prints, per quantity, the max abs error and the max relative error (max abs error /
max |reference| per tensor) next to the tolerance; a failure also names the worst element.
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
# bf16 mixed precision (CP=2 vs CP=1 under the same policy). Errors are bf16 rounding, absolute-
# dominated; measured max: logits 9.3e-3, grads 3.1e-3, params 2.3e-3 abs (atol needed at rtol 2e-2:
# 7.4e-3 / 1.9e-3 / 1.9e-3), loss 3.5e-4 abs, grad norm 2.7e-4 rel. Bounds are ~5-8x those.
BF16_TOL = {
    "logits": (5e-2, 2e-2),
    "grads": (1e-2, 2e-2),
    "params": (1e-2, 2e-2),
}
BF16_LOSS_ATOL = 2e-3
BF16_GRAD_NORM_RTOL = 2e-3

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
    "colossal_cp2_padding_heavy": dict(cp=2, min_doc_len=4, seq_len=61),
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


def _err(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error / max |reference|)."""
    if ref.numel() == 0:
        return 0.0, 0.0
    a = (got.double() - ref.double()).abs().max().item()
    return a, a / max(ref.abs().max().item(), 1e-12)


def _check(what: str, got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, where: str):
    """Elementwise |got - ref| <= atol + rtol * |ref|; returns (max abs, max rel) from :func:`_err`."""
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
            f"max abs err {err.max().item():.3e}, max elementwise rel err {rel:.3e}; worst at {idx}: "
            f"got {got[idx].item():.8e} ref {ref[idx].item():.8e}")
    return _err(got, ref)


class _Report:
    """Worst (max abs, rel) per compared quantity over ranks/steps/tensors, printed every run."""

    def __init__(self, label: str):
        self.label, self.worst, self.tol = label, {}, {}

    def add(self, field: str, errs: tuple[float, float], tol: str) -> None:
        a, r = self.worst.get(field, (0.0, 0.0))
        self.worst[field] = (max(a, errs[0]), max(r, errs[1]))
        self.tol[field] = tol

    def print(self) -> None:
        for f, (a, r) in self.worst.items():
            print(f"{self.label} {f}: max abs {a:.2e} rel {r:.2e} (tol {self.tol[f]})")


def run_parity(ranks, arch: str, kw: dict, tol: dict = TOL, loss_atol: float = LOSS_ATOL, fsdp=None,
               grad_norm_rtol: float = GRAD_NORM_RTOL):
    cfg = W.make_cfg(arch, **kw)
    dp = kw.get("dp_replicate", 1) * kw.get("dp_shard", 1)
    batches = W.make_batches(cfg, dp_size=dp)
    ref = _reference(ranks, arch, kw, batches)
    results = ranks(_world(kw)).run(W.run_steps, cfg, batches, True, True, True, fsdp, timeout=300)
    B = cfg["data"]["micro_batch_size"]
    rep = _Report(f"{arch}/{kw}")
    tol_str = {f: f"atol {a:g} rtol {r:g}" for f, (a, r) in tol.items()}
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
            loss_err = abs(got["loss"] - exp["loss"])
            rep.add("loss", (loss_err, loss_err / abs(exp["loss"])), f"atol {loss_atol:g}")
            assert loss_err <= loss_atol, \
                f"{where}: loss {got['loss']:.8f} vs CP=1 {exp['loss']:.8f} (abs err {loss_err:.3e}, tol {loss_atol:g})"
            norm_err = abs(got["grad_norm"] - exp["grad_norm"])
            rep.add("grad norm", (norm_err, norm_err / exp["grad_norm"]), f"rtol {grad_norm_rtol:g}")
            assert norm_err <= grad_norm_rtol * exp["grad_norm"], \
                f"{where}: grad norm {got['grad_norm']:.8f} vs CP=1 {exp['grad_norm']:.8f} (tol rtol {grad_norm_rtol:g})"
            for i, (lg, mb) in enumerate(zip(got["logits"], batches[d][s])):
                ref_lg = exp["logits"][i][d * B:(d + 1) * B]
                valid = mb["attention_mask"].bool()
                rep.add("logits", _check("logits", lg[valid], ref_lg[valid], *tol["logits"],
                                         f"{where} micro-batch {i}"), tol_str["logits"])
            assert set(got["grads"]) == set(exp["grads"]), f"{where}: parameter names differ"
            for name in exp["grads"]:
                rep.add("grads", _check(f"grad of {name}", got["grads"][name], exp["grads"][name],
                                        *tol["grads"], where), tol_str["grads"])
            assert set(got["params"]) == set(exp["params"]), f"{where}: parameter names differ"
            for name in exp["params"]:
                rep.add("params", _check(f"{name} after the optimizer step", got["params"][name],
                                         exp["params"][name], *tol["params"], where), tol_str["params"])
    rep.print()
    # replicated parameters are identical on every rank (every CP rank, every DP rank) after each step
    for rank, res in enumerate(results[1:], start=1):
        for s, (a, b) in enumerate(zip(res["steps"], results[0]["steps"])):
            for name in b["params"]:
                assert torch.equal(a["params"][name], b["params"][name]), \
                    f"{name} differs between rank {rank} and rank 0 after step {s + 1}"
    return results


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


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.endswith("_padding_heavy")])
def test_padding_heavy_batches_really_are_padded(variant):
    """The padding-heavy variants exercise both kinds of padding: mostly-masked rows, and a global
    S that is not a multiple of the policy's chunk count (so shard_batch_for_cp must pad S)."""
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp

    kw = VARIANTS[variant]
    cfg = W.make_cfg("llama", **kw)
    batches = W.make_batches(cfg)
    mbs = [mb for step in batches[0] for mb in step]
    mask = torch.cat([mb["attention_mask"] for mb in mbs])
    assert mask.float().mean() < 0.75, f"{variant}: expected mostly padding-heavy rows"
    cp = kw["cp"]
    chunks = 2 * cp if kw.get("method") == "head_tail" else cp   # head_tail: two chunks per CP rank
    for mb in mbs:
        S = mb["input_ids"].shape[-1]
        assert S == kw["seq_len"], f"{variant}: batch length {S} != data.seq_len {kw['seq_len']}"
        padded = -(-S // chunks) * chunks
        assert padded > S, f"{variant}: S={S} is already a multiple of {chunks}; nothing for CP to pad"
        local = shard_batch_for_cp(mb, (0, cp), kw.get("method", "colossal"))
        assert (local.meta.global_seq_len, local.pad_len, local.meta.local_seq_len) == \
            (padded, padded - S, padded // cp), f"{variant}: S={S} with {chunks} chunks"


def test_bf16_mixed_precision_keeps_cp1_semantics(ranks):
    """bf16 (FSDP2 MixedPrecisionPolicy) at CP=2 vs the same bf16 policy at CP=1: logits, loss,
    gradients, grad norm and parameters after every step, at bf16-sized tolerances."""
    kw = dict(cp=2, mp="bf16")
    results = run_parity(ranks, "llama", kw, tol=BF16_TOL, loss_atol=BF16_LOSS_ATOL,
                         grad_norm_rtol=BF16_GRAD_NORM_RTOL)
    for res in results:
        for s, step in enumerate(res["steps"]):
            for name, p in step["params"].items():
                assert p.dtype == torch.float32, f"{name}: master weights must stay fp32 (step {s + 1})"
