"""Cost of the CP preflight proof at apply time (``apply_sharding_plan``'s default), CP=2 on gloo.

The main job's Llama (``examples/train_long_cp2.yaml``: ``examples/models/tiny_llama.yaml`` with
the shipped tokenizer's 4096-token vocabulary), Colossal attention (``sdpa_hf``), fp32: times
``apply_sharding_plan`` with the default proof and with ``preflight_proof=False`` on fresh models,
best of ``--repeat``, and prints the proof's own time (``ProofReport.time_s``)::

    python benchmarks/proof_cost.py [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _case(repeat: int) -> dict:
    import torch
    import transformers as T

    from hyper_parallel.distributed.context_parallel.model_proof import prove_cp_model
    from hyper_parallel.distributed.mesh import MeshContext, MeshSizes
    from hyper_parallel.distributed.plan.applier import apply_sharding_plan
    from hyper_parallel.distributed.plan.planner import ShardingPlanner

    torch.set_num_threads(1)
    mesh = MeshContext(MeshSizes(cp=2))
    entries = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
                "inner_wrapper": "sdpa_hf"}]
    cfg = T.LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                        rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa")
    out = {"with_proof": [], "opt_out": [], "proof": []}
    for _ in range(repeat):
        for key, proof in (("with_proof", True), ("opt_out", False)):
            torch.manual_seed(0)
            model = T.LlamaForCausalLM(cfg).train()
            plan = ShardingPlanner(plan_overrides=entries).plan(model, mesh, cp_size=2)
            t0 = time.perf_counter()
            model, _ = apply_sharding_plan(model, plan, mesh, fsdp=False, preflight_proof=proof)
            out[key].append(time.perf_counter() - t0)
        report = prove_cp_model(model, plan, mesh)
        out["proof"].append(report.time_s)
        out["S"], out["rows"], out["err"] = report.seq_len, report.rows, report.max_rel_error
    return out


def main() -> None:
    from hyper_parallel.testing import RankPool

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "proof_cost.json"), help="where the measured numbers go")
    args = ap.parse_args()
    pool = RankPool(2, env={"HYPER_PARALLEL_COMM_TIMEOUT": "3600"})
    try:
        res = pool.run(_case, args.repeat, timeout=600)
    finally:
        pool.shutdown()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    best = {k: max(min(r[k]) for r in res) for k in ("with_proof", "opt_out", "proof")}
    print(f"CPU: {cpu}, {os.cpu_count()} cores; CP=2 gloo, Llama 2 layers x 128 (vocab 4096), probe {res[0]['rows']} x "
          f"{res[0]['S']} tokens, max rel err {res[0]['err']:.1e}")
    print(f"apply_sharding_plan: {best['with_proof']:.3f}s with the proof (default), {best['opt_out']:.3f}s with "
          f"preflight_proof=False; the proof itself {best['proof']:.3f}s (best of {args.repeat}, max over ranks)")
    with open(args.json, "w") as fh:
        json.dump({"cpu": cpu, "cores": os.cpu_count(), "load_average": os.getloadavg(), "repeat": args.repeat,
                   "probe_rows": res[0]["rows"], "probe_tokens": res[0]["S"], "max_rel_err": res[0]["err"],
                   "seconds": best, "per_rank": res}, fh, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
