"""Attention engine CPU time per CP rank on the main job's packed rows: contiguous, Head-Tail and the
balanced split (solved on visible pairs, and on engine tiles: the cost model's default).

For each row (documents of the main job packed into ``--seq`` tokens, as in
``benchmarks/load_balance.py``) and each of ``--cp`` ranks, the exact engine calls that rank makes
in one attention layer — same query/key positions and document ids as the strategies pass
(``HeadTailStrategy``: its head and tail sub-chunk against the key prefixes; ``BalancedStrategy``:
its permuted slots against all keys; ``colossal``: its contiguous chunk against all keys) — are
run forward + backward on random q/k/v with the main job's head shape (4 query heads, 2 KV heads,
head dim 32, fp32), one thread, timed in process CPU time, sequentially in one process (no
collective). Load noise: ``--repeats`` rounds, each round runs every rank once (interleaved, so a
load change hits all ranks of a round alike); a rank's time = the median over rounds of its time
over the round's mean time (times the overall mean). Also the engine tiles each rank computes
(``balance/tiles.py``, the count the engine's tile skipping gives)::

    python benchmarks/load_balance_engine.py [--seq 32768] [--cp 4] [--rows 3] [--repeats 7]

Writes ``benchmarks/results/load_balance_engine_<seq>_cp<cp>.json``.
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


def rank_inputs(meta, method: str, seed: int) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for q_pos, k_pos in rank_calls(meta, method):
        q = torch.randn(1, 4, q_pos.numel(), 32, generator=g).requires_grad_(True)
        k = torch.randn(1, 2, k_pos.numel(), 32, generator=g).requires_grad_(True)
        v = torch.randn(1, 2, k_pos.numel(), 32, generator=g).requires_grad_(True)
        out.append((q, k, v, q_pos, k_pos, meta.doc_slice(q_pos), meta.doc_slice(k_pos)))
    return out


def run_rank(calls: list) -> float:
    import torch

    from hyper_parallel import ops

    t = 0.0
    for q, k, v, q_pos, k_pos, q_doc, k_doc in calls:
        t0 = time.process_time()
        out = ops.attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=True, q_doc=q_doc, k_doc=k_doc)
        out.backward(torch.ones_like(out))
        t += time.process_time() - t0
    return t


def rank_tiles(meta, method: str, tiles: np.ndarray) -> float:
    """Engine tiles of one rank: its query blocks' tile counts (Head-Tail: keys are prefixes, same count)."""
    blocks = np.unique(np.concatenate([q.numpy() for q, _ in rank_calls(meta, method)]) // 64)
    return float(tiles[blocks].sum())


def main(argv=None) -> dict:
    import torch

    from hyper_parallel.distributed.context_parallel.balance.split import BalancedSplit
    from hyper_parallel.distributed.context_parallel.balance.tiles import block_tiles
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--methods", default="head_tail,balanced_pairs,balanced")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out_path = args.out or os.path.join(ROOT, "benchmarks", "results", f"load_balance_engine_{args.seq}_cp{args.cp}.json")
    torch.set_num_threads(1)
    rows = packed_rows(stdlib_lengths(), args.seq, args.rows, np.random.default_rng(0))
    policies = {"colossal": "all_gather", "head_tail": "load_balance", "balanced_pairs": BalancedSplit(cost="pairs"),
                "balanced": BalancedSplit()}
    load0 = [round(x, 2) for x in os.getloadavg()]
    out = []
    for i, row in enumerate(rows):
        batch = {"input_ids": torch.ones(1, args.seq, dtype=torch.long), "seq_lens": torch.tensor([row])}
        for method in args.methods.split(","):
            metas = [shard_batch_for_cp(batch, (r, args.cp), policies[method]).meta for r in range(args.cp)]
            tiles = block_tiles(metas[0].key_doc[0].numpy(), 64)
            calls = [rank_inputs(m, method.split("_pairs")[0], 10 * i + r) for r, m in enumerate(metas)]
            t = np.array([[run_rank(c) for c in calls] for _ in range(args.repeats)])   # [rounds, ranks]
            rel = np.median(t / t.mean(axis=1, keepdims=True), axis=0)
            secs = rel * t.mean()
            nt = [rank_tiles(m, method.split("_pairs")[0], tiles) for m in metas]
            rec = {"row": i, "docs": len(row), "method": method, "rank_cpu_s": [round(float(s), 4) for s in secs],
                   "max_over_mean": float(secs.max() / secs.mean()), "rank_tiles": nt,
                   "tiles_max_over_mean": max(nt) / (sum(nt) / len(nt)),
                   "raw_median_max_over_mean": float(np.median(t, 0).max() / np.median(t, 0).mean())}
            out.append(rec)
            print(f"row {i} ({len(row)} docs) {method:<14} per-rank engine CPU s {rec['rank_cpu_s']} max/mean "
                  f"{rec['max_over_mean']:.3f} (raw medians {rec['raw_median_max_over_mean']:.3f}); tiles "
                  f"{rec['tiles_max_over_mean']:.3f}", flush=True)
    meta = {"cpu": cpu_name(), "cores": os.cpu_count(), "loadavg_1_5_15_start": load0,
            "loadavg_1_5_15_end": [round(x, 2) for x in os.getloadavg()], "seq": args.seq, "cp": args.cp,
            "threads": 1, "repeats": args.repeats, "heads": "Hq 4, Hk 2, D 32, fp32, fwd+bwd, one layer"}
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump({"machine": meta, "results": out}, fh, indent=1)
    print(meta)
    return {"machine": meta, "results": out}


if __name__ == "__main__":
    main()
