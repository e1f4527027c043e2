"""Sync vs async CP on one Qwen3-MoE attention layer (2 gloo ranks on CPU).

For each method (Colossal, Ulysses) it times forward and forward+backward of the attention
layer with the sync wrapper (SDPA interception -> strategy) and with the async Qwen3-MoE
adapter (launch at the handoff, wait at the consumer), plus the bare collectives the layer
issues. Prints a table and writes JSON. Overlap shows as async time < sync time; the
upper bound of the gain is the communication time.

    python benchmarks/async_overlap_cpu.py [--seq 4096] [--reps 5] [--out benchmarks/results/async_overlap_cpu.json]
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

CFG = dict(vocab_size=256, hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256,
           num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
           num_experts=4, num_experts_per_tok=2, max_position_embeddings=65536, use_cache=False)
ASYNC = "hyper_parallel.models.qwen3_moe.adapter.distributed.context_parallel_async"


def bench_rank(seq: int, reps: int, threads: int):
    import torch
    import transformers

    from hyper_parallel.distributed.context_parallel import wrappers
    from hyper_parallel.distributed.context_parallel.meta import CPBatchMeta, cp_batch_context
    from hyper_parallel.distributed.context_parallel.registry import import_target
    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes
    from hyper_parallel import platform as P

    torch.set_num_threads(threads)
    mesh = MeshContext(MeshSizes(cp=2))
    cfg = transformers.AutoConfig.for_model("qwen3_moe", **CFG)
    cfg._attn_implementation = "sdpa"
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention, Qwen3MoeRotaryEmbedding

    torch.manual_seed(0)
    base = Qwen3MoeAttention(cfg, 0)
    rope = Qwen3MoeRotaryEmbedding(cfg)
    L = seq // 2
    r = mesh.cp_rank
    meta = CPBatchMeta(cp_rank=r, cp_size=2, global_seq_len=seq, local_seq_len=L, key_doc=None)
    h = torch.randn(1, L, CFG["hidden_size"], requires_grad=True)
    pos = torch.arange(r * L, (r + 1) * L).unsqueeze(0)
    cos, sin = rope(h, pos)
    out = {}

    def timed(fn):
        ts = []
        for i in range(reps + 1):
            P.barrier(mesh.cp_group)
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[1:]) * 1e3  # first rep is warm-up

    for method, sync_name, async_name in (("colossal", "sdpa_hf_cp_wrapper", "qwen3_moe_async_colossal_cp_wrapper"),
                                          ("ulysses", "sdpa_hf_ulysses_cp_wrapper", "qwen3_moe_async_ulysses_cp_wrapper")):
        for kind, fn_path in (("sync", f"{wrappers.__name__}.{sync_name}"), ("async", f"{ASYNC}.{async_name}")):
            mod = Qwen3MoeAttention(cfg, 0)
            mod.load_state_dict(base.state_dict())
            wrapper = import_target(fn_path)
            fwd = wrapper(mod, mesh, None, mesh.cp_mesh, None)
            if fwd is not None:
                mod.forward = fwd

            def f():
                with cp_batch_context(meta), torch.no_grad():
                    mod(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)

            def fb():
                with cp_batch_context(meta):
                    o, _ = mod(hidden_states=h, position_embeddings=(cos, sin), attention_mask=None)
                    o.sum().backward()

            out[f"{method}/{kind}/fwd_ms"] = timed(f)
            out[f"{method}/{kind}/fwd_bwd_ms"] = timed(fb)
        # the layer's bare collectives (forward): K and V gathers, or Q/K/V + out A2As
        kv = torch.randn(1, CFG["num_key_value_heads"], L, CFG["head_dim"])
        q = torch.randn(1, CFG["num_attention_heads"], L, CFG["head_dim"])
        if method == "colossal":
            comm = lambda: [P.all_gather(kv, mesh.cp_group, dim=2) for _ in range(2)]
        else:
            comm = lambda: [P.all_to_all(x, mesh.cp_group, 1, 2) for x in (q, kv, kv, q)]
        out[f"{method}/comm_fwd_ms"] = timed(comm)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=4096, help="global sequence length")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "async_overlap_cpu.json"))
    args = ap.parse_args(argv)
    from hyper_parallel.testing import RankPool

    pool = RankPool(2)
    try:
        res = pool.run(bench_rank, args.seq, args.reps, args.threads, timeout=1800)
    finally:
        pool.shutdown()
    r0 = res[0]
    rows = []
    print(f"Qwen3-MoE attention, hidden {CFG['hidden_size']}, heads {CFG['num_attention_heads']}/"
          f"{CFG['num_key_value_heads']}, S_global {args.seq}, 2 gloo ranks, {args.threads} thread(s)/rank, "
          f"median of {args.reps} (rank 0)")
    print(f"{'method':10} {'sync fwd':>9} {'async fwd':>10} {'sync f+b':>9} {'async f+b':>10} "
          f"{'f+b async/sync':>15} {'comm fwd':>9}")
    for m in ("colossal", "ulysses"):
        row = {k.split("/", 1)[1]: v for k, v in r0.items() if k.startswith(m + "/")}
        row["method"] = m
        row["fwd_bwd_ratio_async_over_sync"] = row["async/fwd_bwd_ms"] / row["sync/fwd_bwd_ms"]
        row["fwd_ratio_async_over_sync"] = row["async/fwd_ms"] / row["sync/fwd_ms"]
        rows.append(row)
        print(f"{m:10} {row['sync/fwd_ms']:9.1f} {row['async/fwd_ms']:10.1f} {row['sync/fwd_bwd_ms']:9.1f} "
              f"{row['async/fwd_bwd_ms']:10.1f} {row['fwd_bwd_ratio_async_over_sync']:15.3f} {row['comm_fwd_ms']:9.1f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"config": CFG, "seq": args.seq, "reps": args.reps, "threads": args.threads,
                   "per_rank": res, "rows": rows}, fh, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
