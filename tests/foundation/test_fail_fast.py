"""A bad config on one rank fails every rank promptly (no hang), before any collective."""
import time

from hyper_parallel.distributed.errors import CPConfigError, PreflightError

GOOD = "examples/demo_plan_cp2.yaml"


def setup_on_rank(yaml_path: str, overrides: list):
    from hyper_parallel.distributed.infrastructure import setup_distributed
    from hyper_parallel.distributed.preflight import agree_or_raise
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.model import build_model

    cfg = agree_or_raise(lambda: TrainerConfig.from_yaml(yaml_path, overrides), what="config load")
    model = build_model(cfg.model)
    setup = setup_distributed(cfg.accelerator, cfg.plan_overrides, model)
    return setup.mesh.cp_size


def test_good_config_all_ranks(ranks):
    assert ranks(2).run(setup_on_rank, GOOD, []) == [2, 2]


def test_bad_yaml_on_one_rank_fails_all_ranks(ranks):
    pool = ranks(2)
    # "promptly" is the harness deadline: a rank still running after 30s raises RankTimeout
    outs = pool.outcomes(setup_on_rank, timeout=30,
                         rank_args=[(GOOD, []), (GOOD, ["accelerator.ulysses_degree=2"])])
    assert isinstance(outs[1], CPConfigError) and "accelerator.ulysses_degree" in str(outs[1])
    assert isinstance(outs[0], PreflightError) and "rank 1" in str(outs[0]) and "ulysses_degree" in str(outs[0])


def test_bad_plan_on_one_rank_fails_all_ranks(ranks):
    pool = ranks(2)
    outs = pool.outcomes(setup_on_rank, timeout=60,
                         rank_args=[(GOOD, ["plan_overrides=[]"]), (GOOD, [])])
    assert isinstance(outs[0], CPConfigError) and "no CP method declared" in str(outs[0])
    assert isinstance(outs[1], PreflightError) and "rank 0" in str(outs[1])
    # the pool stays usable: the failure happened before any collective
    assert pool.run(setup_on_rank, GOOD, []) == [2, 2]


def test_world_mismatch_fails_all_ranks(ranks):
    outs = ranks(2).outcomes(setup_on_rank, GOOD, ["accelerator.cp_size=4"], timeout=60)
    assert all(isinstance(o, CPConfigError) and "world_size = 2" in str(o) for o in outs)


def hang_one_rank():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(30)
    from hyper_parallel.platform import all_reduce
    return float(all_reduce(torch.ones(1), None).item())


def test_harness_timeout_tears_down_instead_of_hanging(ranks):
    import pytest

    from hyper_parallel.testing import RankTimeout

    pool = ranks(2)
    with pytest.raises(RankTimeout, match="within 5"):
        pool.outcomes(hang_one_rank, timeout=5, expect_hang=True)
    assert not pool.alive
    assert pool.run(setup_on_rank, GOOD, []) == [2, 2]  # re-spawned on demand


def test_timeout_scale_applies_to_waits_not_to_expected_hangs(monkeypatch):
    """HYPER_PARALLEL_TEST_TIMEOUT_SCALE multiplies every harness bound; a bad value is refused."""
    import pytest

    from hyper_parallel.testing import RankPool, scaled, timeout_scale

    monkeypatch.setenv("HYPER_PARALLEL_TEST_TIMEOUT_SCALE", "3")
    assert timeout_scale() == 3.0 and scaled(20) == 60.0
    pool = RankPool(2, start_timeout=10)
    assert pool.start_timeout == 30.0 and float(pool.env["HYPER_PARALLEL_COMM_TIMEOUT"]) == 180.0
    for bad in ("0.5", "fast"):
        monkeypatch.setenv("HYPER_PARALLEL_TEST_TIMEOUT_SCALE", bad)
        with pytest.raises(ValueError, match="HYPER_PARALLEL_TEST_TIMEOUT_SCALE"):
            timeout_scale()


def crash_rank_0():
    """Rank 0 dies the way a native crash kills a process (a signal, no Python exception, no result
    sent); rank 1 waits on nothing the dead rank could end (so only the pool can end the call)."""
    import os
    import signal
    import threading

    import torch.distributed as dist

    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Event().wait()


def test_a_crashed_rank_ends_the_call_without_waiting_out_its_timeout(ranks):
    """A native crash on one rank (CI once saw glibc abort a rank mid-step) is reported as that rank's
    death, naming its signal, not as a hang at the end of the call's timeout; the pool starts afresh."""
    import pytest

    from hyper_parallel.testing import RankDied

    pool = ranks(2)
    # the timeout is the fallback if the death went unnoticed: RankTimeout, not RankDied, would fail this
    with pytest.raises(RankDied, match=r"rank 0 died \(signal SIGKILL\) without a result") as err:
        pool.outcomes(crash_rank_0, timeout=300)
    assert err.value.dead == {0: -9}
    assert not pool.alive
    assert pool.run(setup_on_rank, GOOD, []) == [2, 2]
