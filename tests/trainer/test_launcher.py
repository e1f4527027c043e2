"""``hyper-train`` launching its own ranks (trainer/launch.py, trainer/failures.py): the config is
checked once in the parent (a refusal starts no rank), N comes from the config's sizes, the ranks
are started by torch's elastic launch API, and a failure is one line per root cause with no
launcher traceback: exit 2 for configuration/data errors, 1 for others. Real processes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hyper_parallel.distributed.errors import CPConfigError
from hyper_parallel.testing import scaled
from hyper_parallel.trainer import failures, start_method
from hyper_parallel.trainer.cli import load_config
from hyper_parallel.trainer.launch import check_before_launch, world_size_of

ROOT = Path(__file__).resolve().parents[2]
TINY = ["schedule.steps=3", "schedule.warmup_steps=0", "data.seq_len=64", "data.micro_batch_size=1",
        "logging.progress=false", "logging.plot=false"]
FAILURE_BOUND_S = 20   # x HYPER_PARALLEL_TEST_TIMEOUT_SCALE: from one rank's error to the launcher's exit


def _hyper_train(args: list, *, env: dict | None = None) -> subprocess.CompletedProcess:
    """``hyper-train ARGS`` (the console script's ``main``) from a shell that is no torchrun worker."""
    full = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "HYPER_PARALLEL_TRACEBACK", failures.LAUNCHED_ENV):
        full.pop(key, None)
    return subprocess.run([sys.executable, "-m", "hyper_parallel.trainer.cli", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=scaled(300))


def _lines(text: str) -> list[str]:
    """The lines of ``text`` other than log records (``INFO name: ...``) and Python warnings."""
    return [ln for ln in text.splitlines() if ln.strip() and "UserWarning" not in ln
            and "_register_pre_backward_hook" not in ln and not ln.startswith(("INFO ", "DEBUG "))]


def test_rank_count_defaults_to_the_config_sizes():
    """No ``--nproc-per-node``: the product of the sizes (cp 2 -> 2, tp 2 x cp 2 -> 4); a count that
    does not fit them is refused naming the count the config needs."""
    for example, n in (("train_cp2", 2), ("train_tp2_cp2", 4), ("train_cp1", 1)):
        assert world_size_of(load_config([str(ROOT / "examples" / f"{example}.yaml")])) == n
    with pytest.raises(CPConfigError, match=r"world_size = 3 \(--nproc-per-node 3\).*--nproc-per-node 2"):
        check_before_launch([str(ROOT / "examples/train_cp2.yaml")], 3)


REFUSED_IN_THE_PARENT = [
    (["optimizer.eps=-1"], "optimizer.eps"),
    (["data.pad_token_id=1000000"], "data.pad_token_id"),     # hung in the preflight's collective once
    (["data.path=no/such/corpus.txt"], "data.path"),          # a data error: exit 2 too
    (["--nproc-per-node", "3"], "accelerator"),
    # needs the model: checked on the meta device in the parent (ranks took 27-49 s to say it)
    (["model.architecture=qwen3_moe", "model.config_file=examples/models/tiny_qwen3_moe.yaml",
      "schedule.tiled_mlp=true"], "schedule.tiled_mlp"),
]


@pytest.mark.parametrize("args,field", REFUSED_IN_THE_PARENT, ids=["bound", "pad-id", "data-file", "nproc",
                                                                  "model-tiled-mlp"])
def test_bad_config_is_refused_in_the_parent_exit_2_one_line(tmp_path, cli_shell, capsys, args, field):
    """Refused before any rank starts: exit 2, no mesh line, no output folder, <= 2 lines, no traceback.
    In-process (``cli.main``, the console script's function, from the repository root); the console
    script as its own process is :func:`test_a_refusal_from_the_console_script_is_exit_2_one_line`."""
    from hyper_parallel.trainer import cli

    t0 = time.time()
    code = cli.main(["examples/train_cp2.yaml", *args, f"logging.out_dir={tmp_path / 'run'}"])
    took = time.time() - t0
    out, err_text = capsys.readouterr()
    assert code == 2, out[-2000:] + err_text[-3000:]
    err = _lines(err_text)
    assert 1 <= len(err) <= 2 and err[0].startswith(f"hyper-train: configuration error: [{field}]"), err_text
    assert "Traceback" not in err_text + out and "mesh:" not in out
    assert not (tmp_path / "run").exists()
    print(f"refused in {took:.1f} s: {err[0][:100]}")


def test_a_refusal_from_the_console_script_is_exit_2_one_line(tmp_path):
    """The same refusal through a real ``hyper-train`` process: exit status 2, one stderr line."""
    p = _hyper_train(["examples/train_cp2.yaml", "optimizer.eps=-1", f"logging.out_dir={tmp_path / 'run'}"])
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    err = _lines(p.stderr)
    assert len(err) == 1 and err[0].startswith("hyper-train: configuration error: [optimizer.eps]"), p.stderr
    assert "Traceback" not in p.stderr + p.stdout and "mesh:" not in p.stdout
    assert not (tmp_path / "run").exists()


def test_bad_option_exit_2(capsys):
    from hyper_parallel.trainer import cli

    assert cli.main(["examples/train_cp2.yaml", "--nproc-per-node", "x"]) == 2
    assert "--nproc-per-node needs a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("step,at", [(2, "step"), (1, "setup")], ids=["before-step-2", "set-up"])
def test_an_error_on_one_rank_stops_every_rank_within_seconds_with_its_message(tmp_path, step, at):
    """Rank 1 raises before step 2 / during set-up (the fault hook's stand-in for bad data on one
    rank): the launcher exits within FAILURE_BOUND_S of that error, printing rank 1's line only
    (rank 0's consequent peer failure or SIGTERM is not a root cause), exit 1, no traceback, no SIGABRT."""
    out = tmp_path / "run"
    p = _hyper_train(["examples/train_cp2.yaml", *TINY, f"logging.out_dir={out}",
                      "accelerator.comm_timeout_s=300"],
                     env={"HYPER_PARALLEL_FAULT_INJECT": f"rank=1,step={step},kind=raise,at={at}"})
    done = time.time()
    err = _lines(p.stderr)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-3000:]
    assert len(err) == 1 and err[0].startswith("hyper-train: rank 1: InjectedFault: injected fault on rank 1 "
                                               f"at step {step} ({at})"), p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "terminate called" not in p.stderr + p.stdout
    log = out / "error_rank1.log"
    assert "InjectedFault" in log.read_text()   # the traceback kept for whoever needs it
    took = done - log.stat().st_mtime
    print(f"one-rank error ({at}) -> every rank stopped and the launcher exited in {took:.1f} s "
          f"(bound {scaled(FAILURE_BOUND_S):.0f} s; comm_timeout_s 300)")
    assert took < scaled(FAILURE_BOUND_S)


