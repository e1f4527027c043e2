"""Checkpoints a user can trust: a damaged or mismatching checkpoint is refused before
any step with one CPConfigError naming ``schedule.resume_from``, the checkpoint and the damaged
file / first mismatching tensor, identical on every rank (``hyper-train`` exits 2)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_parallel.testing import scaled

from . import _workers as W

KW = dict(cp=2, steps=2, min_doc_len=16)


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    """One CP=2 checkpoint after 1 step (2 shard files: __0_0.distcp, __1_0.distcp)."""
    out = tmp_path_factory.mktemp("saved")
    first = ranks(2).run(W.train_losses, W.make_cfg("llama", out_dir=str(out), **KW), None, 1)
    return Path(first[0]["path"])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _flip(f: Path, at: int, n: int = 64) -> None:
    data = bytearray(f.read_bytes())
    for i in range(at, at + n):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


def _truncate(f: Path, keep: float = 0.5) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])


DAMAGE = {  # case -> (what to do to the copy, the damaged file, words in the message)
    "shard truncated": (lambda d: _truncate(d / "__1_0.distcp"), "__1_0.distcp", "truncated"),
    "shard emptied": (lambda d: (d / "__0_0.distcp").write_bytes(b""), "__0_0.distcp", "has 0 bytes"),
    "shard deleted": (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp", "is missing"),
    "shard tail flipped": (lambda d: _flip(d / "__0_0.distcp", (d / "__0_0.distcp").stat().st_size - 80),
                           "__0_0.distcp", "checksum"),
    "rank 1 shard middle flipped": (lambda d: _flip(d / "__1_0.distcp", (d / "__1_0.distcp").stat().st_size // 2),
                                    "__1_0.distcp", "checksum"),
    ".metadata deleted": (lambda d: (d / ".metadata").unlink(), ".metadata", "is missing"),
    ".metadata truncated": (lambda d: _truncate(d / ".metadata"), ".metadata", "truncated"),
    "hyper_meta empty": (lambda d: (d / "hyper_meta.json").write_text(""), "hyper_meta.json", "is empty"),
    "hyper_meta not JSON": (lambda d: (d / "hyper_meta.json").write_text("{step: 1"), "hyper_meta.json",
                            "is not JSON"),
}


def test_save_records_size_and_crc32_of_every_file(saved):
    meta = json.loads((saved / "hyper_meta.json").read_text())
    assert meta["checksum"] == "crc32" and meta["optimizer"] == "AdamW"
    assert sorted(meta["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    from hyper_parallel.trainer.checkpoint import file_checksum
    for name, rec in meta["files"].items():
        assert rec["size"] == (saved / name).stat().st_size > 0
        assert rec["crc32"] == file_checksum(saved / name)


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_is_refused_with_one_line_on_every_rank(ranks, saved, tmp_path, case):
    damage, name, words = DAMAGE[case]
    d = _copy(saved, tmp_path / "step_1")
    damage(d)
    errs = ranks(2).run(W.build_error, W.make_cfg("llama", out_dir=str(tmp_path / "run"),
                                                  schedule__resume_from=str(d), **KW))
    assert errs[0] is not None and errs[0] == errs[1], errs   # the same error on every rank
    kind, msg = errs[0]
    assert kind == "CPConfigError", errs
    assert msg.startswith("[schedule.resume_from] checkpoint ") and str(d) in msg, msg
    assert f"damaged: {name}" in msg and words in msg and "Fix: resume from an earlier" in msg, msg
    assert "\n" not in msg
    assert not (tmp_path / "run" / "train_log.json").exists()   # refused before any step


def test_intact_copy_still_resumes_exactly(ranks, saved, tmp_path):
    """The checks do not refuse a good checkpoint: a copy resumes and continues bit for bit."""
    [straight, _] = ranks(2).run(W.train_losses, W.make_cfg("llama", out_dir=str(tmp_path / "a"), **KW))
    d = _copy(saved, tmp_path / "step_1")
    second = ranks(2).run(W.train_losses, W.make_cfg("llama", out_dir=str(tmp_path / "b"),
                                                     schedule__resume_from=str(d), **KW))
    assert second[0]["step"] == 2 and second[0]["losses"] == straight["losses"][1:]


def _torchrun(args: list[str], logs: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": W.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    env.pop("HYPER_PARALLEL_TRACEBACK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(logs), "--redirects", "3", "-m", "hyper_parallel.trainer.cli",
           "examples/train_cp2.yaml", "data.seq_len=64", "logging.progress=false", "logging.plot=false", *args]
    return subprocess.run(cmd, cwd=W.ROOT, env=env, capture_output=True, text=True, timeout=scaled(300))


def _rank_stderr(logs: Path, rank: int) -> str:
    return "".join(p.read_text() for p in logs.glob(f"*/attempt_0/{rank}/stderr.log"))


def cli_refusal(tmp_path: Path, saved_run: Path, damage, *args: str) -> tuple[str, str, str]:
    """Copy a hyper-train run that saved step_1 (2 ranks, CP=2: the ``cli_saved`` fixture of
    conftest.py), ``damage(step_dir)``, resume with ``args``; asserts exit 2, no traceback anywhere,
    no step run; returns (the one line of rank 0, rank 1's stderr, torchrun's output)."""
    out = _copy(saved_run, tmp_path / "run")
    logged = json.loads((out / "train_log.json").read_text())["steps"]
    d = out / "checkpoints" / "step_1"
    damage(d)
    logs = tmp_path / "l1"
    p = _torchrun(["schedule.steps=2", f"schedule.resume_from={d}", f"logging.out_dir={out}", *args], logs)
    launcher = p.stdout + p.stderr
    assert p.returncode != 0
    # the first rank to finish exits 2; torchrun may stop the other one (SIGTERM, -15) before it does
    codes = [m.group(1) for m in re.finditer(r"rank\s*:\s*\d \(local_rank: \d\)\s*\n\s*exitcode\s*:\s*(-?\d+)",
                                             launcher)]
    assert "2" in codes and set(codes) <= {"2", "-15"}, launcher[-3000:]
    err0, err1 = _rank_stderr(logs, 0), _rank_stderr(logs, 1)
    assert "Traceback" not in err0 + err1, err0[-3000:] + err1[-3000:]
    lines = [ln for ln in err0.splitlines() if ln.startswith("hyper-train:") and "SIGTERM" not in ln]
    assert len(lines) == 1 and lines[0].startswith("hyper-train: configuration error: [schedule.resume_from]"), err0
    assert json.loads((out / "train_log.json").read_text())["steps"] == logged   # no step ran
    return lines[0], err1, launcher


def test_cli_flipped_bytes_exit_2_one_line_no_traceback(tmp_path, cli_saved):
    """hyper-train: 64 bytes flipped in the middle of rank 1's shard -> exit 2, one line, no step."""
    line, _, _ = cli_refusal(tmp_path, cli_saved,
                             lambda d: _flip(d / "__1_0.distcp", (d / "__1_0.distcp").stat().st_size // 2))
    assert f"checkpoint {tmp_path / 'run' / 'checkpoints' / 'step_1'} is damaged: __1_0.distcp fails its checksum" \
        in line, line


# ----------------------------------------------------------------------------- mismatched resume
MISMATCH = {  # case -> (config overrides of the resumed run, words in the message)
    "hidden size": (dict(model__config={"hidden_size": 32}),
                    "does not fit this model: tensor model.embed_tokens.weight has shape [256, 64] in the "
                    "checkpoint but [256, 32] in this model"),
    "more layers": (dict(model__config={"num_hidden_layers": 3}),
                    "does not fit this model: tensor model.layers.2."),
    "fewer layers": (dict(model__config={"num_hidden_layers": 1}),
                     "does not fit this model: tensor model.layers.1."),
    "architecture": (dict(model__architecture="qwen3", model__config_file=W.MODELS["qwen3"][1]),
                     "does not fit this model: tensor model.layers.0.self_attn.q_norm.weight is not in the "
                     "checkpoint (the model's shape is [16])"),
    "optimizer": (dict(optimizer__name="sgd"), "holds AdamW optimizer state but this run's optimizer is SGD"),
}


@pytest.mark.parametrize("case", list(MISMATCH))
def test_mismatched_resume_names_the_first_tensor_or_optimizer_field(ranks, saved, tmp_path, case):
    over, words = MISMATCH[case]
    errs = ranks(2).run(W.build_error, W.make_cfg("llama", out_dir=str(tmp_path / "run"),
                                                  schedule__resume_from=str(saved), **KW, **over))
    assert errs[0] is not None and errs[0] == errs[1], errs
    kind, msg = errs[0]
    assert kind == "CPConfigError" and msg.startswith(f"[schedule.resume_from] checkpoint {saved} "), msg
    assert words in msg and "Fix: resume with the " in msg and "\n" not in msg, msg


def test_optimizer_field_mismatch_without_the_recorded_class(ranks, saved, tmp_path):
    """A checkpoint without the optimizer class (older format): the first differing field is named."""
    d = _copy(saved, tmp_path / "step_1")
    meta = json.loads((d / "hyper_meta.json").read_text())
    del meta["optimizer"]
    from hyper_parallel.trainer.checkpoint import sign_meta
    (d / "hyper_meta.json").write_text(json.dumps(sign_meta(meta)))   # a consistent (signed) older manifest
    errs = ranks(2).run(W.build_error, W.make_cfg("llama", out_dir=str(tmp_path / "run"), optimizer__name="sgd",
                                                  schedule__resume_from=str(d), **KW))
    kind, msg = errs[0]
    assert kind == "CPConfigError" and errs[0] == errs[1], errs
    # the optimizer state is kept per parameter name (save.py): the first parameter's group field is named
    assert ("does not fit this optimizer: optimizer field param_groups.model.embed_tokens.weight.momentum is not in "
            "the checkpoint") in msg, msg


def test_cli_resume_with_another_hidden_size_exit_2_one_line(tmp_path, cli_saved):
    line, _, _ = cli_refusal(tmp_path, cli_saved, lambda d: None, "model.config.hidden_size=32")
    assert "does not fit this model: tensor model.embed_tokens.weight has shape [" in line, line


# ----------------------------------------------------------------------------- atomic, rotating saves
def test_atomic_rotating_saves_and_resume_latest(ranks, tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(W.ROOT + "/examples/models", ckpts / "step_1.partial")   # a stale half-written save
    [straight, _] = ranks(2).run(W.train_losses, W.make_cfg("llama", out_dir=str(tmp_path / "a"),
                                                            **{**KW, "steps": 4}))
    first = ranks(2).run(W.train_losses, W.make_cfg("llama", out_dir=str(out), schedule__save_every=1,
                                                    schedule__keep_last=2, **{**KW, "steps": 3}))
    assert first[0]["step"] == 3
    # every save renamed into place, the stale temporary cleared, only the newest 2 kept
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_3"]
    assert json.loads((ckpts / "step_3" / "hyper_meta.json").read_text())["step"] == 3
    # a half-written newer save (even one holding a hyper_meta.json) is never picked by 'latest'
    shutil.copytree(ckpts / "step_3", ckpts / "step_9.partial")
    second = ranks(2).run(W.train_losses, W.make_cfg("llama", out_dir=str(out), schedule__resume_from="latest",
                                                     **{**KW, "steps": 4}))
    assert second[0]["step"] == 4 and second[0]["position"] == 4
    assert second[0]["losses"] == straight["losses"][3:] == second[1]["losses"]   # resumed from step_3, exact
    # naming the interrupted save says so
    errs = ranks(2).run(W.build_error, W.make_cfg("llama", out_dir=str(out), schedule__resume_from=str(ckpts / "step_9"),
                                                  **KW))
    assert errs[0] == errs[1] and errs[0][0] == "CPConfigError", errs
    assert f"checkpoint {ckpts / 'step_9'} was never completed: its save was interrupted" in errs[0][1], errs


def test_resume_latest_without_a_checkpoint_is_refused(ranks, tmp_path):
    (tmp_path / "ck" / "step_5.partial").mkdir(parents=True)
    errs = ranks(2).run(W.build_error, W.make_cfg("llama", out_dir=str(tmp_path / "run"), schedule__resume_from="latest",
                                                  schedule__checkpoint_dir=str(tmp_path / "ck"), **KW))
    assert errs[0] == errs[1] and errs[0][0] == "CPConfigError", errs
    msg = errs[0][1]
    assert msg.startswith("[schedule.resume_from] 'latest' found no complete checkpoint") and str(tmp_path / "ck") in msg
    assert "Fix: set schedule.checkpoint_dir" in msg, msg


# ----------------------------------------------------------------------------- a run log that survives a crash
def test_run_log_jsonl_survives_a_crash_and_rebuilds(tmp_path):
    """hyper-train (1 process) killed (SIGKILL) at step 3 without save_every: train_log.jsonl holds the meta
    line and steps 1-2, flushed; the JSON summary and the PNG are rebuilt from it."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": W.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "HYPER_PARALLEL_FAULT_INJECT": "rank=0,step=3,kind=kill"}
    cmd = [sys.executable, "-m", "hyper_parallel.trainer.cli", "examples/train_cp1.yaml", "schedule.steps=5",
           "data.seq_len=64", "logging.progress=false", f"logging.out_dir={out}"]
    p = subprocess.run(cmd, cwd=W.ROOT, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert p.returncode == -9, p.stderr[-3000:]
    assert not (out / "train_log.json").exists()   # the summary was never written: only the stream survives
    from hyper_parallel.trainer.metrics import read_jsonl
    meta, steps = read_jsonl(out / "train_log.jsonl")
    assert meta["topology"]["cp_size"] == 1 and [r["step"] for r in steps] == [1, 2]
    assert all(isinstance(r["loss"], float) and "peak_mem_gb_per_rank" in r for r in steps)
    r = subprocess.run([sys.executable, "-m", "hyper_parallel.trainer.metrics", str(out)], cwd=W.ROOT, env=env,
                       capture_output=True, text=True, timeout=scaled(120))
    assert r.returncode == 0 and "2 steps" in r.stdout, r.stderr
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == steps and log["meta"] == meta
    assert (out / "loss_curve.png").stat().st_size > 1000


def test_run_log_jsonl_matches_the_summary_across_a_resume(ranks, tmp_path):
    out = tmp_path / "run"
    cfg = dict(KW, cp=1, steps=4)
    [first] = ranks(1).run(W.train_losses, W.make_cfg("llama", out_dir=str(out), **cfg), None, 2)
    # a crash after step 3 would leave a step the checkpoint does not cover: the resume drops it
    with open(out / "train_log.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 3, "loss": 99.0}) + "\n" + '{"step": 4, "lo')   # and a torn line
    [second] = ranks(1).run(W.train_losses, W.make_cfg("llama", out_dir=str(out), schedule__resume_from=first["path"],
                                                        **cfg))
    from hyper_parallel.trainer.metrics import read_jsonl
    _, steps = read_jsonl(out / "train_log.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["loss"] for r in steps] == first["losses"] + second["losses"]   # exact (JSON float round trip)
    assert json.loads((out / "train_log.json").read_text())["steps"] == steps


# ----------------------------------------------------------------------------- output paths, before the first step
def _file(p: Path) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("not a directory")
    return p


OUTPUTS = {  # case -> (make the bad path under tmp, overrides, words)
    "out_dir is a file": (lambda t: _file(t / "f"), lambda t: dict(out_dir=str(t / "f")),
                          "[logging.out_dir] ", "cannot be a directory: {t}/f is a file"),
    "out_dir under a file": (lambda t: _file(t / "f"), lambda t: dict(out_dir=str(t / "f" / "run")),
                             "[logging.out_dir] ", "is a file"),
    "json_log is a directory": (lambda t: (t / "run" / "log.json").mkdir(parents=True),
                                lambda t: dict(out_dir=str(t / "run"), logging__json_log="log.json"),
                                "[logging.json_log] ", "{t}/run/log.json is a directory"),
    "json_log folder under a file": (lambda t: _file(t / "run" / "f"),
                                     lambda t: dict(out_dir=str(t / "run"), logging__json_log="f/log.json"),
                                     "[logging.json_log] ", "{t}/run/f is a file"),
    "plot_file unknown format": (lambda t: None,
                                 lambda t: dict(out_dir=str(t / "run"), logging__plot=True, logging__plot_file="c.xyz"),
                                 "[logging.plot_file] ", "'c.xyz' has an image format matplotlib cannot write ('xyz'"),
    "checkpoint_dir is a file": (lambda t: _file(t / "ck"),
                                 lambda t: dict(out_dir=str(t / "run"), schedule__save_every=1,
                                                schedule__checkpoint_dir=str(t / "ck")),
                                 "[schedule.checkpoint_dir] ", "is a file"),
}


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_bad_output_path_is_refused_before_any_step(ranks, tmp_path, case):
    make, over, field, words = OUTPUTS[case]
    make(tmp_path)
    errs = ranks(2).run(W.build_error, W.make_cfg("llama", **{**KW, **over(tmp_path)}))
    assert errs[0] is not None and errs[0] == errs[1], errs
    kind, msg = errs[0]
    assert kind == "CPConfigError" and msg.startswith(field), msg
    assert words.format(t=tmp_path) in msg and ". Fix: " in msg and "\n" not in msg, msg


def test_output_folders_are_created_up_front(ranks, tmp_path):
    over = dict(out_dir=str(tmp_path / "run"), logging__json_log="logs/l.json", logging__plot=True,
                logging__plot_file="plots/c.svg")
    assert ranks(2).run(W.build_error, W.make_cfg("llama", **{**KW, **over})) == [None, None]
    assert (tmp_path / "run" / "logs").is_dir() and (tmp_path / "run" / "plots").is_dir()


def test_cli_unknown_plot_format_exit_2_before_training(tmp_path, monkeypatch, capsys):
    """In-process ``cli.main`` (one rank, no launcher): the plot file's format is checked before step 1."""
    from hyper_parallel.trainer import cli

    out = tmp_path / "run"
    monkeypatch.chdir(W.ROOT)
    code = cli.main(["examples/train_cp1.yaml", "schedule.steps=2", "data.seq_len=64", "logging.progress=false",
                     f"logging.out_dir={out}", "logging.plot_file=curve.xyz"])
    stdout, stderr = capsys.readouterr()
    assert code == 2, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("hyper-train:")]
    assert len(lines) == 1 and lines[0].startswith("hyper-train: configuration error: [logging.plot_file] "), stderr
    assert "Traceback" not in stderr and "step 1/" not in stdout
    assert not (out / "train_log.jsonl").exists()


def test_tensorboard_event_files_hold_every_step(ranks, tmp_path):
    """logging.tensorboard: rank 0 writes loss, lr, tokens/s, grad norm and peak memory per step under
    <out_dir>/tensorboard; read back with TensorBoard's own reader they equal the JSONL step records."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hyper_parallel.trainer.metrics import TENSORBOARD_SCALARS, read_jsonl

    out = tmp_path / "run"
    ranks(2).run(W.train_losses, W.make_cfg("llama", out_dir=str(out), logging__tensorboard=True, **{**KW, "steps": 3}))
    _, steps = read_jsonl(out / "train_log.jsonl")
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/grad_norm", "train/peak_mem_gb"} <= tags, tags
    for key, tag in TENSORBOARD_SCALARS.items():
        if tag not in tags:
            continue
        points = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [p[0] for p in points] == [1, 2, 3], (tag, points)
        for (step, value), rec in zip(points, steps):
            assert abs(value - rec[key]) <= 1e-6 * max(1.0, abs(rec[key])), (tag, step, value, rec[key])
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1   # rank 0 only
