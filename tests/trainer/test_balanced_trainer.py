"""The trainer with the balanced split declared (``examples/train_long_cp4_balanced.yaml`` at cp 2 on
short rows of the shipped data slice): the same losses step for step as the same file at
``accelerator.cp_size=1``, and the JSONL log carries the step's attention work spread per rank."""
from __future__ import annotations

import json
import os

import yaml

from hyper_parallel.trainer.config import apply_overrides
from tests.trainer import _workers as TW

LOSS_RTOL = 1e-5     # fp32, relative per-step loss (as tests/trainer/test_cp_examples.py)


def _cfg(tmp_path, *overrides: str) -> dict:
    with open(os.path.join(TW.ROOT, "examples", "train_long_cp4_balanced.yaml")) as fh:
        data = yaml.safe_load(fh)
    slice_ = os.path.join(TW.ROOT, "examples", "data", "stdlib_small.jsonl")
    return apply_overrides(data, ["schedule.steps=3", "logging.progress=false", "logging.plot=false",
                                  "logging.export_hf=false", "logging.log_every=1", f"logging.out_dir={tmp_path}",
                                  f"data.files=[{slice_}]", f"data.cache_dir={tmp_path.parent / 'cache'}",
                                  "data.seq_len=1024", "data.eval_every=100", *overrides])


def test_balanced_example_cp2_same_losses_as_cp1(ranks, tmp_path):
    cfg2 = _cfg(tmp_path / "cp2", "accelerator.cp_size=2")
    cfg1 = _cfg(tmp_path / "cp1", "accelerator.cp_size=1")
    assert cfg2["plan_overrides"][0]["inner_wrapper"] == "sdpa_hf_balanced"
    cp2 = ranks(2).run(TW.train_losses, cfg2, timeout=400.0)
    cp1 = ranks(1).run(TW.train_losses, cfg1, timeout=400.0)[0]["losses"]
    l2 = cp2[0]["losses"]
    assert cp2[1]["losses"] == l2, "the CP ranks logged different losses"
    rel = [abs(a - b) / abs(a) for a, b in zip(cp1, l2)]
    print(f"cp1 losses {cp1}\ncp2 losses {l2}\nmax rel err {max(rel):.2e} (tolerance {LOSS_RTOL:g})")
    assert len(l2) == len(cp1) == 3 and max(rel) <= LOSS_RTOL
    lines = [json.loads(x) for x in open(tmp_path / "cp2" / "train_log.jsonl", encoding="utf-8")]
    spreads = [r["attn_work_max_over_mean"] for r in lines if "attn_work_max_over_mean" in r]
    print(f"attention work per rank, max/mean per step: {spreads}")
    assert len(spreads) == 3 and all(1.0 <= s <= 1.05 for s in spreads), lines
