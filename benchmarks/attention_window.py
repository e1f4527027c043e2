"""CPU benchmark: sliding-window attention time vs window size (hyper_parallel.ops.attention).

Setting (the context-parallel local attention, all-gathered keys): B=1, Hq=8, Hk=2, D=64,
S_local = 4096 queries = the last rank of C=4 contiguous shards (positions [12288, 16384)),
keys = the whole sequence (S_global = 16384 keys), causal, with a left window ``w``
(key visible iff ``q_pos - w < k_pos <= q_pos``). ``w = full`` is plain causal (no window).
The engine skips every (query tile, key tile) pair outside all windows, so the time should grow
with ``w`` (about ``S_local * (w + tile)`` scores), not with the 16k keys.

Time: best of --reps runs after one warm-up, wall clock and process CPU time (CPU time sums
both threads; on a loaded shared machine it is the steadier number). fwd runs under no_grad;
fwd+bwd is forward plus backward of (out * dout).sum(). Columns also give the visible score
count and the number of tile pairs computed (from the tile rule, as the engine's classifier).

Usage:
  python benchmarks/attention_window.py                    # fp32 + bf16, 2 threads (< 3 min)
  python benchmarks/attention_window.py --dtypes float32 --reps 2
Writes benchmarks/results/attention_window.json and attention_window.png (unless --no-save).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from hyper_parallel.ops import attention, engine_info  # noqa: E402

B, HQ, HK, D, C, S_LOCAL = 1, 8, 2, 64, 4, 4096
WINDOWS = [64, 128, 256, 512, 1024, 2048, 4096, None]
TILE_Q, TILE_K = 64, 64


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "?").strip()
    flags = fields.get("Flags", "")
    feats = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags.split()]
    return f"{name}, {fields.get('CPU(s)', '?').strip()} CPUs, flags: {' '.join(feats) or 'no avx512'}"


def visible_and_pairs(q_pos, k_pos, window):
    """Visible scores and tile pairs the classifier keeps (contiguous positions)."""
    qp, kp = q_pos.view(-1, 1), k_pos.view(1, -1)
    vis = kp <= qp
    if window is not None:
        vis &= kp > qp - window
    n_vis = int(vis.sum())
    pairs = 0
    for q0 in range(0, q_pos.numel(), TILE_Q):
        qmin, qmax = int(q_pos[q0:q0 + TILE_Q].min()), int(q_pos[q0:q0 + TILE_Q].max())
        for k0 in range(0, k_pos.numel(), TILE_K):
            kmin, kmax = int(k_pos[k0:k0 + TILE_K].min()), int(k_pos[k0:k0 + TILE_K].max())
            if kmin > qmax or (window is not None and kmax + window <= qmin):
                continue
            pairs += 1
    return n_vis, pairs


def timed(fn, reps):
    fn()  # warm-up
    best_wall = best_cpu = float("inf")
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        best_wall = min(best_wall, time.perf_counter() - w0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best_wall, best_cpu


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw the PNG from benchmarks/results/attention_window.json")
    args = ap.parse_args()
    if args.plot_only:
        res_dir = os.path.join(ROOT, "benchmarks", "results")
        with open(os.path.join(res_dir, "attention_window.json")) as f:
            data = json.load(f)
        plot(data["rows"], data["meta"], res_dir)
        return
    torch.set_num_threads(args.threads)
    cpu = cpu_name()
    print(f"CPU: {cpu}")
    print(f"engine: {engine_info()}")
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, B={B} Hq={HQ} Hk={HK} "
          f"D={D}, S_local={S_LOCAL} (rank {C - 1} of {C}), keys={C * S_LOCAL}, causal")
    q_pos = torch.arange((C - 1) * S_LOCAL, C * S_LOCAL)
    k_pos = torch.arange(C * S_LOCAL)
    g = torch.Generator().manual_seed(0)
    rows = []
    hdr = (f"{'dtype':9} {'window':>7} {'visible':>11} {'tile pairs':>10} {'fwd ms':>9} "
           f"{'fwd cpu-ms':>10} {'fwd+bwd ms':>10} {'f+b cpu-ms':>10}")
    print(hdr)
    print("-" * len(hdr))
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        q0 = torch.randn(B, HQ, S_LOCAL, D, generator=g).to(dtype)
        k0 = torch.randn(B, HK, C * S_LOCAL, D, generator=g).to(dtype)
        v0 = torch.randn(B, HK, C * S_LOCAL, D, generator=g).to(dtype)
        dout = torch.randn(B, HQ, S_LOCAL, D, generator=g).to(dtype)
        for w in WINDOWS:
            n_vis, pairs = visible_and_pairs(q_pos, k_pos, w)

            def fwd():
                with torch.no_grad():
                    attention(q0, k0, v0, q_pos=q_pos, k_pos=k_pos, window=w)

            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))

            def fwd_bwd():
                out = attention(q, k, v, q_pos=q_pos, k_pos=k_pos, window=w)
                torch.autograd.grad((out * dout).sum(), (q, k, v))

            fw, fc = timed(fwd, args.reps)
            bw, bc = timed(fwd_bwd, args.reps)
            row = dict(dtype=dname, window=w, visible_scores=n_vis, tile_pairs=pairs,
                       fwd_ms=fw * 1e3, fwd_cpu_ms=fc * 1e3, fwd_bwd_ms=bw * 1e3,
                       fwd_bwd_cpu_ms=bc * 1e3)
            rows.append(row)
            print(f"{dname:9} {str(w or 'full'):>7} {n_vis:>11} {pairs:>10} {fw * 1e3:>9.1f} "
                  f"{fc * 1e3:>10.1f} {bw * 1e3:>10.1f} {bc * 1e3:>10.1f}", flush=True)
    if args.no_save:
        return
    res_dir = os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(res_dir, exist_ok=True)
    meta = dict(cpu=cpu, engine=engine_info(), torch=torch.__version__, threads=args.threads,
                reps=args.reps, B=B, Hq=HQ, Hk=HK, D=D, S_local=S_LOCAL, ranks=C,
                keys=C * S_LOCAL, layout=f"rank {C - 1} of {C}, contiguous, causal",
                load_average=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                 time.gmtime()))
    with open(os.path.join(res_dir, "attention_window.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    plot(rows, meta, res_dir)


def plot(rows, meta, res_dir):
    """PNG: wall time and process CPU time vs window (fwd, fwd+bwd, per dtype)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    xs_w = [w for w in WINDOWS if w is not None]
    full_x = 2 * xs_w[-1]
    dtypes = sorted({r["dtype"] for r in rows}, key=lambda d: [r["dtype"] for r in rows].index(d))
    for ax, suffix, what in ((axes[0], "_ms", "wall"), (axes[1], "_cpu_ms", "process CPU")):
        for dname in dtypes:
            for key, style in (("fwd", "-o"), ("fwd_bwd", "--s")):
                ys = [r[key + suffix] for r in rows if r["dtype"] == dname]
                ax.plot(xs_w + [full_x], ys, style, label=f"{dname} {key.replace('_', '+')}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs_w + [full_x])
        ax.set_xticklabels([str(x) for x in xs_w] + ["full\ncausal"])
        ax.set_xlabel("window (keys)")
        ax.set_ylabel(f"time (ms, best of {meta['reps']}, {what})")
        ax.set_title(f"{what} time", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"windowed attention, S_local={meta['S_local']}, {meta['keys']} keys, "
                 f"{meta['threads']} threads, {meta['cpu'][:60]}, "
                 f"load avg {meta['load_average'][0]:.0f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(res_dir, "attention_window.png"), dpi=110)
    print(f"wrote {res_dir}/attention_window.json and attention_window.png")


if __name__ == "__main__":
    main()
