"""Checkpoints a user can trust completely: the manifest signs itself, ``latest`` falls back to
the newest intact checkpoint and says so, an unsigned (legacy) manifest needs an opt-in by name,
an orphaned rank commits nothing. Real CP=2 runs on 2 gloo ranks; every refusal is one line, the
same on every rank, before any step."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hyper_parallel.testing import scaled

from . import _workers as W
from .test_checkpoint_failures import KW, _flip


@pytest.fixture(scope="module")
def three(ranks, tmp_path_factory):
    """A CP=2 run of 3 steps saving after every step: checkpoints/step_1..3 and the 3 losses."""
    out = tmp_path_factory.mktemp("three")
    [r, _] = ranks(2).run(W.train_losses, W.make_cfg("llama", out_dir=str(out), schedule__save_every=1,
                                                      **{**KW, "steps": 3}))
    return out / "checkpoints", r["losses"]


def _meta(d: Path) -> dict:
    return json.loads((d / "hyper_meta.json").read_text())


def _write_meta(d: Path, meta: dict) -> None:
    (d / "hyper_meta.json").write_text(json.dumps(meta))


def _refusal(ranks, tmp_path, resume, **over) -> str:
    errs = ranks(2).run(W.build_error, W.make_cfg("llama", out_dir=str(tmp_path / "run"),
                                                  schedule__resume_from=str(resume), **KW, **over))
    assert errs[0] is not None and errs[0] == errs[1], errs   # the same error on every rank
    kind, msg = errs[0]
    assert kind == "CPConfigError" and msg.startswith("[schedule.resume_from] ") and "\n" not in msg, errs
    assert not (tmp_path / "run" / "train_log.json").exists()   # refused before any step
    return msg


def test_manifest_signs_every_field(three):
    from hyper_parallel.trainer.checkpoint import SIGNATURE, meta_digest

    meta = _meta(three[0] / "step_1")
    assert meta[SIGNATURE] == meta_digest(meta) and len(meta[SIGNATURE]) == 64
    assert sorted(meta["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for edit in ({"files": None}, {"step": 2}, {"data_position": 0}, {"optimizer": "SGD"}):
        assert meta_digest({**meta, **edit}) != meta[SIGNATURE], edit


def test_removed_file_list_and_flipped_shard_are_refused(ranks, three, tmp_path):
    """The issue's attack: drop ``files`` from hyper_meta.json, flip 16 bytes of a shard."""
    d = shutil.copytree(three[0] / "step_1", tmp_path / "step_1")
    meta = _meta(d)
    del meta["files"]
    _write_meta(d, meta)
    _flip(d / "__1_0.distcp", (d / "__1_0.distcp").stat().st_size // 2, 16)
    msg = _refusal(ranks, tmp_path, d)
    assert f"checkpoint {d} is damaged: hyper_meta.json fails its own checksum (meta_sha256 " in msg, msg
    assert "edited or damaged after the save" in msg and "Fix: resume from an earlier" in msg, msg


def test_unsigned_legacy_manifest_needs_the_opt_in(ranks, three, tmp_path):
    d = shutil.copytree(three[0] / "step_2", tmp_path / "step_2")
    meta = _meta(d)
    del meta["meta_sha256"]
    _write_meta(d, meta)
    msg = _refusal(ranks, tmp_path, d)
    assert f"checkpoint {d}: hyper_meta.json has no checksum of its own" in msg, msg
    assert "Fix: set schedule.allow_unverified_checkpoint: true to load it anyway" in msg, msg
    # opted in by name: loads (its recorded files still checked) and continues exactly
    [r, _] = ranks(2).run(W.train_losses, W.make_cfg("llama", out_dir=str(tmp_path / "ok"), schedule__resume_from=str(d),
                                                      schedule__allow_unverified_checkpoint=True, **{**KW, "steps": 3}))
    assert r["losses"] == three[1][2:], (r["losses"], three[1])
    # ... but a damaged file of it is still refused
    _flip(d / "__0_0.distcp", 200, 16)
    msg = _refusal(ranks, tmp_path, d, schedule__allow_unverified_checkpoint=True)
    assert "is damaged: __0_0.distcp fails its checksum" in msg, msg


def resume_latest(cfg: dict) -> dict:
    """Resume ``latest``; returns the loaded directory, the skipped ones, the losses and rank 0's log."""
    import logging

    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.text import TextTrainer

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("hyper_parallel.trainer")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        trainer = TextTrainer(TrainerConfig.from_dict(cfg))
        res = trainer.train()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    meta = trainer._resume_meta
    return {"path": meta["path"], "skipped": meta["skipped"], "losses": [r.loss for r in res],
            "log": [ln for ln in lines if ln.startswith("resume_from latest")]}


def test_latest_skips_a_damaged_newest_checkpoint_and_says_so(ranks, three, tmp_path):
    ck = shutil.copytree(three[0], tmp_path / "checkpoints")
    _flip(ck / "step_3" / "__1_0.distcp", (ck / "step_3" / "__1_0.distcp").stat().st_size // 2, 16)
    res = ranks(2).run(resume_latest, W.make_cfg("llama", out_dir=str(tmp_path / "run"), schedule__resume_from="latest",
                                                 schedule__checkpoint_dir=str(ck), **{**KW, "steps": 3}))
    for r in res:   # every rank loaded step_2 and continued exactly
        assert r["path"] == str(ck / "step_2") and r["losses"] == three[1][2:], r
        assert len(r["skipped"]) == 1 and r["skipped"][0][0] == str(ck / "step_3"), r
        assert "__1_0.distcp fails its checksum" in r["skipped"][0][1], r
    print("rank 0 log:", res[0]["log"])
    assert res[0]["log"][0].startswith(f"resume_from latest: skipping {ck / 'step_3'}: checkpoint ")
    assert res[0]["log"][1].startswith(f"resume_from latest: loading {ck / 'step_2'} (step 2), the newest intact "
                                       "checkpoint (skipped 1 damaged newer checkpoint(s)"), res[0]["log"]
    assert res[1]["log"] == []   # rank 0 says it once


def test_latest_with_every_checkpoint_damaged_is_refused(ranks, three, tmp_path):
    ck = shutil.copytree(three[0], tmp_path / "checkpoints")
    for d in ck.iterdir():
        (d / ".metadata").unlink()
    msg = _refusal(ranks, tmp_path, "latest", schedule__checkpoint_dir=str(ck))
    assert msg.startswith(f"[schedule.resume_from] 'latest': every checkpoint in {ck} is damaged (newest: "), msg


def test_orphaned_rank_stops_at_the_next_write_point(tmp_path):
    """stop_if_launcher_gone (called before each step, step record and checkpoint commit): once the
    launcher is gone the rank exits 129 with one line, even when the watch thread has not polled yet."""
    child = textwrap.dedent("""
        import os, sys, time
        from hyper_parallel.platform.shutdown import install_parent_watch, stop_if_launcher_gone
        assert install_parent_watch("hyper-train: ", lambda: 0, interval_s=3600)
        parent = os.getppid()
        stop_if_launcher_gone()                 # the launcher is alive: returns
        sys.stdout.write("ready\\n"); sys.stdout.flush()
        while os.getppid() == parent:
            time.sleep(0.01)
        stop_if_launcher_gone()                 # gone: never returns
        open(sys.argv[1], "w").write("written after the launcher died")
    """)
    launcher = textwrap.dedent("""
        import subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE,
                             stderr=open(sys.argv[3], "w"), text=True)
        print(p.pid, flush=True)
        p.stdout.readline()                     # the child is watching
    """)   # then the launcher exits, orphaning the child
    marker, err = tmp_path / "marker", tmp_path / "stderr"
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "PYTHONPATH": W.ROOT}
    out = subprocess.run([sys.executable, "-c", launcher, child, str(marker), str(err)], env=env, capture_output=True,
                         text=True, timeout=scaled(60))
    pid = int(out.stdout.split()[0])
    import time
    t0 = time.monotonic()
    while time.monotonic() - t0 < scaled(30) and os.path.exists(f"/proc/{pid}") and \
            Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        time.sleep(0.05)
    assert not marker.exists(), "the orphan wrote after its launcher died"
    lines = err.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyper-train: rank 0: the launcher (pid ") and \
        "is gone - stopping now, writing nothing more" in lines[0], lines
