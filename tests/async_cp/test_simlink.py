"""The platform's simulated link: off by default, parsed strictly, serialises collectives on one
modelled link, and a handle's wait returns only once its modelled completion time has passed —
on the thread that waits (the comm thread for async CP). No wall-clock bound is asserted: every
check compares monotonic times the link itself reports."""
import time

import pytest
import torch

from hyper_parallel.platform import simlink


def test_off_by_default_and_env_spec(monkeypatch):
    monkeypatch.delenv(simlink.ENV, raising=False)
    with simlink.simulated_link(None):
        assert simlink.active() is None and simlink.reserve(10 ** 9) is None
    link = simlink.parse_spec("gbps=5,latency_us=20")
    assert link.bandwidth_Bps == 5e9 and link.latency_s == pytest.approx(20e-6)
    assert link.cost(5 * 10 ** 9) == pytest.approx(1.0 + 20e-6)
    assert simlink.parse_spec("off") is None


@pytest.mark.parametrize("spec,match", [("gbps=0", "gbps must be given and > 0"), ("latency_us=5", "gbps must"),
                                        ("gbps=x", "not a number"), ("bw=5", "bad field"),
                                        ("gbps=1,latency_us=-1", "latency_us must be >= 0")])
def test_bad_spec_names_the_field(spec, match):
    with pytest.raises(ValueError, match=match):
        simlink.parse_spec(spec)


def test_link_serialises_reservations():
    with simlink.simulated_link(gbps=1e-3, latency_us=0) as link:      # 1 MB/s
        t0 = time.monotonic()
        a = simlink.reserve(1000)       # 1 ms
        b = simlink.reserve(2000)       # queued behind a: +2 ms
        assert a >= t0 + 1e-3 and b == pytest.approx(a + 2e-3)
        assert link.count == 2 and link.modelled_s == pytest.approx(3e-3)


def _collectives():
    from hyper_parallel import platform as P
    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes

    mesh = MeshContext(MeshSizes(cp=2))
    g = mesh.cp_group
    x = torch.ones(2500)                       # 10 kB: sent 10 kB to the peer
    out = {}
    with simlink.simulated_link(gbps=1e-3, latency_us=100) as link:   # 10 ms + 0.1 ms
        h = P.all_gather(x, g, async_op=True)
        ready = h._ready_at
        y = h.wait()
        out["sync_wait_after_ready"] = time.monotonic() >= ready
        out["ready_minus_launch_ge_cost"] = ready - link.busy_until == 0.0 and link.modelled_s == pytest.approx(
            link.cost(10000))
        chain = P.launch_chain(x, [lambda t: P.all_gather(t, g)], op="t")
        z = chain.wait()
        out["chain_done_after_link"] = time.monotonic() >= link.busy_until
        out["values"] = bool(torch.equal(y, z)) and y.numel() == 5000
    with simlink.simulated_link(None):
        out["off"] = P.all_gather(x, g, async_op=True)._ready_at is None
    return out


def test_handles_wait_for_the_modelled_link(ranks):
    for r in ranks(2).run(_collectives):
        assert all(r.values()), r
