"""Colossal CP with a sliding window: full K/V AllGather vs gathering only the visible chunks.

Setting: C gloo ranks on CPU (default 2), contiguous layout, causal, fp32, B=1, Hq=8, Hk=2,
D=64, S_local = 4096 per rank, window w in {256, 1024, 4096, none}. For each w, every rank
runs one attention step (forward + backward of ``(out * dout).sum()``) two ways on the same
local q/k/v:

* ``allgather``: ``flex_cp_allgather`` (K, V AllGather; backward ReduceScatter) + engine on
  all S keys — what ``AllGatherStrategy`` does when the window reaches back C-1 chunks or more;
* ``trimmed``: ``flex_cp_window_gather`` with ``window_chunk_ranges`` (rank r receives only
  chunks ``max(0, r - ceil((w-1)/L)) .. r``; backward returns dK/dV to the owner) + engine on
  those keys — what the strategy does when the window reaches back fewer than C-1 chunks.
  The benchmark forces it for every w so the two can be compared even where the strategy
  keeps the AllGather (column ``strategy``).

Reported per path: step time (median of --reps after one warm-up, the two paths interleaved;
wall clock and process CPU time, each the max over ranks; on a loaded shared machine the CPU
time is the steadier number, the wall clock mostly measures the wait for descheduled peers),
the collectives
alone (forward + backward of the exchange, median), and the bytes (platform ``comm_counter``,
forward + backward): the most any rank receives, and the total moved (sum of bytes sent).

    python benchmarks/colossal_window.py                      # 2 ranks, S_local 4096 (~3 min)
    python benchmarks/colossal_window.py --cp 4 --seq-local 1024 --windows 256 1024 none
Writes benchmarks/results/colossal_window[_cp{C}].json and .png (unless --no-save).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

B, HQ, HK, D = 1, 8, 2, 64


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def bench_rank(cp: int, L: int, windows: list, reps: int, threads: int) -> dict:
    import torch

    from hyper_parallel import platform as P
    from hyper_parallel.distributed.context_parallel import collectives as C
    from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta
    from hyper_parallel.distributed.context_parallel.methods.colossal.strategy import window_kv_ranges
    from hyper_parallel.distributed.context_parallel.methods.base import engine_attention
    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes

    torch.set_num_threads(threads)
    mesh = MeshContext(MeshSizes(cp=cp))
    group = mesh.cp_mesh.get_group()
    r, S = mesh.cp_rank, cp * L
    meta = CPBatchMeta(cp_rank=r, cp_size=cp, global_seq_len=S, local_seq_len=L, key_doc=None)
    g = torch.Generator().manual_seed(r)
    q0, k0, v0, dout = (torch.randn(B, h, L, D, generator=g) for h in (HQ, HK, HK, HQ))

    def path(kind, w):
        win = S if w is None else w
        if kind == "allgather":
            gather = lambda k, v: C.flex_cp_allgather(k, v, 2, group)  # noqa: E731
            k_pos = meta.k_index
        else:
            ranges = C.window_chunk_ranges(cp, L, win, True)
            lo, hi = ranges[r]
            gather = lambda k, v: C.flex_cp_window_gather(k, v, 2, group, ranges)  # noqa: E731
            k_pos = meta.k_index[lo * L:(hi + 1) * L]

        def step():
            q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
            ka, va = gather(k, v)
            out = engine_attention(q, ka, va, q_pos=meta.q_index, k_pos=k_pos, meta=meta, window=w)
            out.backward(dout)

        def comm():
            k, v = (t.clone().requires_grad_(True) for t in (k0, v0))
            ka, va = gather(k, v)
            (ka.sum() + va.sum()).backward()
        return step, comm, len(k_pos)

    rows = []
    for w in windows:
        fns = {kind: path(kind, w) for kind in ("allgather", "trimmed")}
        res = {"window": w, "strategy": "allgather" if window_kv_ranges(cp, L, w, True) is None else "trimmed"}
        for kind, (step, comm, nkeys) in fns.items():
            with P.comm_counter() as recs:
                step()                                     # warm-up, and the byte count
            res[f"{kind}/sent"] = sum(c.bytes_sent for c in recs)
            res[f"{kind}/recv"] = sum(c.bytes_received for c in recs)
            res[f"{kind}/keys"] = nkeys
        times = {f"{k}/{what}": [] for k in fns for what in ("step_ms", "step_cpu_ms", "comm_ms")}
        for _ in range(reps):
            for kind, (step, comm, _n) in fns.items():  # interleaved: load drifts hit both paths
                for what, fn in (("step", step), ("comm", comm)):
                    P.barrier(group)
                    t0, c0 = time.perf_counter(), time.process_time()
                    fn()
                    times[f"{kind}/{what}_ms"].append(1e3 * (time.perf_counter() - t0))
                    if what == "step":
                        times[f"{kind}/step_cpu_ms"].append(1e3 * (time.process_time() - c0))
        res.update({k: statistics.median(v) for k, v in times.items()})
        rows.append(res)
    return {"rank": r, "rows": rows}


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["window"]) for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for off, kind in ((-0.2, "allgather"), (0.2, "trimmed")):
        axes[0].bar([i + off for i in x], [r[f"{kind}/step_cpu_ms"] for r in rows], 0.4, label=kind)
        axes[1].bar([i + off for i in x], [r[f"{kind}/comm_ms"] for r in rows], 0.4, label=kind)
        axes[2].bar([i + off for i in x], [r[f"{kind}/bytes_total"] / 2**20 for r in rows], 0.4, label=kind)
    axes[0].set_ylabel("fwd+bwd step, process CPU ms\n(max over ranks)")
    axes[1].set_ylabel("K/V exchange fwd+bwd, wall ms")
    axes[2].set_ylabel("MiB moved (fwd+bwd, all ranks)")
    for ax in axes:
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("window")
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq-local", type=int, default=4096)
    ap.add_argument("--windows", nargs="+", default=["256", "1024", "4096", "none"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    windows = [None if w == "none" else int(w) for w in args.windows]
    from hyper_parallel.testing import RankPool

    t0 = time.time()
    pool = RankPool(args.cp)
    try:
        res = pool.run(bench_rank, args.cp, args.seq_local, windows, args.reps, args.threads, timeout=1800)
    finally:
        pool.shutdown()
    rows = []
    for i, w in enumerate(windows):
        per = [rr["rows"][i] for rr in res]
        row = {"window": w, "strategy": per[0]["strategy"]}
        for kind in ("allgather", "trimmed"):
            for what in ("step_ms", "step_cpu_ms", "comm_ms"):
                row[f"{kind}/{what}"] = max(p[f"{kind}/{what}"] for p in per)
            row[f"{kind}/recv_max_rank"] = max(p[f"{kind}/recv"] for p in per)
            row[f"{kind}/bytes_total"] = sum(p[f"{kind}/sent"] for p in per)
            row[f"{kind}/keys_per_rank"] = [p[f"{kind}/keys"] for p in per]
        rows.append(row)
    cpu = cpu_name()
    load = os.getloadavg()
    title = (f"Colossal window, C={args.cp} gloo ranks x {args.threads} thread, S_local={args.seq_local}, fp32, "
             f"B={B} Hq={HQ} Hk={HK} D={D}, causal; {cpu}; load {load[0]:.1f}")
    print(title)
    print(f"{'window':>6} {'strategy':>9} | {'step ms AG':>10} {'trim':>8} | {'step cpu ms AG':>14} {'trim':>6} | "
          f"{'comm ms AG':>10} {'trim':>6} | "
          f"{'recv MiB max rank AG':>20} {'trim':>6} | {'MiB moved AG':>12} {'trim':>6}")
    for row in rows:
        mib = lambda k: row[k] / 2**20  # noqa: E731
        print(f"{str(row['window']):>6} {row['strategy']:>9} | {row['allgather/step_ms']:10.1f} "
              f"{row['trimmed/step_ms']:8.1f} | {row['allgather/step_cpu_ms']:14.1f} {row['trimmed/step_cpu_ms']:6.1f} | "
              f"{row['allgather/comm_ms']:10.1f} {row['trimmed/comm_ms']:6.1f} | "
              f"{mib('allgather/recv_max_rank'):20.1f} {mib('trimmed/recv_max_rank'):6.1f} | "
              f"{mib('allgather/bytes_total'):12.1f} {mib('trimmed/bytes_total'):6.1f}")
    print(f"({time.time() - t0:.0f} s)")
    if not args.no_save:
        out_dir = os.path.join(ROOT, "benchmarks", "results")
        base = os.path.join(out_dir, "colossal_window" + ("" if args.cp == 2 else f"_cp{args.cp}"))
        meta = {"cpu": cpu, "cp": args.cp, "threads_per_rank": args.threads, "S_local": args.seq_local,
                "B": B, "Hq": HQ, "Hk": HK, "D": D, "dtype": "float32", "causal": True, "reps": args.reps,
                "load_average": list(load), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "time_note": "step/comm ms: median over reps per rank, max over ranks",
                "bytes_note": "fwd+bwd; recv_max_rank: the most any rank receives; bytes_total: sum over ranks "
                              "of bytes sent (each byte once)"}
        with open(base + ".json", "w") as fh:
            json.dump({"meta": meta, "rows": rows, "per_rank": res}, fh, indent=2)
        plot(rows, base + ".png", title)
        print(f"wrote {base}.json, {base}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
