"""Hybrid sub-group rank order is stable and no process group is created after set-up."""
import pytest
import torch.distributed as dist

from hyper_parallel import platform as P
from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
from hyper_parallel.distributed.context_parallel.strategies import build_strategy
from tests.cp.common import global_qkv, mesh_ctx, pg_count, scenario_batch


def steady_state(cp, u, steps):
    ctx = mesh_ctx(cp, (u,))
    before = pg_count()
    first = [dist.get_process_group_ranks(g) for g in ctx.hybrid_groups(u)]
    strategies = {m: build_strategy(m, ctx, ulysses_degree=u if m == "hybrid" else None)
                  for m in ("colossal", "ulysses", "hybrid", "load_balance")}
    local = shard_batch_for_cp(scenario_batch("packed", 2, 16), ctx, "load_balance")
    meta = local.meta
    q, k, v, dout = global_qkv(2, 4, 4, meta.global_seq_len, 4)
    lo, hi = meta.cp_rank * meta.local_seq_len, (meta.cp_rank + 1) * meta.local_seq_len
    for step in range(steps):
        s = strategies[("hybrid", "colossal", "ulysses", "load_balance")[step % 4]] if step % 2 else strategies["hybrid"]
        ql, kl, vl = (t[:, :, lo:hi].clone().requires_grad_(True) for t in (q, k, v))
        s.attention(ql, kl, vl, meta=meta).backward(dout[:, :, lo:hi])
    again = [dist.get_process_group_ranks(g) for g in ctx.hybrid_groups(u)]
    same_objects = all(a is b for a, b in zip(ctx.hybrid_groups(u), (strategies["hybrid"].colossal_group,
                                                                      strategies["hybrid"].ulysses_group)))
    return {"pg_before": before, "pg_after": pg_count(), "first": first, "again": again,
            "same_objects": same_objects, "pending": P.pending_handles()}


@pytest.mark.parametrize("cp,u,steps", [(4, 2, 100), (8, 4, 20)])
def test_no_group_created_and_stable_order(ranks, cp, u, steps):
    res = ranks(cp).run(steady_state, cp, u, steps, timeout=240)
    for r, out in enumerate(res):
        assert out["pg_after"] == out["pg_before"], f"rank {r} created process groups: {out}"
        assert out["first"] == out["again"] and out["same_objects"]
        c, i = divmod(r, u)
        assert out["first"][1] == [c * u + j for j in range(u)]           # ulysses: inner dim
        assert out["first"][0] == [j * u + i for j in range(cp // u)]      # colossal: stride u
        assert out["pending"] == 0, "no collective handle may dangle after forward/backward"
