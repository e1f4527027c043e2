"""A frozen (SIGSTOP) or dead (SIGKILL) peer: the survivor prints ONE line naming the collective,
its group, the elapsed time and the likely cause, then exits non-zero within the timeout plus a
bound.

Unit tests translate synthetic backend errors; the end-to-end tests run the real ``hyper-train``
CLI under torchrun with 2 CPU ranks and ``HYPER_PARALLEL_FAULT_INJECT`` (the test hook of
``hyper_parallel/platform/faults.py``) making rank 1 stop or kill itself at step 2.
"""
from __future__ import annotations

import datetime
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hyper_parallel.platform import comm
from hyper_parallel.testing import scaled
from hyper_parallel.platform.faults import FaultSpec, parse_fault_spec
from hyper_parallel.platform.peer import (PEER_LOST, TIMEOUT, CommTimeoutError, PeerLostError, classify_failure,
                                          diagnose, locate_collective, timeout_from_message)
from hyper_parallel.platform.shutdown import sigterm_line

ROOT = Path(__file__).resolve().parents[2]

GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                "Timed out waiting 300000ms for recv operation to complete")
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
               "by peer [127.0.0.1]:48213")


# ----------------------------------------------------------------------------- translation units
@pytest.mark.parametrize("message,cause,seconds", [
    (GLOO_TIMEOUT, TIMEOUT, 300.0),
    ("[..unbound_buffer.cc:129] Timed out waiting 10000ms for send operation to complete", TIMEOUT, 10.0),
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
     "Timeout(ms)=600000) ran for 600021 milliseconds before timing out.", TIMEOUT, 600.0),
    (GLOO_CLOSED, PEER_LOST, None),
    ("[../gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:3127: Connection reset by peer", PEER_LOST, None),
    ("[../gloo/transport/tcp/pair.cc:598] Write error: Broken pipe", PEER_LOST, None),
    ("NCCL communicator was aborted on rank 1.", PEER_LOST, None),
    ("Expected all tensors to be on the same device", None, None),
    ("output tensor size must be equal to world_size times input tensor size", None, None),
])
def test_classify_backend_messages(message, cause, seconds):
    assert classify_failure(message) == cause
    if cause == TIMEOUT:
        assert timeout_from_message(message) == seconds


def _raise_from_fake_c10d(message: str):
    """Raise ``RuntimeError(message)`` from a frame that looks like torch's
    ``distributed_c10d.reduce_scatter_single`` (as FSDP2 calls it), with a group of ranks."""
    src = "def reduce_scatter_single(output, input, op=None, group=None, async_op=False):\n    raise RuntimeError(msg)\n"
    ns = {"msg": message}
    exec(compile(src, "/site-packages/torch/distributed/distributed_c10d.py", "exec"), ns)
    return ns["reduce_scatter_single"](None, None, group=[0, 1])


def test_raw_fsdp_timeout_is_diagnosed_from_the_traceback():
    try:
        _raise_from_fake_c10d(GLOO_TIMEOUT)
    except RuntimeError as exc:
        f = diagnose(exc, rank=0)
    assert (f.cause, f.op, f.group_ranks, f.elapsed_s) == (TIMEOUT, "reduce_scatter_single", [0, 1], 300.0)
    line = f.one_line()
    assert "\n" not in line
    assert line.startswith("rank 0: collective reduce_scatter_single on group [0, 1] (global ranks) "
                           "timed out after 300.0 s - likely cause: peer rank 1 stopped responding"), line


def test_raw_connection_closed_is_a_dead_peer_even_when_wrapped():
    try:
        try:
            _raise_from_fake_c10d(GLOO_CLOSED)
        except RuntimeError as inner:
            raise ValueError("while checkpointing") from inner   # a caller re-raised it
    except ValueError as exc:
        f = diagnose(exc, rank=1)
    assert (f.cause, f.op, f.group_ranks) == (PEER_LOST, "reduce_scatter_single", [0, 1])
    assert "likely cause: peer rank 0 died (killed, crashed or out of memory)" in f.one_line()


def test_dead_peer_inside_a_dcp_checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _raise_from_fake_c10d(GLOO_CLOSED)
    except RuntimeError as inner:
        wrapped = CheckpointException("save failed", {1: (inner, None)})
    f = diagnose(wrapped, rank=0)
    assert (f.cause, f.op, f.group_ranks) == (PEER_LOST, "reduce_scatter_single", [0, 1])


