"""The packed document stream resumes exactly.

2 ranks, CP=2 (Colossal), packed standard-library documents, held-out evaluation every 2 steps.
The data set is small enough that the 6 steps cross an epoch boundary (the second epoch's order
is a reshuffle by seed). An uninterrupted run of 6 steps is compared with a run stopped at step
3 (checkpoint: model, optimizer, LR schedule, stream state) and resumed to step 6 in a fresh
trainer: every step's loss, valid-token count and grad norm are identical (bitwise: same
arithmetic, same rows), the stream state (global rows consumed, epoch, seed) is the same, and
the held-out losses logged after the resume equal the uninterrupted ones. The same checkpoint
resumed with another batch split (micro-batch 1 x grad accumulation 2 instead of micro-batch 2:
the same global rows per step, but 2x the micro-batches per step, so the old per-rank position
would land on the wrong row) continues at the same global row (the stream's ``rows_consumed``)
and continues the uninterrupted loss curve within rtol 2e-5 (another reduction order).
"""
from __future__ import annotations

from . import _data_workers as D

STEPS, STOP = 6, 3


def test_packed_stream_resumes_exactly(ranks, tmp_path):
    docs = D.short_docs_jsonl(str(tmp_path / "docs.jsonl"), n_docs=24, lo=10, hi=150)
    data = D.data_cfg(docs, str(tmp_path / "cache"), seq_len=64, micro_batch_size=2, eval_fraction=0.1,
                      eval_every=2, eval_batches=1)

    def cfg(name, data=data, **kw):
        kw = kw or {"cp": 2, "method": "colossal"}
        c = D.trainer_cfg(data, steps=STEPS, out_dir=str(tmp_path / name), **kw)
        c["schedule"]["checkpoint_dir"] = str(tmp_path / name / "ckpt")
        return c

    pool = ranks(2)
    full = pool.run(D.resume_run, cfg("full"), STEPS, timeout=300)
    first = pool.run(D.resume_run, cfg("split"), STEPS, STOP, timeout=300)
    rest = pool.run(D.resume_run, cfg("split"), STEPS, None, first[0]["path"], timeout=300)
    epoch = None
    for rank in range(2):
        a, b, c = full[rank], first[rank], rest[rank]
        print(f"rank {rank}: uninterrupted {a['losses']}\n        stopped+resumed {b['losses']} + {c['losses']}")
        assert len(b["losses"]) == STOP and len(c["losses"]) == STEPS - STOP
        assert b["losses"] + c["losses"] == a["losses"], "the resumed loss curve differs"
        assert b["tokens"] + c["tokens"] == a["tokens"]
        assert b["grad_norms"] + c["grad_norms"] == a["grad_norms"]
        assert c["state"] == a["state"], (c["state"], a["state"])
        assert b["state"]["rows_consumed"] == STOP * 2 and a["state"]["rows_consumed"] == STEPS * 2
        # held-out losses: every N-th step and the last step of each train() call (the stopped run
        # also evaluated at step 3); after the resume (steps 4 and 6) they equal the uninterrupted run's
        assert sorted(a["eval"]) == [2, 4, 6] and sorted(c["eval"]) == [2, 3, 4, 6]
        assert {s: c["eval"][s] for s in (2, 4, 6)} == a["eval"]
        epoch = a["state"]["epoch"]
    assert epoch >= 1, "the run should cross an epoch boundary"
    # the same checkpoint with micro-batch 1 x GA 2: the same rows per step, twice the micro-batches
    other = pool.run(D.resume_run, cfg("split", dict(data, micro_batch_size=1), cp=2, method="colossal", ga=2),
                     STEPS, None, first[0]["path"], timeout=300)
    for r in other:
        errs = [abs(x - y) / abs(y) for x, y in zip(r["losses"], full[0]["losses"][STOP:])]
        print(f"resumed with micro-batch 1 x GA 2: {r['losses']} (max rel err {max(errs):.2e}, tol 2e-5)")
        assert r["state"]["position"] == 2 * STEPS
        assert r["state"]["rows_consumed"] == full[0]["state"]["rows_consumed"]
        assert r["tokens"] == full[0]["tokens"][STOP:] and max(errs) <= 2e-5
