"""The HF Trainer's own checkpoints under CP (``save_strategy="steps"``, ``trainer.train(
resume_from_checkpoint=...)``): a CP=2 run saved at step 2 and resumed by a fresh script — at CP=2
and at CP=1 — logs the uninterrupted run's losses for steps 3-4 and ends with its parameters
(fp32, relative 1e-5 of the largest); a CP=1 checkpoint resumes at CP=2 the same way. The checkpoint is a plain HF directory (model, optimizer,
scheduler, RNG states, trainer state); CP adds nothing to it."""
from __future__ import annotations

import pytest

pytest.importorskip("trl")

from tests.integrations import _hf_workers as W  # noqa: E402

TOL = 1e-5


def test_trainer_checkpoint_resumes_at_the_same_and_another_cp_size(ranks, tmp_path):
    runs = {}
    for cp in (2, 1):     # uninterrupted 4 steps, checkpoints at 2 and 4
        runs[cp] = ranks(cp).run(W.resume_case, "trainer_flatten", "llama", cp, str(tmp_path / f"run{cp}"),
                                 timeout=300)[0]
        assert len(runs[cp]["loss"]) == 4 and (tmp_path / f"run{cp}" / "checkpoint-2").is_dir()
    for saved, resumed in ((2, 2), (2, 1), (1, 2)):
        full = runs[saved]
        pmax = max(p.abs().max().item() for p in full["params"].values())
        got = ranks(resumed).run(W.resume_case, "trainer_flatten", "llama", resumed, str(tmp_path / f"run{saved}"),
                                 resume=True, timeout=300)[0]
        rel = max(abs(a - b) / abs(a) for a, b in zip(full["loss"][2:], got["loss"]))
        perr = max((full["params"][n] - got["params"][n]).abs().max().item() for n in full["params"])
        print(f"saved at cp {saved}, resumed at cp {resumed}: losses {got['loss']} vs uninterrupted steps 3-4 "
              f"{full['loss'][2:]} (max rel {rel:.2e}); params max abs {perr:.2e} = {perr / pmax:.2e} of the largest "
              f"(tol {TOL:g})")
        assert len(got["loss"]) == 2 and got["lr"] == full["lr"][2:]
        assert rel <= TOL and perr <= TOL * pmax
