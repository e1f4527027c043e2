"""CUDA benchmark of hyper_parallel.ops.attention (the routed CUDA path; before the routes: FlexAttention) against
SDPA with the materialised offset mask and SDPA's own causal kernel (which cannot express the
CP offset; a lower bound on what a fused causal kernel costs).

Setting as benchmarks/attention_cpu.py: B=1, Hq=8, Hk=2, D=64 (override with --heads/--dim),
C=4 ranks, S_global = 4 * S_local, queries = the last rank's contiguous chunk (7/8 of the score
matrix visible) and the rank average. Times are CUDA-event medians of --reps after warm-up;
memory is torch.cuda.max_memory_allocated growth during one call. Prints a table, writes JSON.

Not run by CI (no GPU there). scripts/device_check.sh now runs benchmarks/attention_routes.py
(per route, per visible score, vs SDPA flash / cuDNN; the FlexAttention path is its case ``flex``);
this script's H200 result of the FlexAttention path is recorded in docs/performance.md.

  python benchmarks/attention_cuda.py --out benchmarks/results/attention_cuda.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from hyper_parallel.ops import attention  # noqa: E402

C = 4


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn() over reps CUDA-event timed calls (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del res
    return (peak - base) / 2**20


def run_case(s_local, rank, dtype, hq, hk, d, reps):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(rank)
    sq, sk = s_local, C * s_local
    mk = lambda h, s: torch.randn(1, h, s, d, device=dev, dtype=dtype, generator=g)  # noqa: E731
    q, k, v, dout = mk(hq, sq), mk(hk, sk), mk(hk, sk), mk(hq, sq)
    q_pos = torch.arange(rank * s_local, (rank + 1) * s_local, device=dev)
    k_pos = torch.arange(sk, device=dev)

    def engine(grad):
        qq, kk, vv = (t.detach().requires_grad_(grad) for t in (q, k, v))
        out = attention(qq, kk, vv, q_pos=q_pos, k_pos=k_pos, causal=True)
        if grad:
            out.backward(dout)
        return out

    def sdpa_mask(grad):
        qq, kk, vv = (t.detach().requires_grad_(grad) for t in (q, k, v))
        mask = k_pos[None, :] <= q_pos[:, None]  # [Sq, Sk], built inside the timed region
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)
        if grad:
            out.backward(dout)
        return out

    def sdpa_causal(grad):  # wrong offset (top-left causal), timing reference only
        qq, kk, vv = (t.detach().requires_grad_(grad) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        if grad:
            out.backward(dout)
        return out

    with torch.no_grad():
        ref = sdpa_mask(False)
        got = engine(False)
    err = (got.float() - ref.float()).abs().max().item()
    row = dict(s_local=s_local, rank=rank, dtype=str(dtype).replace("torch.", ""),
               max_abs_vs_sdpa=err)
    for name, fn in (("engine", engine), ("sdpa_mask", sdpa_mask), ("sdpa_causal", sdpa_causal)):
        with torch.no_grad():
            row[f"{name}_fwd_ms"] = timed(lambda: fn(False), reps)
        row[f"{name}_fwd_bwd_ms"] = timed(lambda: fn(True), reps)
        row[f"{name}_fwd_bwd_peak_mib"] = peak_mib(lambda: fn(True))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--heads", type=int, nargs=2, default=[8, 2], metavar=("HQ", "HK"))
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "attention_cuda.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_cuda.py needs a CUDA device (torch.cuda.is_available() is False)")
    dt = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)
    rows = []
    for name in args.dtypes:
        for s in args.sizes:
            for r in range(C):
                row = run_case(s, r, dt[name], *args.heads, args.dim, args.reps)
                rows.append(row)
                print(json.dumps(row), flush=True)
    hdr = ("S_loc dtype rank | eng fwd  sdpa-mask  x | eng f+b  sdpa-mask  x  sdpa-causal | "
           "MiB eng / mask")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in rows:
        print(f"{r['s_local']:5d} {r['dtype']:5s} {r['rank']:4d} | {r['engine_fwd_ms']:7.2f} "
              f"{r['sdpa_mask_fwd_ms']:9.2f} {r['sdpa_mask_fwd_ms'] / r['engine_fwd_ms']:4.2f} | "
              f"{r['engine_fwd_bwd_ms']:7.2f} {r['sdpa_mask_fwd_bwd_ms']:9.2f} "
              f"{r['sdpa_mask_fwd_bwd_ms'] / r['engine_fwd_bwd_ms']:4.2f} "
              f"{r['sdpa_causal_fwd_bwd_ms']:11.2f} | {r['engine_fwd_bwd_peak_mib']:6.0f} / "
              f"{r['sdpa_mask_fwd_bwd_peak_mib']:6.0f}")
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                cuda=torch.version.cuda, heads=args.heads, dim=args.dim, C=C)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(dict(machine=info, results=rows), fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
