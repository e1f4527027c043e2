"""Bad input on ONE rank at run time (after preflight): that rank fails at once with the named
error and before issuing any collective; the others, already inside the K/V gather, fail with
CommTimeoutError after accelerator.comm_timeout_s instead of hanging."""
import torch

from hyper_parallel import platform as P
from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta
from hyper_parallel.distributed.context_parallel.strategies import build_strategy
from tests.cp.common import mesh_ctx


def one_rank_bad_length(bad_rank: int):
    ctx = mesh_ctx(2)
    strat = build_strategy("colossal", ctx)
    meta = CPBatchMeta(cp_rank=ctx.cp_rank, cp_size=2, global_seq_len=8, local_seq_len=4, key_doc=None)
    s = 5 if ctx.cp_rank == bad_rank else 4  # this rank's batch slice has the wrong length
    q, k, v = torch.randn(1, 2, s, 4), torch.randn(1, 2, s, 4), torch.randn(1, 2, s, 4)
    P.set_default_timeout(2)
    try:
        with P.comm_counter() as recs:
            try:
                strat.attention(q, k, v, meta=meta)
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                return type(exc).__name__, str(exc), len(recs)
        return "completed", "", len(recs)
    finally:
        P.set_default_timeout(None)


def test_one_bad_rank_at_run_time_fails_every_rank(ranks):
    pool = ranks(2)
    try:
        outs = pool.outcomes(one_rank_bad_length, timeout=60, rank_args=[(1,), (1,)])
    finally:
        pool.shutdown()  # rank 0's gather was abandoned: start fresh
    bad_name, bad_msg, bad_comms = outs[1]
    assert bad_name == "ValueError" and "local sequence length 5 != meta.local_seq_len 4" in bad_msg, outs[1]
    assert bad_comms == 0, "the bad rank issued a collective before rejecting its input"
    good_name, good_msg, _ = outs[0]
    assert good_name == "CommTimeoutError" and "all_gather" in good_msg, outs[0]
