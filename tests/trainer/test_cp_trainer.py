"""CP>1 trainer lifecycle: checkpoint resume with CP=2, CP-size mismatch, MoE, the torchrun CLI."""
from __future__ import annotations

import json
import os

from . import _workers as W
from .test_parity import run_parity


def test_cp2_resume_continues_the_loss_curve_exactly(ranks, tmp_path):
    kw = dict(cp=2, steps=4, warmup=2, min_doc_len=16)
    [straight, _] = ranks(2).run(W.train_losses, W.make_cfg("llama", out_dir=str(tmp_path / "a"), **kw))
    first = ranks(2).run(W.train_losses, W.make_cfg("llama", out_dir=str(tmp_path / "b"), **kw), None, 2)
    path = first[0]["path"]
    assert first[0]["step"] == 2 and first[1]["path"] == path
    meta = json.loads(open(os.path.join(path, "hyper_meta.json")).read())
    assert meta["topology"] == {"pp": 1, "cp_size": 2, "dp_shard": 1, "dp_replicate": 1, "tp": 1, "world_size": 2}
    second = ranks(2).run(W.train_losses, W.make_cfg("llama", out_dir=str(tmp_path / "b"),
                                                     schedule__resume_from=path, **kw))
    assert second[0]["step"] == 4 and second[0]["position"] == 4
    assert first[0]["losses"] + second[0]["losses"] == straight["losses"]
    assert second[0]["losses"] == second[1]["losses"]
    # another CP size reshards (tests/trainer/test_resume_topology.py); another TP size is refused up front,
    # naming the field and both sizes
    errs = ranks(2).run(W.build_error, W.make_cfg("llama", cp=1, tp=2, schedule__resume_from=path))
    assert all(e[0] == "CPConfigError" and "tp_size=1" in e[1] and "tp_size=2" in e[1] for e in errs), errs


def test_qwen3_moe_colossal_cp2_parity(ranks):
    run_parity(ranks, "qwen3_moe", dict(cp=2, method="colossal"))


def test_torchrun_cli_cp2_end_to_end(cli_run):
    """The main job's command, shortened (the ``cli_run`` session fixture: torchrun 2 ranks, CP=2, 3
    steps): the resolved plan printed, progress bar, JSON log + PNG, a checkpoint per step."""
    out, p = cli_run
    assert "cp_mesh ranks=[0, 1]" in p.stdout and "sdpa_hf_cp_wrapper [colossal, sync]" in p.stdout
    assert "tok/s=" in p.stderr  # tqdm bar (rank 0) shows loss and tokens/s
    log = json.loads((out / "train_log.json").read_text())
    assert [r["step"] for r in log["steps"]] == [1, 2, 3]
    assert log["meta"]["topology"]["cp_size"] == 2 and log["meta"]["cp_policy"] == "all_gather"
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert sorted(d.name for d in (out / "checkpoints").iterdir() if d.name.startswith("step_")) == \
        ["step_1", "step_2", "step_3"]
