"""Gated DeltaNet under CP on 2 gloo ranks (CPU): Ulysses vs state passing (issue 21 item 5).

One ``Qwen3NextGatedDeltaNet`` layer (transformers' own module and torch paths; hidden 256, 4 key /
8 value linear heads of dim 64, conv kernel 4), one sequence of S tokens split over 2 ranks, fp32.
Methods:

* ``ulysses``       — ``gated_deltanet_ulysses``: seq->head all-to-alls, each rank runs half the
                      heads over the whole sequence;
* ``state_passing`` — ``gated_deltanet_state_passing``: each rank runs all heads on its own tokens
                      (plus the identity run that makes its output affine in the incoming state),
                      one AllGather of the final states, a conv halo;
* ``sequential``    — (forward only, reference) the naive state passing this design avoids: rank 1
                      waits for rank 0's final recurrent state before it starts its own recurrence.

Per rank it reports forward+backward step time (median of ``--reps`` after a warm-up), the bytes the
platform layer moved (``platform.comm_counter``), and the time spent inside collectives (transfer +
waiting for the other rank: the idle time of a rank whose peer is not ready). Table + JSON + PNG.

    python benchmarks/linear_mixer_cp.py [--seqs 8192 16384 32768] [--reps 3] [--threads 1]

``--scaling``: instead, every state-passing method (GDN, KDA, MiniMax lightning, Mamba2) at cp 1, 2
and 4 — FLOPs and step time per rank (:mod:`linear_mixer_scaling`), stored under
``"per_rank_scaling"`` in the same JSON (the Ulysses-vs-state-passing rows are kept):

    python benchmarks/linear_mixer_cp.py --scaling [--scaling-seq 1024] [--cps 1 2 4] [--reps 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_name  # noqa: E402
sys.path.insert(0, ROOT)

CFG = dict(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
           linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
           layer_types=["linear_attention"], num_experts=2, num_experts_per_tok=1, moe_intermediate_size=64,
           shared_expert_intermediate_size=64, use_cache=False)
GDN = "hyper_parallel.models.qwen3_next.gated_deltanet"
COMM_OPS = ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven")


def _timed_comm(P, acc: list):
    """Wrap the platform collectives so the wall time inside them accumulates in ``acc[0]``."""
    originals = {name: getattr(P, name) for name in COMM_OPS}

    def wrap(fn):
        def inner(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[0] += time.perf_counter() - t0
        return inner

    for name, fn in originals.items():
        setattr(P, name, wrap(fn))
    return originals


def bench_rank(seqs: list, reps: int, threads: int) -> dict:
    import torch
    import transformers
    from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextGatedDeltaNet,
                                                                    torch_chunk_gated_delta_rule)

    from hyper_parallel import platform as P
    from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta, cp_batch_context
    from hyper_parallel.distributed.context_parallel.registry import import_target
    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes

    torch.set_num_threads(threads)
    mesh = MeshContext(MeshSizes(cp=2))
    r = mesh.cp_rank
    cfg = transformers.Qwen3NextConfig(**CFG)
    torch.manual_seed(0)
    base = Qwen3NextGatedDeltaNet(cfg, 0)
    acc = [0.0]
    originals = _timed_comm(P, acc)
    out: dict = {"rank": r, "rows": []}
    try:
        for S in seqs:
            L = S // 2
            meta = CPBatchMeta(cp_rank=r, cp_size=2, global_seq_len=S, local_seq_len=L, key_doc=None)
            torch.manual_seed(1 + r)
            h = torch.randn(1, L, CFG["hidden_size"], requires_grad=True)
            for method in ("ulysses", "state_passing"):
                mod = Qwen3NextGatedDeltaNet(cfg, 0)
                mod.load_state_dict(base.state_dict())
                mod.forward = import_target(f"{GDN}.gated_deltanet_{method}_cp_wrapper")(mod, mesh, None,
                                                                                            mesh.cp_mesh, None)
                times, comm, moved = [], [], 0
                for i in range(reps + 1):
                    P.barrier(mesh.cp_group)
                    acc[0] = 0.0
                    with P.comm_counter() as recs, cp_batch_context(meta):
                        t0 = time.perf_counter()
                        mod(h).sum().backward()
                        dt = time.perf_counter() - t0
                    if i:                                  # the first repetition warms up
                        times.append(dt)
                        comm.append(acc[0])
                        moved = sum(x.bytes_sent for x in recs)
                out["rows"].append({"seq": S, "method": method, "fwd_bwd_ms": statistics.median(times) * 1e3,
                                    "in_collectives_ms": statistics.median(comm) * 1e3, "bytes_sent": moved})
            # naive sequential state passing (forward only): rank 1 waits for rank 0's final state
            Hv, dk, dv = mod.num_v_heads, mod.head_k_dim, mod.head_v_dim
            q = torch.randn(1, L, mod.num_k_heads, dk)
            k = torch.randn(1, L, mod.num_k_heads, dk)
            v = torch.randn(1, L, Hv, dv)
            g = -torch.rand(1, L, Hv)
            beta = torch.rand(1, L, Hv)
            times, comm = [], []
            for i in range(reps + 1):
                P.barrier(mesh.cp_group)
                acc[0] = 0.0
                with torch.no_grad():
                    t0 = time.perf_counter()
                    if r == 0:
                        _o, state = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                                                 use_qk_l2norm_in_kernel=True)
                        P.all_gather(state.contiguous(), mesh.cp_group, dim=0)
                    else:
                        state = P.all_gather(torch.zeros(1, Hv, dk, dv), mesh.cp_group, dim=0)[:1]
                        torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                                     use_qk_l2norm_in_kernel=True)
                    dt = time.perf_counter() - t0
                if i:
                    times.append(dt)
                    comm.append(acc[0])
            out["rows"].append({"seq": S, "method": "sequential_fwd_only", "fwd_ms": statistics.median(times) * 1e3,
                                "in_collectives_ms": statistics.median(comm) * 1e3})
    finally:
        for name, fn in originals.items():
            setattr(P, name, fn)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "linear_mixer_cp.json"))
    ap.add_argument("--scaling", action="store_true", help="per-rank FLOPs / time of every state-passing method")
    ap.add_argument("--scaling-seq", type=int, default=1024)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--methods", nargs="+", default=None, help="--scaling: only these (rows of others kept)")
    args = ap.parse_args(argv)
    previous = {}
    if os.path.exists(args.out):
        with open(args.out) as fh:
            previous = json.load(fh)
    if args.scaling:
        return scaling_main(args, previous)
    from hyper_parallel.testing import RankPool

    # ranks wait for each other inside collectives for as long as the slower one computes
    pool = RankPool(2, env={"HYPER_PARALLEL_COMM_TIMEOUT": "3600"})
    try:
        res = pool.run(bench_rank, args.seqs, args.reps, args.threads, timeout=3600)
    finally:
        pool.shutdown()
    print(f"Gated DeltaNet layer (hidden {CFG['hidden_size']}, {CFG['linear_num_key_heads']}/"
          f"{CFG['linear_num_value_heads']} linear heads x 64), 2 gloo ranks, {args.threads} thread(s)/rank, "
          f"fp32, median of {args.reps}; CPU: {cpu_name()}")
    print(f"{'S':>6} {'method':<20} {'step ms r0':>11} {'step ms r1':>11} {'in coll. r0':>12} {'in coll. r1':>12} "
          f"{'MB sent/rank':>13}")
    table = []
    for row0, row1 in zip(res[0]["rows"], res[1]["rows"]):
        key = "fwd_bwd_ms" if "fwd_bwd_ms" in row0 else "fwd_ms"
        item = {"seq": row0["seq"], "method": row0["method"], "timed": key,
                "step_ms": [row0[key], row1[key]], "in_collectives_ms": [row0["in_collectives_ms"],
                                                                         row1["in_collectives_ms"]],
                "bytes_sent": [row0.get("bytes_sent"), row1.get("bytes_sent")]}
        table.append(item)
        mb = "" if row0.get("bytes_sent") is None else f"{row0['bytes_sent'] / 2**20:13.2f}"
        print(f"{item['seq']:>6} {item['method']:<20} {row0[key]:11.1f} {row1[key]:11.1f} "
              f"{row0['in_collectives_ms']:12.1f} {row1['in_collectives_ms']:12.1f} {mb}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"config": CFG, "cpu": cpu_name(), "threads": args.threads, "reps": args.reps, "rows": table,
                   **({"per_rank_scaling": previous["per_rank_scaling"]} if "per_rank_scaling" in previous else {})},
                  fh, indent=2)
    print(f"wrote {args.out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for method in ("ulysses", "state_passing"):
            rows = [t for t in table if t["method"] == method]
            ax.plot([t["seq"] for t in rows], [max(t["step_ms"]) for t in rows], marker="o",
                    label=f"{method} (fwd+bwd, slowest rank)")
            ax.plot([t["seq"] for t in rows], [max(t["in_collectives_ms"]) for t in rows], ls="--", marker="x",
                    label=f"{method}: in collectives")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global tokens (2 ranks)")
        ax.set_ylabel("ms")
        ax.set_title("Gated DeltaNet CP on CPU")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out.replace(".json", ".png"), dpi=120)
        print(f"wrote {args.out.replace('.json', '.png')}")
    except ImportError:
        pass
    return 0


def scaling_main(args, previous: dict) -> int:
    from linear_mixer_scaling import FAMILIES, HIDDEN, run_scaling, with_ratios

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    methods = args.methods or list(FAMILIES)
    new = run_scaling(methods, args.scaling_seq, args.cps, args.reps, args.threads)
    for row in new:
        row["load_avg_1min"] = load
    kept = [row for row in previous.get("per_rank_scaling", {}).get("rows", [])
            if (row["method"], row["cp"]) not in {(n["method"], n["cp"]) for n in new}
            and row["S"] == args.scaling_seq]
    rows = with_ratios(sorted(kept + new, key=lambda x: (x["cp"], list(FAMILIES).index(x["method"]))))
    print(f"state-passing mixers, one layer (hidden {HIDDEN}, 4 heads x 64), S={args.scaling_seq} global tokens, "
          f"fp32 fwd+bwd, {args.threads} thread(s)/rank; CPU: {cpu_name()}, load avg {load}")
    print(f"{'method':<30} {'cp':>3} {'GFLOP per rank':<28} {'max/cp1':>8} {'min/cp1':>8}  ms per rank")
    for row in rows:
        gf = ", ".join(f"{f / 1e9:.2f}" for f in row["flops_per_rank"])
        print(f"{row['method']:<30} {row['cp']:>3} {gf:<28} {row.get('max_flops_vs_cp1', 0):8.3f} "
              f"{row.get('min_flops_vs_cp1', 0):8.3f}  {row['fwd_bwd_ms_per_rank']}")
    previous["per_rank_scaling"] = {"S": args.scaling_seq, "hidden": HIDDEN, "cpu": cpu_name(), "load_avg_1min": load,
                                    "threads": args.threads, "reps": args.reps,
                                    "flops": "torch.utils.flop_counter.FlopCounterMode total (matmul/conv/SDPA)",
                                    "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(previous, fh, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
