"""accelerator.comm_timeout_s reaches every collective: hyper_parallel's own waits and barriers,
and the process groups the mesh creates (which FSDP2 / DTensor / DCP use directly)."""
import datetime
import os
import time

import pytest
import torch.distributed as dist
import torch.nn as nn

from hyper_parallel import platform as P
from hyper_parallel.distributed.config import AcceleratorConfig
from hyper_parallel.distributed.errors import CPConfigError


@pytest.mark.parametrize("bad", [0, -1.5, "30", True])
def test_bad_comm_timeout_is_rejected_naming_the_field(bad):
    with pytest.raises(CPConfigError, match=r"accelerator\.comm_timeout_s"):
        AcceleratorConfig.from_dict({"comm_timeout_s": bad})


def test_set_default_timeout_overrides_and_restores_the_env_default(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_COMM_TIMEOUT", "41")
    assert P.default_timeout() == datetime.timedelta(seconds=41)
    try:
        P.set_default_timeout(7)
        assert P.default_timeout() == datetime.timedelta(seconds=7)
        with pytest.raises(ValueError, match="> 0"):
            P.set_default_timeout(0)
    finally:
        P.set_default_timeout(None)
    assert P.default_timeout() == datetime.timedelta(seconds=41)


def _late_rank_1(fn):
    """Rank 1 never joins (it returns at once and never enters the collective; the test shuts the
    pool down afterwards); rank 0 runs fn and reports how it ended."""
    if dist.get_rank() == 1:
        return "late"
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "completed"


def mesh_subgroup_uses_config_timeout():
    from hyper_parallel.distributed.infrastructure import setup_distributed

    try:
        setup = setup_distributed(AcceleratorConfig(dp_shard_size=2, comm_timeout_s=2), [],
                                  nn.Linear(2, 2))
        group = setup.mesh.fsdp_mesh.get_group()  # a DeviceMesh sub-group, as FSDP2 uses it
        # torch's own collective on that group: bounded by the group's timeout, not 30 min
        return _late_rank_1(lambda: dist.barrier(group=group))
    finally:
        P.set_default_timeout(None)


def platform_barrier_times_out():
    P.set_default_timeout(2)
    try:
        return _late_rank_1(lambda: P.barrier())
    finally:
        P.set_default_timeout(None)


def checkpoint_group_uses_config_timeout():
    """The group DCP's save and load run on (timed_world_group) has the config's timeout, although
    the default group (the pool's) was created with a longer one before the config was read."""
    from hyper_parallel.platform.process_group import timed_world_group

    P.set_default_timeout(2)
    try:
        group = timed_world_group()
        t0 = time.monotonic()
        out = _late_rank_1(lambda: dist.barrier(group=group))
        took = time.monotonic() - t0
        # rank 1 never joins, so the wait ends only by a timeout: the group's 2 s one, not the pool's
        # default group's (HYPER_PARALLEL_COMM_TIMEOUT, 60 s x the scale), which the group must not inherit
        default_s = float(os.environ["HYPER_PARALLEL_COMM_TIMEOUT"])
        return out if dist.get_rank() == 1 or took < default_s / 2 else \
            f"waited {took:.1f} s, not the 2 s timeout: {out}"
    finally:
        P.set_default_timeout(None)


@pytest.mark.parametrize("worker,expect", [
    (mesh_subgroup_uses_config_timeout, ("RuntimeError", "DistBackendError")),
    (platform_barrier_times_out, ("CommTimeoutError: collective barrier",)),
    (checkpoint_group_uses_config_timeout, ("RuntimeError", "DistBackendError")),
], ids=["mesh_subgroup", "platform_barrier", "checkpoint_group"])
def test_late_rank_times_out_instead_of_hanging(ranks, worker, expect):
    pool = ranks(2)
    try:
        outs = pool.outcomes(worker, timeout=60)  # with torch's 30-min default: RankTimeout
    finally:
        pool.shutdown()  # rank 1 never joined: start fresh
    assert outs[1] == "late"
    assert outs[0].startswith(expect), outs[0]