def test_forked_ranks_a_peer_stopped_by_the_launcher_adds_no_line():
    """Forked ranks: rank 1 fails while rank 0 is still running, so torch's process context stops
    rank 0 with SIGTERM (and would log "Terminating process P via signal SIGTERM"): the parent prints
    rank 1's line only, exit 1. Deterministic stand-in for a survivor that is slow to notice its
    peer's failure (a loaded host)."""
    code = ("import sys; from hyper_parallel.trainer.launch import launch; "
            "from tests.trainer._launch_workers import one_bad_rank_one_slow_peer as w; "
            "sys.exit(launch(['bad row'], 2, 'fork', worker=w))")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "LOGLEVEL", failures.LAUNCHED_ENV):
        env.pop(key, None)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=scaled(120))
    print(p.stderr)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-3000:]
    assert _lines(p.stderr) == ["hyper-train: rank 1: ValueError: bad row"], p.stderr


def _failure(tmp_path: Path, monkeypatch, rank: int, exitcode: int, recorded: tuple | None):
    """torchelastic's ProcessFailure of a rank that exited with ``exitcode`` after
    ``failures.record_failure(*recorded)`` (None: no error file, e.g. killed by a signal)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error{rank}_{exitcode}.json"
    if recorded is not None:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        monkeypatch.setenv(failures.LAUNCHED_ENV, "1")   # recorded, not printed
        failures.record_failure(*recorded, rank)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_summary_one_line_per_root_cause(tmp_path, monkeypatch, capsys):
    cfg = "hyper-train: configuration error: [data.files] 'x' matches no file"
    lines, code = failures.summarise({r: _failure(tmp_path, monkeypatch, r, 2, (cfg, 2, failures.CONFIG))
                                      for r in (0, 1)}, 2)
    assert (lines, code) == ([cfg], 2)    # the same error on every rank: once, no rank named
    bad = "hyper-train: rank 1: ValueError: bad row"
    peer = "hyper-train: rank 0: collective all_gather failed - likely cause: peer rank 1 died"
    lines, code = failures.summarise({0: _failure(tmp_path, monkeypatch, 0, 3, (peer, 3, failures.PEER)),
                                      1: _failure(tmp_path, monkeypatch, 1, 1, (bad, 1, failures.ERROR))}, 2)
    assert (lines, code) == ([bad], 1)    # the peer failure is a consequence
    lines, code = failures.summarise({0: _failure(tmp_path, monkeypatch, 0, -9, None),
                                      1: _failure(tmp_path, monkeypatch, 1, -15, None)}, 2)
    assert code == 1 and lines == ["hyper-train: rank 0: the process was killed by SIGKILL (killed: out of "
                                   "memory, or by hand?)"], lines
    nan = "hyper-train: step 3: loss nan, grad norm nan - training stopped"
    lines, code = failures.summarise({r: _failure(tmp_path, monkeypatch, r, 4, (nan, 4, failures.NONFINITE))
                                      for r in (0, 1)}, 2)
    assert (lines, code) == ([nan], 4)
    assert capsys.readouterr().err == ""   # started by hyper-train: a rank prints nothing itself


def _launched_losses(tmp_path: Path, method: str) -> tuple[list, str, int, str]:
    """A 3-step run started with ``HYPER_PARALLEL_START_METHOD=method`` that saves step 3:
    (losses, stderr, launcher pid, stdout)."""
    out = tmp_path / method
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", start_method.ENV: method}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                failures.LAUNCHED_ENV):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-m", "hyper_parallel.trainer.cli", "examples/train_cp2.yaml", *TINY,
                             "schedule.save_every=3", f"logging.out_dir={out}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=scaled(300))
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    losses = [r["loss"] for r in json.loads((out / "train_log.json").read_text())["steps"]]
    return losses, stderr, proc.pid, stdout


def test_good_config_trains_on_launched_ranks_forked_or_spawned_the_same_and_lists_its_artifacts(tmp_path):
    """A good config trains on two ranks that hyper-train starts itself (N from the sizes) and the
    run ends by listing its artifacts. ``auto`` on this CPU-only machine forks the ranks from the
    checked launcher (rank 0 logs how it was started and its parent: the launcher itself), ``spawn``
    starts fresh interpreters, and both runs give bit-identical losses (nothing the parent ran before
    the fork leaks into a rank)."""
    forked, err_f, pid_f, out_f = _launched_losses(tmp_path, "auto")
    spawned, err_s, pid_s, _ = _launched_losses(tmp_path, "spawn")
    out = tmp_path / "auto"
    assert "world=2" in out_f and "done: 3 steps" in out_f, out_f[-2000:]
    for name, path in (("JSON log", out / "train_log.json"), ("checkpoint", out / "checkpoints" / "step_3")):
        assert f"{name:<12} {path.resolve()}" in out_f, out_f[-2000:]
    assert "Traceback" not in err_f and "terminate called" not in err_f, err_f[-3000:]
    assert re.search(rf"rank started by fork \(pid (\d+), parent pid {pid_f}\)", err_f), err_f[-3000:]
    assert re.search(rf"rank started by spawn \(pid (\d+), parent pid {pid_s}\)", err_s), err_s[-3000:]
    assert f"pid {pid_f}, parent" not in err_f   # a child, not the launcher itself
    print(f"losses fork {forked} spawn {spawned}")
    assert len(forked) == 3 and forked == spawned


def test_start_method_rule(monkeypatch):
    """The env var's values, and fork refused (one line naming the variable) where an accelerator is."""
    import torch

    cfg = load_config([str(ROOT / "examples/train_cp2.yaml")])
    for value, want in (("", "fork"), ("auto", "fork"), ("fork", "fork"), ("SPAWN", "spawn")):
        monkeypatch.setenv(start_method.ENV, value)
        assert start_method.choose(cfg) == want, value
    monkeypatch.setenv(start_method.ENV, "forkserver")
    with pytest.raises(CPConfigError, match=r"\[HYPER_PARALLEL_START_METHOD\] 'forkserver' is not one of"):
        start_method.choose(cfg)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setenv(start_method.ENV, "auto")
    assert start_method.choose(cfg) == "spawn"
    monkeypatch.setenv(start_method.ENV, "fork")
    with pytest.raises(CPConfigError, match="fork is not safe here: this machine has an accelerator"):
        start_method.choose(cfg)
    monkeypatch.undo()
    cfg.accelerator.device_type = "cuda"
    assert start_method.choose(cfg) == "spawn"


def test_the_parent_check_leaves_no_openmp_team_and_keeps_its_thread_count(monkeypatch):
    """check_before_launch runs on one intra-op thread (no libgomp team to die in a forked child)
    and restores the count."""
    import contextlib

    import torch

    before, seen, real = torch.get_num_threads(), [], start_method.serial_threads

    @contextlib.contextmanager
    def spy():
        with real():
            seen.append(torch.get_num_threads())
            yield
    monkeypatch.setattr(start_method, "serial_threads", spy)
    check_before_launch([str(ROOT / "examples/train_cp2.yaml")], None)
    assert seen == [1] and torch.get_num_threads() == before
