"""Leaving the process promptly and once, with one line, when a peer stopped or died.

Contract:

* :func:`exit_now` prints one line to stderr, flushes, and ends the process with ``os._exit``:
  no interpreter teardown, so no wait on a collective thread or a process-group destructor that
  is still blocked on the lost peer (that wait could last another full timeout). The first
  caller wins; a second caller (another thread) blocks until the process is gone.
* :func:`install_sigterm_report` (main thread, once): a launcher such as torchrun sends SIGTERM
  to every surviving rank as soon as one rank exits, often before the survivor's own collective
  has failed. On SIGTERM a watcher thread gives the main thread ``grace_s`` seconds to report
  its own peer failure (then the precise diagnosis wins); otherwise it names the collective the
  main thread is blocked in, if any (from its live stack), and exits with 128 + SIGTERM.
* :func:`set_exit_reporter`: a callable that receives each such line and exit code first (the
  trainer records it for its launcher); the process still ends with ``os._exit``.
* :func:`install_parent_watch`: a rank whose launcher died (SIGKILLed torchrun) stops within a
  second with one line and exit code 129 instead of training on as an orphan;
  :func:`stop_if_launcher_gone` is the same check, called synchronously at every write point.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Optional

from .peer import PeerFailure, frames_of_stack, locate_collective

SIGTERM_EXIT = 128 + signal.SIGTERM
_CLAIM = threading.Lock()
_CLAIMED = threading.Event()
_REPORTER: list = []   # at most one callable(line, code) -> bool, see set_exit_reporter


def set_exit_reporter(reporter: Optional[Callable[[str, int], bool]]) -> None:
    """Route :func:`exit_now`'s line through ``reporter(line, code)`` (e.g. into the launcher's
    per-rank error file); when it returns True the line is not printed again. None: print only."""
    _REPORTER[:] = [] if reporter is None else [reporter]


def exit_now(line: str, code: int) -> None:
    """Print ``line`` (one line) to stderr and end the process with ``code``; never returns."""
    if not _CLAIM.acquire(blocking=False):
        threading.Event().wait()   # someone else is exiting the process right now
    _CLAIMED.set()
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    try:
        if _REPORTER and _REPORTER[0](line, code):
            return
        # on a terminal another rank's progress bar may own the current line: start a fresh one
        sys.stderr.write(("\n" if sys.stderr.isatty() else "") + line.rstrip("\n") + "\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


def sigterm_line(frames, rank: Optional[int]) -> str:
    """The line for a SIGTERM received while the main thread runs ``frames`` (innermost first)."""
    op, ranks = locate_collective(frames)
    who = "" if rank is None else f"rank {rank}: "
    if op is None:
        return (f"{who}terminated by SIGTERM (not inside a collective) - likely cause: the launcher "
                f"stops every rank once one rank exits: another rank stopped or died first "
                f"(see the launcher's report)")
    f = PeerFailure("peer_lost", op, ranks, rank=rank)
    return (f"{who}terminated by SIGTERM while waiting in collective {op}{f.where()} - likely cause: "
            f"{f.peers()} stopped or died and the launcher is stopping every rank (see its report)")


def install_sigterm_report(prefix: str = "", rank_fn: Callable[[], Optional[int]] = lambda: None,
                           grace_s: float = 2.0) -> bool:
    """Report SIGTERM on one line and exit (see the module doc). Returns False (and does nothing)
    when not called from the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    main_id = threading.main_thread().ident
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.signal(signal.SIGTERM, lambda *_: None)   # the watcher acts; the main thread carries on
    signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)

    def watch():
        while True:
            data = os.read(rfd, 64)
            if not data:
                return
            if signal.SIGTERM in data:
                break
        if _CLAIMED.wait(grace_s):   # the main thread is reporting its own peer failure
            return
        frame = sys._current_frames().get(main_id)
        exit_now(prefix + sigterm_line(frames_of_stack(frame), rank_fn()), SIGTERM_EXIT)

    threading.Thread(target=watch, name="hp-sigterm-report", daemon=True).start()
    return True


LAUNCHER_GONE_EXIT = 129   # 128 + SIGHUP, the conventional "controlling process went away" status


def launcher_gone_line(rank: Optional[int], launcher_pid: int) -> str:
    who = "" if rank is None else f"rank {rank}: "
    return (f"{who}the launcher (pid {launcher_pid}, e.g. torchrun) is gone - stopping now, writing nothing "
            f"more (the last complete checkpoint stays resumable; start the job again to continue)")


def install_parent_watch(prefix: str = "", rank_fn: Callable[[], Optional[int]] = lambda: None,
                         interval_s: float = 1.0) -> bool:
    """Stop this rank when its launcher dies (see :func:`launcher_gone_line`).

    A rank started by a launcher (torchrun sets ``TORCHELASTIC_RUN_ID``; any parent other than
    init counts) records its parent's pid; a daemon thread polls ``os.getppid()`` every
    ``interval_s`` seconds and, once the parent is gone (the rank was re-parented), ends the
    process with one line and exit code :data:`LAUNCHER_GONE_EXIT` through :func:`exit_now`
    (``os._exit``: no further log line, checkpoint file or collective). Without the launcher a
    rank would keep training and writing checkpoints as an orphan, and its peers would not be
    restarted. Polling, not ``prctl(PR_SET_PDEATHSIG)``: that signal fires when the parent
    *thread* that spawned the rank exits, which a launcher may do while alive, and a signal could
    not stop the main thread before its next write. Returns False (and watches nothing) outside
    a launcher or when the parent is already init (pid 1)."""
    parent = os.getppid()
    if parent <= 1 or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return False
    _WATCHED.update(parent=parent, prefix=prefix, rank_fn=rank_fn)

    def watch():
        while True:
            threading.Event().wait(interval_s)
            stop_if_launcher_gone()

    threading.Thread(target=watch, name="hp-parent-watch", daemon=True).start()
    return True



_WATCHED: dict = {}   # set by install_parent_watch: the launcher's pid, the line's prefix, the rank


def stop_if_launcher_gone() -> None:
    """The synchronous check of :func:`install_parent_watch` (no-op without it): the trainer calls
    it before each step, before each step record and before committing a checkpoint, so an
    orphaned rank writes nothing more even between two polls of the watch thread."""
    parent = _WATCHED.get("parent")
    if parent is not None and os.getppid() != parent:
        exit_now(_WATCHED["prefix"] + launcher_gone_line(_WATCHED["rank_fn"](), parent), LAUNCHER_GONE_EXIT)
