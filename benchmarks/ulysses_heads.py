"""Colossal vs Ulysses (replicated KV / uneven heads) vs Hybrid: bytes per layer and step time.

Two parts, both written to benchmarks/results/ulysses_heads.json:

* **bytes per layer (analytic)** for real head layouts at real degrees: per rank, forward +
  backward, the most any rank receives, in units of one head's sequence chunk ``B·(S/C)·D·e``
  (multiply by ``B·S·D·e / C`` for bytes). Colossal: ``2·Hk·(C-1)`` per direction; Ulysses and
  Hybrid: the per-rank formulas of docs/strategies/ulysses.md / hybrid.md with the head layout
  :func:`~hyper_parallel.distributed.context_parallel.methods.ulysses.layout.ulysses_head_layout`
  picks (the same formulas tests/cp/test_comm_volume.py checks against the measured bytes);
* **measured** on C gloo CPU ranks: one attention layer step (``strategy.attention`` forward +
  backward, fp32, causal, B=1, D=64) for each method on the same local q/k/v, bytes from the
  platform ``comm_counter`` and the step time (median of --reps after a warm-up, methods
  interleaved; wall and process CPU ms, max over ranks). On a shared CPU box the gloo
  all-to-all is slow and noisy: the times say which method moves less, not GPU speed.

    python benchmarks/ulysses_heads.py                 # C=4, S_local 512 (~1-2 min)
    python benchmarks/ulysses_heads.py --cp 4 --seq-local 1024 --reps 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

B, D = 1, 64
# (model, Hq, Hk): public head layouts (attention heads / KV heads of the released configs)
MODELS = [("Llama-3-70B / Qwen3-32B / gpt-oss (64/8)", 64, 8), ("Qwen2.5-7B (28/4)", 28, 4),
          ("Qwen3-8B (32/8)", 32, 8), ("Falcon-7B MQA (71/1)", 71, 1), ("Llama-3-8B (32/8)", 32, 8)]
DEGREES = [4, 8, 16, 32]
MEASURED = [(8, 1), (8, 2), (8, 4), (6, 2)]          # (Hq, Hk) run on the gloo ranks


def units(method: str, hq: int, hk: int, C: int, U: int | None = None) -> dict:
    """Per-rank forward (sent, received) in head-chunk units ``B·(S/C)·D·e`` (backward swaps them,
    plus the same gather volume), max over ranks; None where the layout is refused."""
    from hyper_parallel.distributed.context_parallel.methods.ulysses.layout import ulysses_head_layout

    if method == "colossal":
        return {"recv": 2 * hk * (C - 1), "sent": 2 * hk * (C - 1), "layout": "-"}
    U = C if method == "ulysses" else U
    try:
        lay = ulysses_head_layout(hq, hk, U)
    except ValueError:
        return None
    NK = lay.kv_copies
    recv = sent = 0
    for i in range(U):
        nq, nk = lay.q_counts[i], lay.kv_counts[i]
        gather = 2 * (C // U - 1) * nk * U
        sent = max(sent, (hq - nq) + nq * (U - 1) + 2 * (NK - nk) + gather)
        recv = max(recv, nq * (U - 1) + (hq - nq) + 2 * nk * (U - 1) + gather)
    what = "even" if lay.even else ("KV x%.2g" % (NK / hk) if lay.replicated else "uneven")
    return {"recv": recv, "sent": sent, "layout": f"q {min(lay.q_counts)}-{max(lay.q_counts)}, "
                                                   f"kv {max(lay.kv_counts)}/rank ({what})"}


def analytic_rows() -> list:
    rows = []
    for name, hq, hk in MODELS:
        for C in DEGREES:
            cands = [("colossal", None), ("ulysses", None)] + [("hybrid", u) for u in range(2, C) if C % u == 0]
            for method, u in cands:
                r = units(method, hq, hk, C, u)
                if r is not None:
                    rows.append({"model": name, "Hq": hq, "Hk": hk, "C": C, "method": method, "U": u, **r})
    return rows


def bench_rank(cp: int, L: int, reps: int, threads: int) -> dict:
    import torch

    from hyper_parallel import platform as P
    from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta
    from hyper_parallel.distributed.context_parallel.strategies import build_strategy
    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes

    torch.set_num_threads(threads)
    mesh = MeshContext(MeshSizes(cp=cp), hybrid_degrees=(2,))
    group = mesh.cp_mesh.get_group()
    r, S = mesh.cp_rank, cp * L
    meta = CPBatchMeta(cp_rank=r, cp_size=cp, global_seq_len=S, local_seq_len=L, key_doc=None)
    methods = [("colossal", None), ("ulysses", None), ("hybrid", 2)]
    strategies = {m: build_strategy(m, mesh, ulysses_degree=u) for m, u in methods}
    rows = []
    for hq, hk in MEASURED:
        g = torch.Generator().manual_seed(r)
        q0, k0, v0, dout = (torch.randn(B, h, L, D, generator=g) for h in (hq, hk, hk, hq))

        def step(st):
            q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
            st.attention(q, k, v, meta=meta).backward(dout)

        res = {"Hq": hq, "Hk": hk}
        for m, st in strategies.items():
            with P.comm_counter() as recs:
                step(st)                                    # warm-up and the byte count
            res[f"{m}/sent"] = sum(c.bytes_sent for c in recs)
            res[f"{m}/recv"] = sum(c.bytes_received for c in recs)
        times = {f"{m}/{w}": [] for m in strategies for w in ("step_ms", "step_cpu_ms")}
        for _ in range(reps):
            for m, st in strategies.items():               # interleaved: load drift hits every method
                P.barrier(group)
                t0, c0 = time.perf_counter(), time.process_time()
                step(st)
                times[f"{m}/step_ms"].append(1e3 * (time.perf_counter() - t0))
                times[f"{m}/step_cpu_ms"].append(1e3 * (time.process_time() - c0))
        res.update({k: statistics.median(v) for k, v in times.items()})
        rows.append(res)
    return {"rank": r, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--seq-local", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    from benchmarks._machine import cpu_name
    from hyper_parallel.testing import RankPool

    t0 = time.time()
    arows = analytic_rows()
    print("per layer, per rank, fwd received (max over ranks), units of B*(S/C)*D*e; bwd the same")
    print(f"{'model':42} {'C':>3} | {'colossal':>8} | {'ulysses':>8} {'layout':>28} | best hybrid")
    for name, hq, hk in MODELS:
        for C in DEGREES:
            mine = [r for r in arows if r["model"] == name and r["C"] == C]
            col = next(r for r in mine if r["method"] == "colossal")
            uly = next((r for r in mine if r["method"] == "ulysses"), None)
            hyb = min((r for r in mine if r["method"] == "hybrid"), key=lambda r: r["recv"], default=None)
            print(f"{name:42} {C:3} | {col['recv']:8} | {uly['recv'] if uly else 'refused':>8} "
                  f"{uly['layout'] if uly else '':>28} | "
                  + (f"U={hyb['U']}: {hyb['recv']} ({hyb['layout']})" if hyb else "-"))
    pool = RankPool(args.cp)
    try:
        res = pool.run(bench_rank, args.cp, args.seq_local, args.reps, args.threads, timeout=1800)
    finally:
        pool.shutdown()
    mrows = []
    for i, (hq, hk) in enumerate(MEASURED):
        per = [rr["rows"][i] for rr in res]
        row = {"Hq": hq, "Hk": hk}
        for m in ("colossal", "ulysses", "hybrid"):
            row[f"{m}/recv_max_rank"] = max(p[f"{m}/recv"] for p in per)
            row[f"{m}/bytes_total"] = sum(p[f"{m}/sent"] for p in per)
            for w in ("step_ms", "step_cpu_ms"):
                row[f"{m}/{w}"] = max(p[f"{m}/{w}"] for p in per)
        mrows.append(row)
    cpu, load = cpu_name(), os.getloadavg()
    title = (f"C={args.cp} gloo ranks x {args.threads} thread, S_local={args.seq_local}, fp32, B={B} D={D}, causal; "
             f"{cpu}; load {load[0]:.1f}")
    print(title)
    print(f"{'Hq/Hk':>6} | {'KiB recv max rank: col':>22} {'uly':>6} {'hyb2':>6} | {'step ms col':>11} {'uly':>7} "
          f"{'hyb2':>7} | {'cpu ms col':>10} {'uly':>7} {'hyb2':>7}")
    for r in mrows:
        kib = lambda m: r[f"{m}/recv_max_rank"] / 1024  # noqa: E731
        print(f"{r['Hq']:>3}/{r['Hk']:<2} | {kib('colossal'):22.0f} {kib('ulysses'):6.0f} {kib('hybrid'):6.0f} | "
              f"{r['colossal/step_ms']:11.1f} {r['ulysses/step_ms']:7.1f} {r['hybrid/step_ms']:7.1f} | "
              f"{r['colossal/step_cpu_ms']:10.1f} {r['ulysses/step_cpu_ms']:7.1f} {r['hybrid/step_cpu_ms']:7.1f}")
    print(f"({time.time() - t0:.0f} s)")
    if not args.no_save:
        path = os.path.join(ROOT, "benchmarks", "results", "ulysses_heads.json")
        meta = {"cpu": cpu, "cp": args.cp, "threads_per_rank": args.threads, "S_local": args.seq_local, "B": B,
                "D": D, "dtype": "float32", "causal": True, "reps": args.reps, "load_average": list(load),
                "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "analytic_note": "per rank per layer forward, max over ranks, units of B*(S/C)*D*e bytes; "
                                 "backward moves the same amounts",
                "measured_note": "fwd+bwd of one attention layer; recv_max_rank bytes, bytes_total = sum of "
                                 "bytes sent over ranks; step ms median over reps per rank, max over ranks"}
        with open(path, "w") as fh:
            json.dump({"meta": meta, "analytic": arows, "measured": mrows, "per_rank": res}, fh, indent=2)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
