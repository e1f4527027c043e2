"""CPU benchmark: the cost of bidirectional blocks (``q_block`` / ``k_block``, Gemma 3 images) in the engine.

Setting (a Colossal CP rank with all-gathered keys): B=1, Hq=8, Hk=2, D=64, fp32; the second of 2
contiguous shards of S = 4096 (queries at positions [2048, 4096)) against all 4096 keys, causal, full and
with a window of 512; images of 256 tokens every 512 tokens (the first at 128, so one crosses the shard
edge at 2048 and every image crosses a 64-key tile edge or fills whole tiles). With blocks each query of an
image also sees the rest of its image. Compared: the same call without blocks (plain causal).

Time: best of --reps after one warm-up, process CPU time (both threads summed: the steadier number on a
loaded shared machine) and wall clock; fwd under no_grad, fwd+bwd = forward + backward of (out * dout).sum().
Usage: python benchmarks/attention_blocks.py  ->  benchmarks/results/attention_blocks.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from hyper_parallel.ops import attention, engine_info  # noqa: E402

B, HQ, HK, D, S, IMG, EVERY = 1, 8, 2, 64, 4096, 256, 512


def blocks() -> torch.Tensor:
    blk = torch.full((S,), -1, dtype=torch.long)
    for i, start in enumerate(range(128, S, EVERY)):
        blk[start:start + IMG] = i
    return blk


def timed(fn, reps: int) -> tuple:
    fn()
    best = (float("inf"), float("inf"))
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        best = min(best, (time.process_time() - c0, time.perf_counter() - w0))
    return best[0] * 1e3, best[1] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, S // 2, D, generator=g)
    k, v = (torch.randn(B, HK, S, D, generator=g) for _ in range(2))
    dout = torch.randn(B, HQ, S // 2, D, generator=g)
    qp, kp, blk = torch.arange(S // 2, S), torch.arange(S), blocks()
    rows = []
    for window in (None, 512):
        for with_blocks in (False, True):
            kw = dict(q_pos=qp, k_pos=kp, window=window)
            if with_blocks:
                kw.update(q_block=blk[S // 2:], k_block=blk)

            def fwd():
                with torch.no_grad():
                    attention(q, k, v, **kw)

            def fwd_bwd():
                qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                (attention(qq, kk, vv, **kw) * dout).sum().backward()

            f, fb = timed(fwd, args.reps), timed(fwd_bwd, args.reps)
            rows.append({"window": window, "blocks": with_blocks, "fwd_cpu_ms": f[0], "fwd_wall_ms": f[1],
                         "fwd_bwd_cpu_ms": fb[0], "fwd_bwd_wall_ms": fb[1]})
            print(f"window={window} blocks={with_blocks}: fwd {f[0]:.0f} ms cpu ({f[1]:.0f} wall), "
                  f"fwd+bwd {fb[0]:.0f} ms cpu ({fb[1]:.0f} wall)", flush=True)
    out = os.path.join(ROOT, "benchmarks", "results", "attention_blocks.json")
    with open(out, "w") as fh:
        json.dump({"engine": engine_info(), "threads": args.threads, "rows": rows}, fh, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
