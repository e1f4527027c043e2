"""Packed documents under CP equal CP=1.

The trainer's own packed stream (``data.source: files``, ``packing: true``: real standard-library
text cut into documents of about 3-50 tokens, so a row holds several documents and documents cross
CP-rank boundaries) feeds the real :class:`TextTrainer` for 2 optimizer steps with gradient
accumulation 2; rows are 62 tokens (CP pads them to the policy multiple) and the last row of the
epoch is right-padded. Each CP method (cp 2: Colossal, Ulysses, Head-Tail; cp 4: Hybrid u2,
Head-Tail) runs in one worker call per CP size and is compared, per step, with a CP=1 run of the
same trainer on the same micro-batches:

  tokens     global valid targets == CP=1 == a direct count of the batch (documents' last tokens
             and padding carry no target)
  loss       the logged global token mean, abs error <= 1e-5
  gradients  every parameter, elementwise atol/rtol of test_parity.TOL; grad norm rtol 1e-4

Max abs and relative errors are printed for every method.
"""
from __future__ import annotations

import pytest
import torch

from . import _data_workers as D
from .test_parity import GRAD_NORM_RTOL, LOSS_ATOL, TOL, _check, _Report

SEQ_LEN, STEPS, GA = 62, 2, 2


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("packed")
    docs = D.short_docs_jsonl(str(d / "docs.jsonl"), n_docs=40, lo=10, hi=150)
    data = D.data_cfg(docs, str(d / "cache"), seq_len=SEQ_LEN, micro_batch_size=2)
    base = D.trainer_cfg(data, cp=1, ga=GA, steps=STEPS, out_dir=str(d / "out"))
    # enough steps to pass the end of the first epoch (its last row is padded)
    rows = D.packed_batches(base, dp_size=1, steps=12)[0]
    return base, data, rows, d


def _pick_steps(rows: list) -> list:
    """The first STEPS steps whose micro-batches hold several documents per row, plus the step
    that holds the padded last row of the epoch if there is one in range."""
    padded = [s for s, mbs in enumerate(rows) if any(bool((mb["attention_mask"] == 0).any()) for mb in mbs)]
    first = [s for s in range(len(rows)) if s not in padded][:STEPS - 1]
    return [rows[s] for s in sorted(first + padded[:1])][:STEPS] if padded else rows[:STEPS]