def test_other_errors_are_not_peer_failures():
    assert diagnose(ValueError("bad shape")) is None
    assert diagnose(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None


def test_platform_error_is_typed_and_keeps_op_group_elapsed():
    timeout = datetime.timedelta(seconds=10)
    t0 = time.monotonic() - 10.2
    err = comm.peer_error("all_reduce", None, t0, timeout, RuntimeError(GLOO_TIMEOUT))
    assert isinstance(err, CommTimeoutError) and str(err).startswith("collective all_reduce")
    lost = comm.peer_error("all_gather", None, t0, timeout, RuntimeError(GLOO_CLOSED))
    assert isinstance(lost, PeerLostError) and lost.timeout_s == 10.0 and lost.elapsed_s >= 10.2
    explicit = PeerLostError("all_to_all", group_ranks=[0, 1, 2, 3], elapsed_s=0.25, rank=2, detail=GLOO_CLOSED)
    again = pickle.loads(pickle.dumps(explicit))        # crosses ranks / pools intact
    f = diagnose(again)
    assert (type(again), f.op, f.group_ranks, f.elapsed_s, f.rank) == (PeerLostError, "all_to_all", [0, 1, 2, 3],
                                                                      0.25, 2)
    assert "failed after 0.2 s: the connection to a peer was closed - likely cause: a peer rank among " \
           "[0, 1, 3] died" in f.one_line()


def test_sigterm_line_names_the_collective_the_main_thread_waits_in():
    def fake_stack():
        src = "def all_gather_single(output, input, group=None, async_op=False):\n    return sys._getframe()\n"
        ns = {"sys": sys}
        exec(compile(src, "/x/torch/distributed/distributed_c10d.py", "exec"), ns)
        return ns["all_gather_single"](None, None, group=[0, 1])

    frame = fake_stack()
    assert locate_collective([frame]) == ("all_gather_single", [0, 1])
    line = sigterm_line([frame], 0)
    assert line.startswith("rank 0: terminated by SIGTERM while waiting in collective all_gather_single on "
                           "group [0, 1]") and "peer rank 1 stopped or died" in line
    assert "not inside a collective" in sigterm_line([sys._getframe()], 0)


SIGTERM_CHILD = r"""
import time
from hyper_parallel.platform.shutdown import install_sigterm_report
install_sigterm_report("hyper-train: ", lambda: 0, grace_s=0.5)
src = ("def all_gather_single(output, input, group=None, async_op=False):\n"
       "    print('waiting', flush=True)\n    time.sleep(120)\n")
ns = {"time": time}
exec(compile(src, "/x/torch/distributed/distributed_c10d.py", "exec"), ns)
ns["all_gather_single"](None, None, group=[0, 1])
"""


def test_sigterm_while_blocked_in_a_collective_gives_one_line_and_exit_143():
    """torchrun SIGTERMs the survivors when one rank exits; the main thread may be blocked in a
    collective (here a stand-in frame): the watcher thread names it and exits 128 + 15."""
    p = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == "waiting"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 143, err
    assert err.strip() == ("hyper-train: rank 0: terminated by SIGTERM while waiting in collective all_gather_single "
                           "on group [0, 1] (global ranks) - likely cause: peer rank 1 stopped or died and the "
                           "launcher is stopping every rank (see its report)"), err


def test_fault_spec_parsing():
    assert parse_fault_spec(None) is None and parse_fault_spec(" ") is None
    assert parse_fault_spec("rank=1,step=2,kind=stop") == FaultSpec(1, 2, "stop", "step")
    assert parse_fault_spec("rank=0, step=3, kind=kill, at=forward") == FaultSpec(0, 3, "kill", "forward")
    for bad in ("rank=1,step=2", "rank=1,step=2,kind=pause", "rank=1,step=0,kind=stop", "rank=1;step=2"):
        with pytest.raises(ValueError, match="HYPER_PARALLEL_FAULT_INJECT"):
            parse_fault_spec(bad)


# ----------------------------------------------------------------------------- end to end (torchrun)
COMM_TIMEOUT_S = 10
EXIT_BOUND_S = 60          # survivors must exit within COMM_TIMEOUT_S + scaled(this) after the fault


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def _state(pid: int) -> str:
    """'R'/'S'/... running, 'T' stopped, 'gone' exited (zombies count as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
    return "gone" if state in ("Z", "X") else state


def _rank_of(pid: int):
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return None


def _run_with_fault(tmp_path: Path, fault: str, faulty_rank: int = 1, deadline_s: float = 600.0,
                    extra: tuple = ()) -> dict:
    """Run the main job's CLI on 2 ranks under torchrun with ``fault``; watch the workers.

    Returns the survivor's stderr, torchrun's output, the fault time (faulty worker first seen
    stopped or gone) and the survivor's exit time. A stopped worker is SIGKILLed once the
    survivor has exited (and in any case in ``finally``): nothing outlives the test.
    ``deadline_s`` (scaled) only guards against a hang (start-up on a loaded 2-core machine can take
    minutes). The fault time is the one the faulty rank printed just before it stopped or killed
    itself, and the survivor's exit time is when it wrote its last line (its stderr's mtime), so
    a watcher thread that a busy machine schedules late measures nothing late; its own
    observations are the fallback.
    """
    deadline_s = scaled(deadline_s)
    logs, out = tmp_path / "logs", tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(logs), "--redirects", "3", "--monitor-interval", "0.1",
           "-m", "hyper_parallel.trainer.cli", "examples/train_cp2.yaml",
           "schedule.steps=3", "data.seq_len=64", "data.micro_batch_size=1", "logging.progress=false",
           "logging.plot=false", f"logging.out_dir={out}", f"accelerator.comm_timeout_s={COMM_TIMEOUT_S}",
           *extra]
    # the world group (created before the YAML is read) gets a generous timeout, so a slow start-up
    # on a loaded machine is not mistaken for the fault; the mesh groups and every hyper_parallel
    # wait use accelerator.comm_timeout_s
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYPER_PARALLEL_COMM_TIMEOUT": "120",
           "HYPER_PARALLEL_FAULT_INJECT": fault}
    env.pop("HYPER_PARALLEL_TRACEBACK", None)
    launcher_log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=launcher_log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    workers: dict[int, int] = {}   # rank -> pid
    fault_t = survivor_exit_t = None
    t_start = time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - t_start < deadline_s:
            if len(workers) < 2:
                for pid in _children(proc.pid):
                    rank = _rank_of(pid)
                    if rank is not None:
                        workers[rank] = pid
            now = time.monotonic()
            if faulty_rank in workers and fault_t is None and _state(workers[faulty_rank]) in ("T", "gone"):
                fault_t = now
            survivors = [p for r, p in workers.items() if r != faulty_rank]
            if fault_t is not None and survivor_exit_t is None and survivors \
                    and all(_state(p) == "gone" for p in survivors):
                survivor_exit_t = now
                if _state(workers[faulty_rank]) == "T":
                    os.kill(workers[faulty_rank], signal.SIGKILL)   # the frozen peer: clean it up
            time.sleep(0.1)   # polling external processes, not synchronizing with them
        rc = proc.wait(timeout=scaled(60))
    finally:
        for pid in workers.values():
            if _state(pid) != "gone":
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        launcher_log.close()
    survivor_err = list(logs.glob("*/attempt_0/0/stderr.log"))
    faulty_err = list(logs.glob(f"*/attempt_0/{faulty_rank}/stderr.log"))
    stamp = re.search(r"fault injection: .* t=(\d+\.\d+)", faulty_err[0].read_text()) if faulty_err else None
    if stamp and survivor_err:     # both from the ranks themselves, on the wall clock
        fault_t, survivor_exit_t = float(stamp.group(1)), survivor_err[0].stat().st_mtime
    return {"rc": rc, "fault_t": fault_t, "survivor_exit_t": survivor_exit_t,
            "launcher": (tmp_path / "torchrun.log").read_text(),
            "stderr": survivor_err[0].read_text() if survivor_err else "", "out": out}


def _exitcode_of_rank(launcher: str, rank: int):
    m = re.search(rf"rank\s*:\s*{rank} \(local_rank: {rank}\)\s*\n\s*exitcode\s*:\s*(-?\d+)", launcher)
    return None if m is None else int(m.group(1))


def _the_line(res: dict) -> str:
    lines = [ln for ln in res["stderr"].splitlines() if ln.startswith("hyper-train: ")]
    assert len(lines) == 1, res["stderr"][-3000:] + "\n--- launcher ---\n" + res["launcher"][-3000:]
    assert "Traceback" not in res["stderr"], res["stderr"][-3000:]
    assert res["fault_t"] is not None and res["survivor_exit_t"] is not None, res["launcher"][-3000:]
    assert res["survivor_exit_t"] - res["fault_t"] <= COMM_TIMEOUT_S + scaled(EXIT_BOUND_S)
    assert res["rc"] != 0
    return lines[0]


# The end-to-end scenarios below are independent torchrun jobs that spend most of their wall time
# waiting (rank start-up, the 10 s comm timeout, the launcher's teardown), so they run
# concurrently, each on its own launcher, ports and directories, watched by its own thread; each
# test reads its scenario's result (an exception inside a scenario is re-raised by its own test).
FAULTS = {  # scenario -> (HYPER_PARALLEL_FAULT_INJECT, extra CLI overrides)
    "frozen_step": ("rank=1,step=2,kind=stop,at=step", ()),
    "frozen_forward": ("rank=1,step=2,kind=stop,at=forward", ()),
    "dead": ("rank=1,step=2,kind=kill,at=step", ()),
    "frozen_save": ("rank=1,step=1,kind=stop,at=save", ("schedule.save_every=1",)),
}


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    jobs = {k: (lambda d, f=f, e=e: _run_with_fault(d, f, extra=e)) for k, (f, e) in FAULTS.items()}
    jobs["killed_launcher"] = _killed_launcher_run
    with ThreadPoolExecutor(len(jobs)) as ex:
        futures = {k: ex.submit(job, tmp_path_factory.mktemp(k)) for k, job in jobs.items()}
        results = {}
        for k, fut in futures.items():
            try:
                results[k] = (fut.result(), None)
            except BaseException as e:  # noqa: BLE001 - re-raised by the scenario's own test
                results[k] = (None, e)
    return results


def _result(fault_runs, scenario: str):
    res, err = fault_runs[scenario]
    if err is not None:
        raise err
    return res


@pytest.mark.parametrize("at,op", [("step", "all_reduce"), ("forward", "all_gather_single")],
                         ids=["platform_collective", "fsdp_collective"])
def test_frozen_peer_gives_one_line_and_the_survivor_exits(fault_runs, at, op):
    """at=step: rank 0 waits in hyper_parallel's token-count all-reduce (typed CommTimeoutError);
    at=forward: in FSDP2's own parameter all-gather (raw gloo error, diagnosed at the top)."""
    res = _result(fault_runs, f"frozen_{at}")
    line = _the_line(res)
    m = re.fullmatch(rf"hyper-train: rank 0: collective {op} on group \[0, 1\] \(global ranks\) timed out after "
                     r"(\d+\.\d) s - likely cause: peer rank 1 stopped responding \(frozen/SIGSTOP, hung or "
                     r"overloaded\) or died; exiting with code 3 \(traceback: (.+)\)", line)
    assert m, line
    assert COMM_TIMEOUT_S - 0.5 <= float(m.group(1)) <= COMM_TIMEOUT_S + scaled(EXIT_BOUND_S), line
    assert "timed out" in Path(m.group(2)).read_text().lower()   # the full traceback, for debugging
    assert _exitcode_of_rank(res["launcher"], 0) == 3, res["launcher"][-3000:]


