"""One line per failure across ranks: what a rank leaves behind, and how ``hyper-train`` sums it up.

Rank side (:func:`record_failure`): a rank that ends with a non-zero exit code writes its one
line to the error file torchelastic gives it (``TORCHELASTIC_ERROR_FILE``, in the JSON layout
``torch.distributed.elastic``'s ``@record`` writes: ``{"message": {"message": line, "extraInfo":
{"py_callstack": line, "timestamp": s}}}``, so torchrun's own summary shows the line) with a
``"hyper_parallel"`` entry (exit code, kind, rank, time in ns). Started by ``hyper-train``
(:data:`LAUNCHED_ENV` set) the rank prints nothing itself: the parent prints the summary. Under
plain torchrun (or alone) it prints the line to stderr as well.

Parent side (:func:`summarise`): torchelastic's ``ChildFailedError`` -> the lines to print and
the exit code. Kinds :data:`CONSEQUENCES` (a collective that failed because a peer stopped, a
SIGTERM from the launcher tearing the survivors down, another rank's error echoed by the
config agreement) are shown only when no rank has a root cause. Root causes are deduplicated
by message (``rank N:`` prefixes removed) and name the ranks that hit them (none when every rank
did), first failure first.
Exit code: 2 when a root cause is a configuration or data error, else the root causes' common
code when it is one of the CLI's (3 peer failure, 4 non-finite step), else 1. See docs/trainer.md
"Launching".
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

LAUNCHED_ENV = "HYPER_TRAIN_LAUNCHED"   # set by hyper-train for the ranks it starts
TRACEBACK_ENV = "HYPER_PARALLEL_TRACEBACK"   # 1: a rank also prints the traceback it saves
CONFIG, NONFINITE, PEER, TERMINATED, ECHO, LAUNCHER_GONE, ERROR = (
    "config", "nonfinite", "peer", "terminated", "echo", "launcher_gone", "error")
CONSEQUENCES = (PEER, TERMINATED, ECHO, LAUNCHER_GONE)
_CLI_CODES = {2, 3, 4}
_RANK_PREFIX = re.compile(r"^(hyper-train: )?(rank \d+: )?")


def launched() -> bool:
    """True in a rank that ``hyper-train`` started (its parent prints the failure summary)."""
    return os.environ.get(LAUNCHED_ENV) == "1"


def _save_traceback(exc: BaseException, out_dir, name: str) -> str:
    """`` (traceback: <out_dir>/<name>)`` after writing it there (also to stderr with
    :data:`TRACEBACK_ENV`); a hint at the variable when it cannot be written."""
    text = "".join(traceback.format_exception(exc))
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        sys.stderr.write(text)
    if out_dir is not None:
        try:
            path = Path(out_dir) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return f" (traceback: {path})"
        except OSError:
            pass
    return f" (traceback: set {TRACEBACK_ENV}=1)"


def peer_failure_line(failure, exc: BaseException, out_dir, code: int) -> str:
    """The one line for a :class:`~hyper_parallel.platform.peer.PeerFailure`; the traceback goes to
    ``<out_dir>/peer_failure_rank<R>.log``."""
    rank = failure.rank if failure.rank is not None else 0
    where = _save_traceback(exc, out_dir, f"peer_failure_rank{rank}.log")
    return f"hyper-train: {failure.one_line()}; exiting with code {code}{where}"


def error_line(exc: BaseException, rank: int | None, out_dir, save: bool = True) -> str:
    """``hyper-train: rank R: Type: message (traceback: ...)`` for an unexpected error; ``save``: the
    traceback goes to ``<out_dir>/error_rank<R>.log``, else it was printed already."""
    where = _save_traceback(exc, out_dir, f"error_rank{rank or 0}.log") if save else " (traceback above)"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"hyper-train: rank {rank}: {type(exc).__name__}: {first}{where}"


def record_failure(line: str, code: int, kind: str, rank: int | None, echo: bool = True) -> bool:
    """Leave ``line`` for the launcher (module doc); with ``echo``, print it unless ``hyper-train``
    started this rank. Returns True (the line is handled)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        data = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                           "timestamp": str(int(time.time()))}},
                "hyper_parallel": {"code": code, "kind": kind, "rank": rank, "time_ns": time.time_ns()}}
        try:
            with open(path, "w") as fh:
                json.dump(data, fh)
        except OSError:
            pass
    if echo and not (path and launched()):
        print(line, file=sys.stderr, flush=True)
    return True


def _entry(rank: int, failure) -> dict:
    """One torchelastic ``ProcessFailure`` as (rank, line, code, kind, time)."""
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    ours = data.get("hyper_parallel")
    if isinstance(ours, dict):
        line = data.get("message", "")
        line = line.get("message", "") if isinstance(line, dict) else line
        return {"rank": rank, "line": str(line), "code": int(ours.get("code", 1)),
                "kind": ours.get("kind", ERROR), "t": int(ours.get("time_ns", 0))}
    message = failure.message if isinstance(failure.message, str) else \
        str((failure.message or {}).get("message", ""))
    if failure.exitcode < 0:   # killed by a signal: no error file
        name = failure.signal_name()
        kind = TERMINATED if name in ("SIGTERM", "SIGINT") else ERROR
        hint = " (killed: out of memory, or by hand?)" if name == "SIGKILL" else ""
        line = f"rank {rank}: the process was killed by {name}{hint}"
        return {"rank": rank, "line": line, "code": 1, "kind": kind, "t": failure.timestamp * 10**9}
    if not data:   # exited with no error file: its own output (above) says why
        message = f"exited with code {failure.exitcode} (its own output above says why)"
    return {"rank": rank, "line": f"rank {rank}: {message.strip().splitlines()[-1] if message.strip() else ''}",
            "code": 1, "kind": ERROR, "t": failure.timestamp * 10**9}


def summarise(failures: dict, world_size: int) -> tuple[list[str], int]:
    """``{global rank: ProcessFailure}`` (``ChildFailedError.failures``) -> (lines, exit code)."""
    entries = sorted((_entry(r, f) for r, f in failures.items()), key=lambda e: (e["t"], e["rank"]))
    roots = [e for e in entries if e["kind"] not in CONSEQUENCES] or entries
    groups: dict[str, list] = {}
    for e in roots:
        text = _RANK_PREFIX.sub("", e["line"].strip()) or f"exited with code {e['code']}"
        groups.setdefault(text, []).append(e)
    lines = []
    for text, group in groups.items():
        ranks = sorted({e["rank"] for e in group})
        if len(ranks) == world_size:
            who = ""     # the same line on every rank (a configuration error, a non-finite step): no rank to name
        elif len(ranks) == 1:
            who = f"rank {ranks[0]}: "
        else:
            who = f"ranks {ranks}: "
        lines.append(f"hyper-train: {who}{text}")
    codes = {e["code"] for e in roots}
    if 2 in codes:
        code = 2
    elif len(codes) == 1 and codes <= _CLI_CODES:
        code = codes.pop()
    else:
        code = 1
    return lines, code
