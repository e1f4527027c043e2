"""Platform layer: backend mapping, collectives, async handles, byte accounting, timeouts."""
import datetime

import pytest
import torch
import torch.distributed as dist

from hyper_parallel import platform as P


def test_backend_mapping():
    assert P.get_platform("cpu").backend == "gloo"
    assert not P.get_platform("cpu").has_streams


def test_npu_requested_but_absent_is_clear():
    with pytest.raises(P.PlatformError, match="torch_npu"):
        P.get_platform("npu")


def test_unknown_device():
    with pytest.raises(P.PlatformError, match="not supported"):
        P.get_platform("tpu")


def test_cpu_streams_are_noops():
    assert P.comm_stream("cpu") is None
    ev = P.new_event("cpu")
    ev.record()
    ev.wait()
    with P.stream_context(None):
        pass


def collectives_roundtrip():
    r, w = dist.get_rank(), dist.get_world_size()
    g = dist.group.WORLD
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r
    with P.comm_counter() as recs:
        gathered = P.all_gather(x, g, dim=1)                         # [2, 3w]
        rs = P.reduce_scatter(torch.ones(2 * w, 3) * (r + 1), g, dim=0)  # [2, 3]
        a2a = P.all_to_all(torch.full((w, 4), float(r)), g, scatter_dim=0, gather_dim=1)
        h = P.all_reduce(torch.tensor([float(r)]), g, async_op=True)
        pending_during = P.pending_handles()
        total = h.wait()
    expect_gather = torch.cat([torch.arange(6.).reshape(2, 3) + 10 * i for i in range(w)], dim=1)
    return {
        "gather_ok": torch.equal(gathered, expect_gather),
        "rs_ok": torch.equal(rs, torch.full((2, 3), float(sum(range(1, w + 1))))),
        "a2a_ok": torch.equal(a2a, torch.arange(w, dtype=torch.float32).repeat_interleave(4).reshape(1, 4 * w)),
        "allreduce": float(total.item()),
        "pending_during": pending_during,
        "pending_after": P.pending_handles(),
        "records": [(c.op, c.bytes_sent, c.bytes_received) for c in recs],
    }


@pytest.mark.parametrize("world", [2, 4])
def test_collectives(ranks, world):
    res = ranks(world).run(collectives_roundtrip)
    for r in res:
        assert r["gather_ok"] and r["rs_ok"] and r["a2a_ok"]
        assert r["allreduce"] == sum(range(world))
        assert r["pending_during"] >= 1 and r["pending_after"] == 0
        ops = dict((op, (s, rcv)) for op, s, rcv in r["records"])
        assert ops["all_gather"] == (24 * (world - 1),) * 2          # 6 fp32 = 24 bytes per shard
        assert ops["reduce_scatter"] == (2 * world * 3 * 4 * (world - 1) // world,) * 2
        assert ops["all_to_all"] == (world * 4 * 4 * (world - 1) // world,) * 2


def backend_release_run():
    """Every collective's platform buffers are freed at wait(); after wait_backend_released the
    backend holds none of the caller's tensors either (inputs dropped by the caller right after)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from hyper_parallel.platform.release import wait_backend_released
    from hyper_parallel.testing import scaled

    r, w, g = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    inputs, results, temps = [], [], []
    for call in (lambda x: P.all_gather(x, g, dim=1, async_op=True),
                 lambda x: P.reduce_scatter(x, g, dim=0, async_op=True),
                 lambda x: P.all_to_all(x, g, scatter_dim=0, gather_dim=1, async_op=True),
                 lambda x: P.all_to_all_uneven(x, g, [1] * w, [1] * w, dim=0, async_op=True)):
        x = torch.full((2 * w, 3), float(r + 1))
        inputs.append(StorageWeakRef(x.untyped_storage()))
        h = call(x)
        del x
        temps.append([t for t in h._temps])
        results.append(h.wait())
    freed = [all(t.untyped_storage().nbytes() == 0 for t in ts) for ts in temps]
    temps.clear()
    wait_backend_released(scaled(60))      # a hang bound, not a window
    return {"freed": freed, "inputs_released": [ref.expired() for ref in inputs],
            "results_intact": all(t.untyped_storage().nbytes() > 0 for t in results),
            "uneven_ok": torch.equal(results[3], torch.arange(1, w + 1, dtype=torch.float32).repeat_interleave(6)
                                     .reshape(2 * w, 3))}


def test_collective_buffers_are_freed_at_wait_and_released_by_the_backend(ranks):
    """Memory tests read counters after this synchronisation point instead of a time window."""
    for r, res in enumerate(ranks(2).run(backend_release_run)):
        print(f"rank {r}: temporaries freed {res['freed']}, caller inputs released {res['inputs_released']}")
        assert res["freed"] == [True] * 4 and res["results_intact"] and res["uneven_ok"], res
        assert res["inputs_released"] == [True] * 4, res


def test_group_size_one_is_identity_without_collective():
    x = torch.randn(3, 4)
    with P.comm_counter() as recs:
        assert P.all_gather(x, None, dim=0) is x
        assert P.reduce_scatter(x, None) is x
        assert P.all_to_all(x, None, 0, 1) is x
        assert P.all_gather(x, None, async_op=True).wait() is x
    assert recs == []


def divisibility_error():
    P.all_to_all(torch.ones(3, 2), dist.group.WORLD, scatter_dim=0, gather_dim=1)


def test_all_to_all_checks_divisibility(ranks):
    outs = ranks(2).outcomes(divisibility_error)
    assert all(isinstance(o, ValueError) and "not divisible by group size 2" in str(o) for o in outs)


def wait_times_out():
    import time
    if dist.get_rank() == 1:
        time.sleep(4)  # arrive late; rank 0's handle must time out first
        return "late"
    h = P.all_reduce(torch.ones(1), dist.group.WORLD, async_op=True)
    h._timeout = datetime.timedelta(seconds=1)
    try:
        h.wait()
    except P.CommTimeoutError as exc:
        return f"timeout: {exc}"
    return "no timeout"


def test_wait_has_timeout(ranks):
    pool = ranks(2)
    outs = pool.outcomes(wait_times_out, timeout=60)
    assert outs[1] == "late"
    assert outs[0].startswith("timeout: collective all_reduce"), outs[0]
    pool.shutdown()  # the late rank never joined the collective: start fresh