def test_dead_peer_gives_one_line_and_the_survivor_exits(fault_runs):
    """rank 1 SIGKILLs itself; rank 0 either sees the closed connection in its next collective
    (exit 3) or is stopped by torchrun's SIGTERM first (exit 143): one line either way."""
    res = _result(fault_runs, "dead")
    line = _the_line(res)
    code = _exitcode_of_rank(res["launcher"], 0)
    lost = re.fullmatch(r"hyper-train: rank 0: collective all_reduce on group \[0, 1\] \(global ranks\) failed "
                        r"after \d+\.\d s: the connection to a peer was closed - likely cause: peer rank 1 died "
                        r"\(killed, crashed or out of memory\); exiting with code 3 \(traceback: .+\)", line)
    term = re.fullmatch(r"hyper-train: rank 0: terminated by SIGTERM .*likely cause: .*(stopped or died).*", line)
    assert (lost and code == 3) or (term and code in (143, -15)), (code, line)


def test_frozen_peer_during_a_checkpoint_save_honours_comm_timeout(fault_runs):
    """rank 1 freezes inside the step-1 save, just before DCP writes: rank 0 waits in one of DCP's
    own collectives, which run on the world group created with accelerator.comm_timeout_s (10 s),
    not on the launcher-wide default group (120 s here, 300 s by default): one line, exit 3."""
    res = _result(fault_runs, "frozen_save")
    line = _the_line(res)
    print(line)
    m = re.fullmatch(r"hyper-train: rank 0: collective (\w+) on group \[0, 1\] \(global ranks\) timed out after "
                     r"(\d+\.\d) s - likely cause: peer rank 1 stopped responding \(frozen/SIGSTOP, hung or "
                     r"overloaded\) or died; exiting with code 3 \(traceback: (.+)\)", line)
    assert m, line
    assert COMM_TIMEOUT_S - 0.5 <= float(m.group(2)) < 120, line     # the config's timeout, not the world's
    assert "checkpoint" in Path(m.group(3)).read_text()               # it was the save's collective
    assert _exitcode_of_rank(res["launcher"], 0) == 3, res["launcher"][-3000:]
    assert not (res["out"] / "checkpoints" / "step_1").exists()     # only the .partial directory


