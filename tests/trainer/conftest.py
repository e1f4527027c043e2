"""Fixtures shared by the trainer's CLI tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_parallel.testing import scaled

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli_shell(monkeypatch):
    """``cli.main`` called in-process as from a shell in the repository root that is no launcher's
    worker (relative config paths resolve; no torchrun / hyper-train rank variables)."""
    from hyper_parallel.trainer import failures

    monkeypatch.chdir(ROOT)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", failures.LAUNCHED_ENV):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="session")
def cli_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The main job's command, shortened, run once for every CLI test that needs a real run:
    ``torchrun --nproc-per-node 2 -m hyper_parallel.trainer.cli examples/train_cp2.yaml`` (CP=2, seq 64,
    3 steps, progress bar on, a checkpoint after every step): (its out_dir, the finished process).
    Tests read its output and checkpoints, or copy the directory before changing anything in it (one
    launch instead of one per test: each costs a launcher and two rank start-ups)."""
    out = tmp_path_factory.mktemp("cli_saved") / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    env.pop("HYPER_PARALLEL_TRACEBACK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "hyper_parallel.trainer.cli",
           "examples/train_cp2.yaml", "schedule.steps=3", "schedule.save_every=1", "data.seq_len=64",
           f"logging.out_dir={out}"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return out, p


@pytest.fixture(scope="session")
def cli_saved(cli_run) -> Path:
    """The out_dir of :func:`cli_run` (checkpoints step_1 .. step_3)."""
    return cli_run[0]
