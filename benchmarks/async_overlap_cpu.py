"""How much communication each async CP wrapper hides, on a simulated link (2 gloo ranks on CPU).

On loopback gloo a collective is almost free, so overlap cannot show. The platform's simulated
link (``hyper_parallel/platform/simlink.py``) gives every collective a modelled cost (latency +
bytes / bandwidth) spent where its handle is waited: on the caller for a sync collective, on the
communication thread for an async CP collective. For each method, for the sync wrapper
(``sdpa_hf*``) and the async adapter wrapper of the same model, and for each link, this times
forward+backward of one attention layer and reports::

    exposed comm = step time on the link - step time on a zero-cost link (min over reps)
    blocked      = time the main thread spent blocked in collective waits, link - zero-cost link
                   (median over reps): the part of the modelled communication it did not hide;
                   also with the min over reps (``blocked_min``): on a loaded machine a descheduled
                   peer only adds waits, so the min is the least noisy estimate
    modelled comm = the link time the step's collectives booked (per rank, per step)
    hidden = 1 - blocked / modelled      (async; for sync, blocked ~= modelled: nothing hidden;
                                          ``hidden_min`` from ``blocked_min``)

Both exposed measures are printed; ``blocked`` is the direct one (immune to compute-time noise
on a shared machine), ``exposed`` the step-time definition. Links are interleaved rep by rep.

Per rank, each row also records the *raw* main-thread blocked time on the link (no zero-cost
subtraction; ``{sync,async}_raw_blocked_ms`` median over reps, ``..._min_ms`` min over reps, one
entry per rank) and ``async_raw_hidden_fraction`` = 1 - raw / modelled per rank. The raw time
also counts waits for a slower peer, so it is an upper bound of the unhidden link time; on the
rank with the most attention compute (rank C-1 of causal Colossal: its peers never make it wait,
its zero-cost blocked time is ~0) it is the link alone, without the noise of a subtraction.

The compute a collective can hide behind is the K/V projection / Q branch of the same layer
(see docs/async_cp.md), so "compute >= comm" means that branch, not the whole step.

    python benchmarks/async_overlap_cpu.py [--arch llama] [--seq 2048] [--reps 3]
        [--gbps 0.01,0.05,1,5,25] [--latency-us 20] [--trace benchmarks/results/async_overlap_trace.json]
        [--methods colossal,ulysses,load_balance] [--q-chunks G] [--kv-chunks G]

``--q-chunks`` sets the query-side pipeline depth of async Ulysses / Head-Tail, ``--kv-chunks`` the
K/V pipeline depth of async Colossal (the adapters' Targets get them as their ``q_chunks`` /
``kv_chunks`` parameters; unset: the library defaults ``async_handoff.DEFAULT_Q_CHUNKS`` /
``DEFAULT_KV_CHUNKS``); the JSON records both and the load average at the start and the end of
the run.

``--trace`` also records a torch.profiler trace (Chrome trace JSON, opens in Perfetto /
chrome://tracing) of one async Colossal step on rank 0 on the first link: the collectives on
the ``hp-comm-chain`` thread next to the projections on the main thread. On a GPU machine the
same command with ``HYPER_PARALLEL_DEVICE=cuda --gbps ''`` (no simulated link: the real NCCL link)
places the layer on the GPU and adds the CUDA activity to the trace (docs/async_cp.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CFG = dict(vocab_size=256, hidden_size=1024, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=16,
           num_key_value_heads=4, head_dim=64, max_position_embeddings=65536, use_cache=False, attention_dropout=0.0)
ARCH = {"llama": ("LlamaConfig", "transformers.models.llama.modeling_llama", "LlamaAttention", "LlamaRotaryEmbedding"),
        "qwen3": ("Qwen3Config", "transformers.models.qwen3.modeling_qwen3", "Qwen3Attention", "Qwen3RotaryEmbedding")}
METHODS = {   # method -> (sync wrapper, async suffix, batch policy)
    "colossal": ("sdpa_hf_cp_wrapper", "colossal_cp_wrapper"),
    "ulysses": ("sdpa_hf_ulysses_cp_wrapper", "ulysses_cp_wrapper"),
    "load_balance": ("sdpa_hf_load_balance_cp_wrapper", "load_balance_cp_wrapper"),
}


def bench_rank(arch: str, seq: int, reps: int, threads: int, links: list, latency_us: float, trace_path,
               methods=None, q_chunks=None, kv_chunks=None):
    import importlib

    import torch
    import transformers

    from hyper_parallel import platform as P
    from hyper_parallel.distributed.context_parallel import wrappers
    from hyper_parallel.distributed.context_parallel.batch import shard_batch_for_cp
    from hyper_parallel.distributed.context_parallel.interception import applying
    from hyper_parallel.distributed.context_parallel.meta import cp_batch_context
    from hyper_parallel.distributed.context_parallel.registry import import_target
    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes
    from hyper_parallel.distributed.context_parallel.wrappers import async_handoff
    from hyper_parallel.platform import simlink

    if q_chunks is not None:          # the adapters' Targets take the library default
        async_handoff.DEFAULT_Q_CHUNKS = q_chunks
    if kv_chunks is not None:
        async_handoff.DEFAULT_KV_CHUNKS = kv_chunks
    torch.set_num_threads(threads)
    mesh = MeshContext(MeshSizes(cp=2))
    plat = P.get_platform()                      # HYPER_PARALLEL_DEVICE=cuda|npu: the device run
    dev = plat.device(mesh.cp_rank if plat.device_type != "cpu" else 0)
    cfg_cls, modeling, attn_cls, rope_cls = ARCH[arch]
    cfg = getattr(transformers, cfg_cls)(**CFG)
    cfg._attn_implementation = "sdpa"
    M = importlib.import_module(modeling)
    torch.manual_seed(0)
    base = getattr(M, attn_cls)(cfg, 0).to(dev)
    rope = getattr(M, rope_cls)(cfg).to(dev)
    adapter = importlib.import_module(f"hyper_parallel.models.{arch}.adapter.distributed.context_parallel_async")
    out = {}

    for method, (sync_name, async_suffix) in METHODS.items():
        if methods and method not in methods:
            continue
        local = shard_batch_for_cp({"input_ids": torch.zeros(1, seq, dtype=torch.long)}, mesh.cp_mesh, method)
        meta = local.meta
        L = meta.local_seq_len
        h = torch.randn(1, L, CFG["hidden_size"], generator=torch.Generator().manual_seed(mesh.cp_rank)).to(dev)
        h.requires_grad_(True)
        cos, sin = rope(h, local["position_ids"].to(dev))
        for kind, fn_path in (("sync", f"{wrappers.__name__}.{sync_name}"),
                              ("async", f"{adapter.__name__}.{arch}_async_{async_suffix}")):
            mod = getattr(M, attn_cls)(cfg, 0).to(dev)
            mod.load_state_dict(base.state_dict())
            wrapper = import_target(fn_path)
            with applying("bench.self_attn"):
                wrapper.__hp_inner_wrapper__.validate(mod, cp_size=2)
                fwd = wrapper(mod, mesh, None, mesh.cp_mesh, None)
            if fwd is not None:
                mod.forward = fwd

            def step():
                with cp_batch_context(meta):
                    o, _ = mod(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)
                    o.sum().backward()
                h.grad = None
                for p in mod.parameters():
                    p.grad = None

            # links interleaved rep by rep (a load spike hits every link alike); rep 0 is warm-up.
            # 0 = zero-cost link (gbps=inf, no latency): it still counts the main thread's waits.
            samples = {g: [] for g in [0.0] + links}
            for rep in range(reps + 1):
                for gbps in samples:
                    with simlink.simulated_link(gbps or float("inf"), latency_us if gbps else 0.0) as link:
                        P.barrier(mesh.cp_group)
                        link.modelled_s = link.main_wait_s = 0.0
                        t0 = time.perf_counter()
                        step()
                        dt = time.perf_counter() - t0
                        if rep:
                            samples[gbps].append((dt * 1e3, link.modelled_s * 1e3, link.main_wait_s * 1e3))
            for gbps, rows in samples.items():
                out[f"{method}/{kind}/{gbps:g}"] = {
                    "step_ms": min(r[0] for r in rows), "step_ms_median": statistics.median(r[0] for r in rows),
                    "modelled_comm_ms": statistics.median(r[1] for r in rows),
                    "main_blocked_ms": statistics.median(r[2] for r in rows),
                    "main_blocked_ms_min": min(r[2] for r in rows)}
            if trace_path and kind == "async" and method == "colossal":
                # every rank runs the profiled step (its collectives need the peer); rank 0 writes it
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
                with simlink.simulated_link(links[0] if links else None, latency_us):
                    step()   # warm
                    all_threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
                    with profile(activities=activities, experimental_config=all_threads) as prof:
                        step()
                if mesh.cp_rank == 0:
                    prof.export_chrome_trace(trace_path)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="llama", choices=sorted(ARCH))
    ap.add_argument("--seq", type=int, default=2048, help="global sequence length")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--gbps", default="0.01,0.05,1,5,25", help="simulated link bandwidths, GB/s (comma list)")
    ap.add_argument("--latency-us", type=float, default=20.0, help="simulated latency per collective")
    ap.add_argument("--trace", default=os.path.join(ROOT, "benchmarks", "results", "async_overlap_trace.json"),
                    help="Chrome trace of one async Colossal step (rank 0); '' to skip")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {list(METHODS)}")
    ap.add_argument("--q-chunks", type=int, default=None,
                    help="query-side pipeline depth G of async Ulysses / Head-Tail (default: the library's, "
                         "hyper_parallel...async_handoff.DEFAULT_Q_CHUNKS)")
    ap.add_argument("--kv-chunks", type=int, default=None,
                    help="K/V pipeline depth G of async Colossal (default: the library's, "
                         "hyper_parallel...async_handoff.DEFAULT_KV_CHUNKS; 1 = unpipelined)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "async_overlap_cpu.json"))
    args = ap.parse_args(argv)
    links = [float(x) for x in args.gbps.split(",") if x.strip()]
    methods = [m for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        ap.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    from hyper_parallel.distributed.context_parallel.wrappers.async_handoff import DEFAULT_KV_CHUNKS, DEFAULT_Q_CHUNKS
    q_chunks = args.q_chunks if args.q_chunks is not None else DEFAULT_Q_CHUNKS
    kv_chunks = args.kv_chunks if args.kv_chunks is not None else DEFAULT_KV_CHUNKS
    from benchmarks._machine import cpu_name
    from hyper_parallel.testing import RankPool

    load_start = os.getloadavg()
    pool = RankPool(2)
    try:
        res = pool.run(bench_rank, args.arch, args.seq, args.reps, args.threads, links, args.latency_us,
                       args.trace if args.trace and "colossal" in methods else None, methods, q_chunks,
                       kv_chunks, timeout=3000)
    finally:
        pool.shutdown()
    r0 = res[0]
    rows = []
    print(f"{args.arch} attention layer, hidden {CFG['hidden_size']}, heads {CFG['num_attention_heads']}/"
          f"{CFG['num_key_value_heads']}, S_global {args.seq}, 2 gloo ranks, {args.threads} thread(s)/rank, "
          f"fwd+bwd, {args.reps} interleaved reps (rank 0), latency {args.latency_us:g} us/collective, "
          f"async Ulysses/Head-Tail q_chunks {q_chunks}, async Colossal kv_chunks {kv_chunks}")
    print(f"{'method':13} {'GB/s':>6} {'modelled':>9} | {'sync: step':>10} {'exposed':>8} {'blocked':>8} | "
          f"{'async: step':>11} {'exposed':>8} {'blocked':>8} {'b(min)':>8} {'hidden':>7} {'h(min)':>7}")
    for method in methods:
        zero = {k: r0[f"{method}/{k}/0"] for k in ("sync", "async")}
        for gbps in links:
            s, a = r0[f"{method}/sync/{gbps:g}"], r0[f"{method}/async/{gbps:g}"]
            modelled = a["modelled_comm_ms"]
            row = {"method": method, "gbps": gbps, "modelled_comm_ms": modelled,
                   "sync_modelled_comm_ms": s["modelled_comm_ms"]}
            for k, r in (("sync", s), ("async", a)):
                row[f"{k}_step_ms"] = r["step_ms"]
                row[f"{k}_zero_cost_step_ms"] = zero[k]["step_ms"]
                row[f"{k}_exposed_ms"] = r["step_ms"] - zero[k]["step_ms"]                  # step-time definition
                row[f"{k}_blocked_ms"] = r["main_blocked_ms"] - zero[k]["main_blocked_ms"]  # main thread in waits
                # min over reps: a loaded machine only adds waits (a descheduled peer), never removes them
                row[f"{k}_blocked_min_ms"] = r["main_blocked_ms_min"] - zero[k]["main_blocked_ms_min"]
            for tag in ("", "_min"):
                row[f"async_hidden_fraction{tag}"] = (1.0 - row[f"async_blocked{tag}_ms"] / modelled
                                                      if modelled > 0 else None)
            for k in ("sync", "async"):
                rk = [rr[f"{method}/{k}/{gbps:g}"] for rr in res]
                row[f"{k}_raw_blocked_ms"] = [r["main_blocked_ms"] for r in rk]
                row[f"{k}_raw_blocked_min_ms"] = [r["main_blocked_ms_min"] for r in rk]
                row[f"{k}_zero_cost_raw_blocked_min_ms"] = [rr[f"{method}/{k}/0"]["main_blocked_ms_min"] for rr in res]
            row["async_raw_hidden_fraction"] = [1.0 - b / r[f"{method}/async/{gbps:g}"]["modelled_comm_ms"]
                                                if r[f"{method}/async/{gbps:g}"]["modelled_comm_ms"] > 0 else None
                                                for b, r in zip(row["async_raw_blocked_ms"], res)]
            rows.append(row)
            hid = " ".join(f"{100 * row[f'async_hidden_fraction{t}']:6.1f}%" if row[f"async_hidden_fraction{t}"]
                           is not None else "     -" for t in ("", "_min"))
            print(f"{method:13} {gbps:6g} {modelled:9.1f} | {s['step_ms']:10.1f} {row['sync_exposed_ms']:8.1f} "
                  f"{row['sync_blocked_ms']:8.1f} | {a['step_ms']:11.1f} {row['async_exposed_ms']:8.1f} "
                  f"{row['async_blocked_ms']:8.1f} {row['async_blocked_min_ms']:8.1f} {hid}")
            print(f"{'':13} {'':6} raw blocked per rank (no subtraction), median over reps: sync "
                  + " / ".join(f"{b:.1f}" for b in row["sync_raw_blocked_ms"]) + " ms, async "
                  + " / ".join(f"{b:.1f}" for b in row["async_raw_blocked_ms"]) + " ms, async hidden "
                  + " / ".join(f"{100 * h:.0f}%" if h is not None else "-" for h in row["async_raw_hidden_fraction"]))
        print(f"{method:13} zero-cost link: sync step {zero['sync']['step_ms']:.1f} ms, async step "
              f"{zero['async']['step_ms']:.1f} ms")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"cpu": cpu_name(), "cores": os.cpu_count(), "arch": args.arch, "config": CFG, "seq": args.seq, "reps": args.reps,
                   "threads": args.threads, "latency_us": args.latency_us, "links_gbps": links,
                   "methods": methods, "q_chunks": q_chunks, "kv_chunks": kv_chunks,
                   "load_average_start": load_start, "load_average_end": os.getloadavg(),
                   "per_rank": res, "rows": rows}, fh, indent=2)
    print(f"wrote {args.out}" + (f" and {args.trace}" if args.trace else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