def _snapshot(root: Path) -> dict:
    return {str(p): p.stat().st_size for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def test_killed_launcher_stops_every_rank_which_writes_nothing_more(fault_runs):
    """torchrun SIGKILLed mid-run: both orphaned ranks notice within a second (parent watch), print
    one line each and exit 129; nothing under out_dir changes afterwards (the checks are in
    :func:`_killed_launcher_run`, run beside the other scenarios)."""
    assert _result(fault_runs, "killed_launcher") is True


def _killed_launcher_run(tmp_path: Path) -> bool:
    logs, out = tmp_path / "logs", tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(logs), "--redirects", "3", "-m", "hyper_parallel.trainer.cli", "examples/train_cp2.yaml",
           "schedule.steps=100000", "schedule.save_every=2", "schedule.keep_last=2", "data.seq_len=64",
           "data.micro_batch_size=1", "logging.progress=false", "logging.plot=false", f"logging.out_dir={out}",
           f"accelerator.comm_timeout_s={COMM_TIMEOUT_S}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYPER_PARALLEL_TRACEBACK", None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    workers: list[int] = []
    jsonl = out / "train_log.jsonl"
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < scaled(300):   # wait for a few steps and a checkpoint
            if len(workers) < 2:
                workers = [p for p in _children(proc.pid) if _rank_of(p) is not None]
            if jsonl.exists() and jsonl.read_text().count('"step"') >= 4 and (out / "checkpoints").exists():
                break
            assert proc.poll() is None, "the job ended before the launcher was killed"
            time.sleep(0.2)   # polling external processes, not synchronizing with them
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)   # the launcher only: its ranks are orphaned
        proc.wait()
        killed = time.monotonic()
        while any(_state(p) != "gone" for p in workers) and time.monotonic() - killed < scaled(COMM_TIMEOUT_S + 30):
            time.sleep(0.1)
        stopped_after = time.monotonic() - killed
        assert all(_state(p) == "gone" for p in workers), "orphaned ranks kept running"
        assert stopped_after <= scaled(COMM_TIMEOUT_S), stopped_after
        before = _snapshot(out)
        time.sleep(3)
        assert _snapshot(out) == before        # nothing written after the ranks stopped
    finally:
        for pid in workers:
            if _state(pid) != "gone":
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    gone = (f"the launcher (pid {proc.pid}, e.g. torchrun) is gone - stopping now, writing nothing more (the last "
            "complete checkpoint stays resumable; start the job again to continue)")
    seen = []
    for rank in (0, 1):
        err = "".join(p.read_text() for p in logs.glob(f"*/attempt_0/{rank}/stderr.log"))
        lines = [ln for ln in err.splitlines() if ln.startswith("hyper-train: ")]
        assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
        # the first rank to notice leaves; its peer may then see the closed connection first
        assert lines[0] == f"hyper-train: rank {rank}: {gone}" or re.fullmatch(
            rf"hyper-train: rank {rank}: collective \w+ on group \[0, 1\] \(global ranks\) failed.*peer rank "
            rf"{1 - rank} died.*exiting with code 3 .*", lines[0]), lines[0]
        seen.append(gone in lines[0])
    assert any(seen)
    return True
