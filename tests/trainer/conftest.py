"""Fixtures shared by the trainer's CLI tests."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cli_saved(tmp_path_factory) -> Path:
    """One ``hyper-train`` run under torchrun (examples/train_cp2.yaml: 2 ranks, CP=2, seq 64) that
    trained and saved step 1: its out_dir. Tests read its checkpoint or copy the directory before
    changing anything in it (one launch instead of one per test: each costs two rank start-ups)."""
    from .test_checkpoint_failures import _torchrun

    out = tmp_path_factory.mktemp("cli_saved") / "run"
    p = _torchrun(["schedule.steps=1", "schedule.save_every=1", f"logging.out_dir={out}"], out.parent / "l0")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return out