def _crosses_boundary(batch: dict, cp: int) -> bool:
    """Some document spans the boundary between two CP ranks' contiguous chunks."""
    S = batch["input_ids"].shape[1]
    S_pad = -(-S // (2 * cp)) * (2 * cp)
    L = S_pad // cp
    for lens in batch["seq_lens"]:
        ends = torch.cumsum(lens, 0)
        starts = ends - lens
        for k in range(1, cp):
            if bool(((starts < k * L) & (ends > k * L)).any()):
                return True
    return False


@pytest.mark.parametrize("cp, methods", [(2, ["colossal", "ulysses", "head_tail"]), (4, ["hybrid", "head_tail"])])
def test_packed_cp_equals_cp1(ranks, packed, cp, methods):
    base, data, rows, d = packed
    steps = _pick_steps(rows)
    batches = [steps]
    flat = [mb for mbs in steps for mb in mbs]
    pieces = [int((lens > 0).sum()) for mb in flat for lens in mb["seq_lens"]]
    print(f"documents per row: {pieces}")
    assert sum(pieces) >= 2 * len(pieces), "rows should hold several documents"
    assert any(_crosses_boundary(mb, cp) for mb in flat), "no document crosses a CP-rank boundary"
    assert any(bool((mb["attention_mask"] == 0).any()) for mb in flat), "no padded row in the run"
    [ref] = ranks(1).run(D.run_many, [base], batches, timeout=300)
    ref = ref[0]
    cfgs = [D.trainer_cfg(data, cp=cp, method=m, ga=GA, steps=STEPS, out_dir=str(d / f"out_{m}")) for m in methods]
    results = ranks(cp).run(D.run_many, cfgs, batches, timeout=600)
    tol = {f: f"atol {a:g} rtol {r:g}" for f, (a, r) in TOL.items()}
    for mi, method in enumerate(methods):
        rep = _Report(f"packed cp={cp} {method}")
        for rank, per_method in enumerate(results):
            res = per_method[mi]
            for s, (got, exp) in enumerate(zip(res["steps"], ref["steps"])):
                where = f"packed cp={cp} {method} rank {rank} step {s + 1}"
                direct = sum(int((mb["labels"][:, 1:] != -100).sum()) - _doc_ends_inside(mb) for mb in steps[s])
                assert got["tokens"] == exp["tokens"] == direct, \
                    f"{where}: valid tokens {got['tokens']} vs CP=1 {exp['tokens']} vs direct {direct}"
                err = abs(got["loss"] - exp["loss"])
                rep.add("loss", (err, err / abs(exp["loss"])), f"atol {LOSS_ATOL:g}")
                assert err <= LOSS_ATOL, f"{where}: loss {got['loss']:.8f} vs CP=1 {exp['loss']:.8f}"
                nerr = abs(got["grad_norm"] - exp["grad_norm"])
                rep.add("grad norm", (nerr, nerr / exp["grad_norm"]), f"rtol {GRAD_NORM_RTOL:g}")
                assert nerr <= GRAD_NORM_RTOL * exp["grad_norm"], f"{where}: grad norm"
                assert set(got["grads"]) == set(exp["grads"])
                for name in exp["grads"]:
                    rep.add("grads", _check(f"grad of {name}", got["grads"][name], exp["grads"][name],
                                            *TOL["grads"], where), tol["grads"])
        rep.print()


def _doc_ends_inside(mb: dict) -> int:
    """Targets that labels[:, 1:] counts but packing removes: the last token of every document that
    is followed by another real token of the row (that token starts the next document)."""
    n = 0
    for lens, mask in zip(mb["seq_lens"], mb["attention_mask"]):
        real = int(mask.sum())
        ends = torch.cumsum(lens, 0)
        n += int(((ends < real) & (lens > 0)).sum())
    return n


def test_held_out_loss_equals_cp1(ranks, tmp_path):
    """The held-out evaluation (no gradients, same batch contract) at CP=2 Head-Tail and at
    DP=2 equals CP=1 on the same rows: eval loss within 1e-5, the same target count. The model is
    initialized with std 1 so that its predictions depend on the context: the same rows without
    document boundaries (negative control) give a loss more than 100x the tolerance away."""
    docs = D.short_docs_jsonl(str(tmp_path / "docs.jsonl"), n_docs=60, lo=10, hi=150)
    data = D.data_cfg(docs, str(tmp_path / "cache"), seq_len=SEQ_LEN, micro_batch_size=1, eval_fraction=0.5,
                      eval_batches=2)
    one = dict(data, micro_batch_size=2)   # DP=2 x B=1 reads the rows CP=1 x B=2 reads
    def cfg(d, name, **kw):
        c = D.trainer_cfg(d, out_dir=str(tmp_path / name), **kw)
        c["model"]["config"]["initializer_range"] = 1.0
        return c

    [ref] = ranks(1).run(D.held_out_loss, cfg(one, "r1", cp=1), timeout=300)
    [merged] = ranks(1).run(D.held_out_loss, cfg(one, "r1", cp=1), True, timeout=300)
    cp2 = ranks(2).run(D.held_out_loss, cfg(one, "r2", cp=2, method="head_tail"), timeout=300)
    dp2 = ranks(2).run(D.held_out_loss, cfg(data, "r3", cp=1, dp_shard=2, plan=False), timeout=300)
    gap = abs(merged["eval_loss"] - ref["eval_loss"])
    print(f"held-out CP=1 {ref['eval_loss']:.6f}; documents merged (negative control) {merged['eval_loss']:.6f}, "
          f"gap {gap:.2e}")
    assert gap > 100 * 1e-5
    for label, res in (("cp=2 head_tail", cp2), ("dp=2", dp2)):
        for r in res:
            err = abs(r["eval_loss"] - ref["eval_loss"])
            print(f"held-out {label}: loss {r['eval_loss']:.6f} vs CP=1 {ref['eval_loss']:.6f} (abs err {err:.2e}, "
                  f"tol 1e-5), tokens {r['eval_tokens']} vs {ref['eval_tokens']}")
            assert r["eval_tokens"] == ref["eval_tokens"] and err <= 1e-5
