"""A NaN/Inf loss or gradient norm never reaches the weights: ``schedule.on_nonfinite: stop``
(default) ends the run at that step naming the step, the last good checkpoint and the fix;
``skip`` skips the update (logged in the JSONL), bounded by ``schedule.max_nonfinite_skips``;
every rank takes the same decision at the same step."""
from __future__ import annotations

import json

import pytest

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.trainer.config import TrainerConfig

from . import _nonfinite_workers as NW
from . import _workers as W


def _cfg(tmp_path, **extra):
    return W.make_cfg("llama", steps=3, seq_len=32, micro_batch_size=1, plan=False, out_dir=str(tmp_path / "run"),
                      **extra)


def _jsonl(tmp_path) -> list[dict]:
    lines = (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


def test_stop_names_the_step_the_checkpoint_state_and_the_fix(tmp_path):
    out = NW.train_until_error(_cfg(tmp_path), nan_steps=(2,))
    name, step, message = out["error"]
    assert (name, step, out["step"]) == ("NonFiniteError", 2, 2)
    assert "training stopped at step 2" in message and "none saved yet" in message
    for fix in ("optimizer.lr", "optimizer.grad_clip", "bf16", "schedule.on_nonfinite: skip"):
        assert fix in message, fix
    assert out["unchanged"] and out["finite"], "the NaN step must not update the weights"
    last = _jsonl(tmp_path)[-1]
    assert last["step"] == 2 and last["nonfinite"] and last["stopped"]


def test_stop_names_the_last_saved_checkpoint(tmp_path):
    cfg = _cfg(tmp_path, schedule__save_every=1)
    out = NW.train_until_error(cfg, nan_steps=(3,))
    assert out["error"][1] == 3
    assert str(tmp_path / "run" / "checkpoints" / "step_2") in out["error"][2]


def test_skip_applies_no_update_logs_each_skip_and_is_bounded(tmp_path):
    cfg = _cfg(tmp_path, schedule__on_nonfinite="skip", schedule__max_nonfinite_skips=1, schedule__steps=4,
               schedule__warmup_steps=4)
    out = NW.train_until_error(cfg, nan_steps=(2,))
    assert out["error"] is None and out["step"] == 4 and out["finite"]
    records = _jsonl(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[1]["skipped"] and records[1]["nonfinite"] and records[1]["skips"] == 1
    assert not any(r.get("skipped") for r in records[:1] + records[2:])
    # the LR schedule advances with the step number: the skipped step does not shift it
    assert [r["lr"] for r in records] == pytest.approx([1e-3 * k / 4 for k in (1, 2, 3, 4)])
    # the second non-finite step exceeds the bound: the run stops there
    out = NW.train_until_error(dict(cfg, logging=dict(cfg["logging"], out_dir=str(tmp_path / "b"))),
                               nan_steps=(2, 3))
    assert out["error"][1] == 3 and "after 1 skipped non-finite step(s)" in out["error"][2]
    assert out["unchanged"]


def test_skipped_step_leaves_the_weights_as_they_were(tmp_path):
    cfg = _cfg(tmp_path, schedule__on_nonfinite="skip", schedule__steps=2)
    out = NW.train_until_error(cfg, nan_steps=(2,))
    assert out["error"] is None and out["unchanged"] and out["step"] == 2


def test_every_rank_stops_at_the_same_step_when_one_rank_sees_nan(ranks, tmp_path):
    cfg = W.make_cfg("llama", cp=2, steps=3, seq_len=32, micro_batch_size=1, out_dir=str(tmp_path / "run"))
    outs = ranks(2).run(NW.train_until_error, cfg, (2,), (1,))
    assert [o["error"][:2] for o in outs] == [("NonFiniteError", 2)] * 2, outs
    assert all(o["unchanged"] for o in outs)


def test_max_nonfinite_skips_needs_skip():
    with pytest.raises(CPConfigError) as ei:
        TrainerConfig.from_dict({"schedule": {"max_nonfinite_skips": 5}})
    assert ei.value.field == "schedule.max_nonfinite_skips"
    with pytest.raises(CPConfigError) as ei:
        TrainerConfig.from_dict({"schedule": {"on_nonfinite": "ignore"}})
    assert ei.value.field == "schedule.on_nonfinite"


def test_cli_exits_4_without_a_done_line(tmp_path, capsys):
    """A diverging run (lr 1e30, no clipping) ends with the stop line, not ``done: ... -> nan``."""
    from hyper_parallel.trainer.cli import NONFINITE_EXIT, main

    code = main([W.ROOT + "/examples/train_cp1.yaml", "optimizer.name=sgd", "optimizer.lr=1e30",
                 "optimizer.grad_clip=null", "schedule.steps=4", "schedule.warmup_steps=0", "data.seq_len=32",
                 f"logging.out_dir={tmp_path / 'run'}", "logging.plot=false", "logging.progress=false",
                 f"data.path={W.CORPUS}", f"model.config_file={W.MODELS['llama'][1]}"])
    captured = capsys.readouterr()
    assert code == NONFINITE_EXIT, captured.err[-2000:]
    assert "done:" not in captured.out
    assert "hyper-train: training stopped at step" in captured.err and "Last good checkpoint: none saved yet" \
        in captured.err


def test_cli_skip_reports_the_skips_and_the_last_applied_loss(tmp_path, capsys):
    """With on_nonfinite: skip the done line counts the skipped steps and never ends in nan."""
    from hyper_parallel.trainer.cli import main

    code = main([W.ROOT + "/examples/train_cp1.yaml", "optimizer.name=sgd", "optimizer.lr=1e30",
                 "optimizer.grad_clip=null", "schedule.steps=3", "schedule.warmup_steps=0",
                 "schedule.on_nonfinite=skip", "schedule.max_nonfinite_skips=5", "data.seq_len=32",
                 f"logging.out_dir={tmp_path / 'run'}", "logging.plot=false", "logging.progress=false",
                 f"data.path={W.CORPUS}", f"model.config_file={W.MODELS['llama'][1]}"])
    out = capsys.readouterr().out
    assert code == 0 and "done: 3 steps (2 non-finite step(s) skipped" in out, out[-2000:]
    done = next(line for line in out.splitlines() if line.startswith("done:"))
    assert "nan" not in done.lower().replace("non-finite", ""), done
