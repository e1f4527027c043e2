"""Upper bound on engine / SDPA speed-up for fp32 on this CPU (the last-rank fwd+bwd case).

The question this answers: how fast could *any* implementation of the engine's exact fp32
computation be on this machine, and is the ">= 1.5x SDPA-with-mask, fwd+bwd" target reachable
for the heaviest context-parallel rank (r = C-1, 7/8 of the score matrix visible)?

Model (stated so that it can be checked):
  * FLOPs: the engine computes only visible (query tile, key tile) pairs (Bq = min(64, Sq),
    Bk = kTileK = 64), each with 2 tile GEMMs forward (S = Q K^T, O += P V) and 5 backward
    (S again, dV += P^T dO, dP = dO V^T, dQ += dS K, dK += dS^T Q): 2 * Bq * Bk * D flops each.
  * GEMM rate: the best fp32 torch.mm rate measured in this run (2048^2 and 4096^2, all torch
    threads): the tile GEMMs are assumed to run at 100 % of it (generous: in situ they run at
    ~88 % of it, docs/performance.md).
  * Element-wise work: on AVX-512 CPUs with two 512-bit FMA pipes (Sapphire Rapids, Zen 4) the
    GEMM FMAs and the softmax arithmetic issue on the same two vector ports. Per 16 scores the
    GEMMs need 2*D (forward) and 5*D (backward) vector FMAs; the softmax needs E_FWD vector
    ops (running max, exp2 polynomial, row sum) and E_BWD (exp2 of S - lse, dS = P (dP - delta)),
    counted in the disassembly of the AVX-512 build (loads and stores excluded: other ports).
    So the forward can reach at most 2D / (2D + E_FWD) of the GEMM rate and the backward
    5D / (5D + E_BWD).
  ceiling time = fwd FLOPs / (rate * eff_fwd) + bwd FLOPs / (rate * eff_bwd); the best possible
  ratio is SDPA time / ceiling time, with SDPA (the issue's baseline (a): bool offset mask built
  inside the timed region, enable_gqa) and the engine timed in the same run, interleaved.

Usage:
  python benchmarks/attention_cpu_ceiling.py             # S_local = 1k, 2k, 4k (~2 min)
  python benchmarks/attention_cpu_ceiling.py --sizes 1024 --reps 5
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_cpu import C, D, HQ, ROOT, Problem, engine_call, machine, sdpa_call  # noqa: E402

E_FWD = 19  # vector ALU ops per 16 scores, forward softmax (softmax_tile, AVX-512 build)
E_BWD = 16  # backward: P = 2^(S - lse2) and dS = P (dP - delta) (bwd_f32, AVX-512 build)
BK = 64  # kTileK (csrc/attention/kernel_api.h)


def mm_rate_gflops(reps: int) -> dict:
    """Best fp32 torch.mm rate (GFLOP/s) at 2048^2 and 4096^2."""
    out = {}
    for n in (2048, 4096):
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        out[f"fp32_{n}"] = 2 * n**3 / best / 1e9
    return out


def visible_tile_pairs(s_local: int, rank: int) -> tuple[int, int]:
    """(visible, total) (query tile, key tile) pairs per head for rank `rank`'s contiguous
    queries against all C * s_local keys, causal, with the engine's tile sizes."""
    bq = min(64, s_local)
    q0 = rank * s_local
    nqt, nkt = s_local // bq, C * s_local // BK
    q_max = q0 + torch.arange(1, nqt + 1) * bq - 1  # last position in each query tile
    k_min = torch.arange(nkt) * BK  # first position in each key tile
    visible = int((k_min[None, :] <= q_max[:, None]).sum())
    return visible, nqt * nkt


def best_of(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "attention_cpu_ceiling.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    eff_fwd = 2 * D / (2 * D + E_FWD)
    eff_bwd = 5 * D / (5 * D + E_BWD)
    mm = mm_rate_gflops(args.reps)
    rate = max(mm.values()) * 1e9
    rows = []
    for s_local in args.sizes:
        r = C - 1
        p = Problem(s_local, r, torch.float32, seed=r)
        reps = args.reps if s_local < 4096 else max(2, args.reps - 1)
        eng = sdpa = float("inf")
        engine_call(p, True)
        sdpa_call(p, True, "enable_gqa")
        for _ in range(reps):  # interleaved, best of each
            eng = min(eng, best_of(lambda: engine_call(p, True), 1))
            sdpa = min(sdpa, best_of(lambda: sdpa_call(p, True, "enable_gqa"), 1))
        vis, total = visible_tile_pairs(s_local, r)
        bq = min(64, s_local)
        tile_flops = 2 * bq * BK * D * HQ  # one tile GEMM over all heads
        f_fwd, f_bwd = 2 * vis * tile_flops, 5 * vis * tile_flops
        ceiling = f_fwd / (rate * eff_fwd) + f_bwd / (rate * eff_bwd)
        sdpa_flops = 7 * total * tile_flops  # SDPA computes every pair (it cannot skip)
        rows.append(dict(
            s_local=s_local, s_global=C * s_local, rank=r, visible_tile_fraction=vis / total,
            engine_gflop=(f_fwd + f_bwd) / 1e9, engine_fwd_bwd_s=eng, sdpa_fwd_bwd_s=sdpa,
            ceiling_fwd_bwd_s=ceiling, engine_fraction_of_ceiling=ceiling / eng,
            sdpa_fraction_of_mm_rate=sdpa_flops / sdpa / rate,
            ratio_achieved=sdpa / eng, ratio_ceiling=sdpa / ceiling))
    print(f"\nfp32, last rank (r = C-1), fwd+bwd. GEMM rate (best torch.mm) = {rate / 1e9:.0f} "
          f"GFLOP/s; port bound: fwd {eff_fwd:.3f}, bwd {eff_bwd:.3f} of it.")
    hdr = (f"{'S_loc':>5} {'visible':>7} {'GFLOP':>6} | {'ceiling':>8} {'engine':>8} {'eng/ceil':>8} | "
           f"{'SDPA':>8} {'SDPA/mm':>7} | {'SDPA/eng':>8} {'SDPA/ceil':>9}")
    print(hdr)
    print("-" * len(hdr))
    for e in rows:
        print(f"{e['s_local']:>5} {e['visible_tile_fraction']:>7.3f} {e['engine_gflop']:>6.1f} | "
              f"{e['ceiling_fwd_bwd_s'] * 1e3:>6.1f}ms {e['engine_fwd_bwd_s'] * 1e3:>6.1f}ms "
              f"{e['engine_fraction_of_ceiling']:>8.2f} | {e['sdpa_fwd_bwd_s'] * 1e3:>6.1f}ms "
              f"{e['sdpa_fraction_of_mm_rate']:>7.2f} | {e['ratio_achieved']:>7.2f}x "
              f"{e['ratio_ceiling']:>8.2f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(dict(what=__doc__.split("\n")[0], machine=machine(), mm_gflops=mm,
                       e_fwd=E_FWD, e_bwd=E_BWD, eff_fwd=eff_fwd, eff_bwd=eff_bwd,
                       rows=rows), fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
