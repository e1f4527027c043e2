"""Rank functions for ``launch(..., start_method="fork", worker=...)`` tests: no model, no process group."""
from __future__ import annotations

import os
import time


def one_bad_rank_one_slow_peer(argv: list, hard_exit: bool) -> int:
    """Rank 1 fails at once with one recorded line; rank 0 is still busy (outside any collective)
    when the launcher sees that failure, so the launcher must stop it. Both report as ``cli._train``
    does in a launched rank (exit reporter, SIGTERM report)."""
    from hyper_parallel.platform.shutdown import SIGTERM_EXIT, install_sigterm_report, set_exit_reporter
    from hyper_parallel.trainer import failures

    rank = int(os.environ["RANK"])
    set_exit_reporter(lambda line, code: failures.record_failure(
        line, code, failures.TERMINATED if code == SIGTERM_EXIT else failures.ERROR, rank))
    install_sigterm_report("hyper-train: ", lambda: rank)
    if rank == 1:
        failures.record_failure(f"hyper-train: rank 1: ValueError: {argv[0]}", 1, failures.ERROR, 1)
        os._exit(1)
    time.sleep(120)   # the launcher's SIGTERM ends this much sooner
    return 0
