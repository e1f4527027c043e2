"""Attention engine CPU time per CP rank on the main job's packed rows: Head-Tail vs the balanced split.

For each row (documents of the main job packed into ``--seq`` tokens, as in
``benchmarks/load_balance.py``) and each of ``--cp`` ranks, the exact engine calls that rank makes
in one attention layer — same query/key positions and document ids as the strategies pass
(``HeadTailStrategy``: its head and tail sub-chunk against the key prefixes; ``BalancedStrategy``:
its permuted slots against all keys; ``colossal``: its contiguous chunk against all keys) — are
run forward + backward on random q/k/v with the main job's head shape (4 query heads, 2 KV heads,
head dim 32, fp32), one thread, and timed in process CPU time (so it holds with more ranks than
cores; run sequentially in one process, no collective; best of 2 per call). Reports per-rank
seconds and slowest/mean::

    python benchmarks/load_balance_engine.py [--seq 32768] [--cp 4] [--rows 2]

Writes ``benchmarks/results/load_balance_engine.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._machine import cpu_name  # noqa: E402
from benchmarks.load_balance import packed_rows, stdlib_lengths  # noqa: E402


def rank_calls(meta, method: str) -> list:
    """[(q_pos, k_pos)] of one rank's engine calls in one layer."""
    import torch

    from hyper_parallel.distributed.context_parallel.collectives import head_tail_sub_chunks

    if method != "head_tail":
        return [(meta.q_index, meta.k_index)]
    C, r, S = meta.cp_size, meta.cp_rank, meta.global_seq_len
    sub = S // (2 * C)
    return [(torch.arange(c * sub, (c + 1) * sub), torch.arange((c + 1) * sub)) for c in head_tail_sub_chunks(r, C)]


def time_rank(meta, method: str, seed: int, repeat: int = 2) -> float:
    import torch

    from hyper_parallel import ops

    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for q_pos, k_pos in rank_calls(meta, method):
        q = torch.randn(1, 4, q_pos.numel(), 32, generator=g).requires_grad_(True)
        k = torch.randn(1, 2, k_pos.numel(), 32, generator=g).requires_grad_(True)
        v = torch.randn(1, 2, k_pos.numel(), 32, generator=g).requires_grad_(True)
        q_doc, k_doc = meta.doc_slice(q_pos), meta.doc_slice(k_pos)
        best = float("inf")
        for _ in range(repeat):                      # best of `repeat` (the first also warms the engine up)
            t0 = time.process_time()
            out = ops.attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=True, q_doc=q_doc, k_doc=k_doc)
            out.backward(torch.ones_like(out))
            best = min(best, time.process_time() - t0)
        total += best
    return total


def main(argv=None) -> dict:
    import torch

    from hyper_parallel.distributed.context_parallel.balance.split import BalancedSplit, split_report
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "load_balance_engine.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = packed_rows(stdlib_lengths(), args.seq, args.rows, np.random.default_rng(0))
    policies = {"colossal": "all_gather", "head_tail": "load_balance", "balanced": BalancedSplit()}
    out = []
    for i, row in enumerate(rows):
        batch = {"input_ids": torch.ones(1, args.seq, dtype=torch.long), "seq_lens": torch.tensor([row])}
        for method, policy in policies.items():
            metas = [shard_batch_for_cp(batch, (r, args.cp), policy).meta for r in range(args.cp)]
            secs = [time_rank(m, method, 10 * i + r) for r, m in enumerate(metas)]
            rec = {"row": i, "docs": len(row), "method": method, "rank_cpu_s": [round(s, 3) for s in secs],
                   "max_over_mean": max(secs) / (sum(secs) / len(secs))}
            if method == "balanced":
                rep = split_report(metas[0].key_doc, 1, metas[0].global_seq_len, args.cp, policy)
                rec["split_ms"] = rep["seconds"] * 1e3
                rec["split_over_attention_fwd_bwd"] = rep["seconds"] / max(secs)
            out.append(rec)
            print(f"row {i} ({len(row)} docs) {method:<9} per-rank engine CPU s {rec['rank_cpu_s']} "
                  f"max/mean {rec['max_over_mean']:.3f}" + (f"  split {rec['split_ms']:.1f} ms" if "split_ms" in rec
                                                           else ""), flush=True)
    meta = {"cpu": cpu_name(), "cores": os.cpu_count(), "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "seq": args.seq, "cp": args.cp, "threads": 1, "heads": "Hq 4, Hk 2, D 32, fp32, fwd+bwd, one layer"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"machine": meta, "results": out}, fh, indent=1)
    print(meta)
    return {"machine": meta, "results": out}


if __name__ == "__main__":
    main()
