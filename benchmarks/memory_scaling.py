"""Peak memory per rank against sequence length, one line per CP size (issue 14 item 4).

Runs the real trainer (``torchrun -m hyper_parallel.trainer.cli``) for a few steps per point and
reads each rank's peak memory from its JSON log (``peak_mem_gb_per_rank``: resident set on CPU, the
allocator's peak on CUDA/NPU). Models: the issue's Llama (vocab 32000, hidden 256, intermediate 688,
2 layers, 8/2 heads) and a wider one (hidden 1024, intermediate 2816, 16/4 heads). fp32, micro-batch 1.
Colossal CP (``sdpa_hf``) for CP > 1.

    python benchmarks/memory_scaling.py                       # CP 1/2/4, 4k..32k, both models
    python benchmarks/memory_scaling.py --cps 2 --seqs 131072 --steps 1 --ac   # one long run
    python benchmarks/memory_scaling.py --search --budget-gb 24   # longest sequence within the budget
    python benchmarks/memory_scaling.py --host-malloc fixed glibc --seqs 32768   # the allocator policy's cost

``--tiled-mlp 0 2048``: each point without and with ``schedule.tiled_mlp`` (chunk 2048 tokens).
``--host-malloc``: ``fixed`` is the trainer's default on CPU (glibc's mmap threshold fixed at 128 KiB,
hyper_parallel/platform/host_memory.py), ``glibc`` runs with glibc's dynamic threshold
(``HYPER_PARALLEL_MMAP_THRESHOLD=0``); both at each point, interleaved, to compare peak and step time.

Writes ``benchmarks/results/memory_scaling.json`` (+ ``.png``): per point the peak per rank, the
per-token memory and the CP=C / CP=1 ratio per rank at the same sequence — of the resident set and,
where the trainer recorded it (CPU: ``peak_tensor_gb_per_rank``, the counting allocator of
``platform/host_memory.py``), of the tensor storage, the figure a device allocator's peak gives.
**FLOPs and the machine's limit** (``benchmarks/step_flops.py``): at start the ``torch.mm`` rate of
fp32 and bf16 (1024³, best of ~1 s) is measured with the intra-op thread count each rank gets
(``cpu_count // cp``); per point the step's model and hardware FLOPs are counted (the formula is in
``step_flops.py``: ``6·N·tokens``-style matmuls plus the causal attention core, plus what activation
checkpointing / the tiled loss / the tiled MLP recompute) and printed with the rate the last step
reached and its fraction of ``cp`` x the per-rank fp32 (and bf16) ``torch.mm`` rate. The trainer runs
fp32 here, so the fp32 fraction is the one that bounds it. ``--gemm-seconds 0`` skips the measurement.
``--activation-offload``: ``schedule.activation_offload`` (with ``--ac``).

``--merge a.json b.json --out c.json`` combines earlier runs (e.g. a longer sequence run later) without
running anything.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_name  # noqa: E402
from step_flops import gemm_rate, llama_step_flops  # noqa: E402
MODELS = {
    "llama_h256": dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    "llama_h1024": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                        num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False),
}


def _corpus(path: str, n_bytes: int) -> str:
    """The example corpus repeated to ``n_bytes`` (memory does not depend on the text; the byte-level
    reader needs one row of ``seq_len`` bytes per micro-batch)."""
    with open(os.path.join(ROOT, "examples", "data", "corpus.txt"), "rb") as fh:
        text = fh.read()
    with open(path, "wb") as fh:
        fh.write((text * (n_bytes // len(text) + 1))[:n_bytes])
    return path


def _config(model: str, cp: int, seq: int, steps: int, ac: bool, tiled: bool, out_dir: str,
            method: str = "sdpa_hf", tiled_mlp: int = 0, offload: bool = False) -> dict:
    corpus = _corpus(os.path.join(os.path.dirname(out_dir), "corpus.txt"), seq * (steps + 2))
    cfg = {
        "model": {"architecture": "llama", "config": dict(MODELS[model], max_position_embeddings=max(seq, 4096)),
                  "seed": 0},
        "data": {"path": corpus, "seq_len": seq,
                 "micro_batch_size": 1, "seed": 0},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "schedule": {"steps": steps, "warmup_steps": 0, "activation_checkpointing": ac,
                     "activation_offload": offload,
                     "tiled_mlp": bool(tiled_mlp), "tiled_mlp_chunk_size": tiled_mlp or 2048},
        "accelerator": {"cp_size": cp},
        "plan_overrides": [],
        "logging": {"out_dir": out_dir, "log_every": 1, "progress": False, "plot": False},
        "loss": {"tiled": tiled},
    }
    if cp > 1:
        cfg["plan_overrides"] = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False,
                                  "inner_target": "self",
                                  "inner_wrapper": {"_target_": method} if "." in method else method}]
    return cfg


def run_point(model: str, cp: int, seq: int, *, steps: int, ac: bool, tiled: bool, timeout: float,
              method: str = "sdpa_hf", host_malloc: str = "fixed", tiled_mlp: int = 0, offload: bool = False,
              gemm: dict | None = None) -> dict:
    """One trainer run; returns peak memory per rank (GB) or the failure."""
    with tempfile.TemporaryDirectory(prefix="hp_mem_") as tmp:
        path = os.path.join(tmp, "cfg.yaml")
        with open(path, "w") as fh:
            yaml.safe_dump(_config(model, cp, seq, steps, ac, tiled, os.path.join(tmp, "run"), method, tiled_mlp,
                                   offload), fh)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
               "-m", "hyper_parallel.trainer.cli", path]
        env = dict(os.environ, OMP_NUM_THREADS=str(rank_threads(cp)))
        if host_malloc == "glibc":
            env["HYPER_PARALLEL_MMAP_THRESHOLD"] = "0"
        t0, ru0 = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"model": model, "cp": cp, "seq": seq, "ok": False, "error": f"timeout {timeout}s"}
        wall, ru1 = time.time() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = {"cpu_user_s": ru1.ru_utime - ru0.ru_utime, "cpu_sys_s": ru1.ru_stime - ru0.ru_stime}
        log_path = os.path.join(tmp, "run", "train_log.json")
        if proc.returncode != 0 or not os.path.exists(log_path):
            tail = (proc.stderr or proc.stdout)[-1500:]
            return {"model": model, "cp": cp, "seq": seq, "ok": False, "error": tail, "wall_s": wall}
        with open(log_path) as fh:
            steps_log = json.load(fh)["steps"]
    peaks = [max(vals) for vals in zip(*[r["peak_mem_gb_per_rank"] for r in steps_log])]
    tensor = [r.get("peak_tensor_gb_per_rank") for r in steps_log]
    tensor_peaks = None if None in tensor else [max(vals) for vals in zip(*tensor)]
    return {"model": model, "cp": cp, "seq": seq, "method": method if cp > 1 else None, "ac": ac, "ok": True,
            "host_malloc": host_malloc, "tiled_mlp": tiled_mlp,
            "step_time_s": [r["time_s"] for r in steps_log], "peak_gb_per_rank": peaks,
            "peak_gb_max_rank": max(peaks), "mb_per_token_max_rank": max(peaks) * 1024 / seq,
            "total_gb_all_ranks": sum(peaks), "wall_s": wall, "loss": steps_log[-1]["loss"],
            **({} if tensor_peaks is None else {"tensor_peak_gb_per_rank": tensor_peaks,
                                                "tensor_peak_gb_max_rank": max(tensor_peaks)}), **cpu,
            "activation_offload": offload,
            **step_rate(model, cp, seq, steps_log[-1]["time_s"], ac=ac, tiled=tiled, tiled_mlp=tiled_mlp, gemm=gemm)}


def rank_threads(cp: int) -> int:
    """Intra-op threads of each of ``cp`` ranks on this machine (its OMP_NUM_THREADS)."""
    return max(1, (os.cpu_count() or 2) // cp)


def measure_gemm(cps, seconds: float) -> dict:
    """``{threads: {"fp32": FLOP/s, "bf16": FLOP/s}}`` of ``torch.mm`` (1024³) for each rank thread
    count of ``cps`` (:func:`step_flops.gemm_rate`); ``{}`` when ``seconds`` is 0."""
    if seconds <= 0:
        return {}
    import torch

    out = {}
    for threads in sorted({rank_threads(cp) for cp in cps}):
        out[threads] = {name: gemm_rate(dtype, threads=threads, seconds=seconds)
                        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        print(f"torch.mm 1024^3 with {threads} thread(s): fp32 {out[threads]['fp32'] / 1e9:.1f} GFLOP/s, "
              f"bf16 {out[threads]['bf16'] / 1e9:.1f} GFLOP/s", flush=True)
    return out


def step_rate(model: str, cp: int, seq: int, step_s: float, *, ac: bool, tiled: bool, tiled_mlp: int,
              gemm: dict | None) -> dict:
    """The step's FLOPs (model and hardware, :func:`step_flops.llama_step_flops`, micro-batch 1), the
    rate the step of ``step_s`` seconds reached over all ``cp`` ranks, and its fraction of ``cp`` x
    the per-rank ``torch.mm`` rate of ``gemm`` (fp32 and bf16)."""
    f = llama_step_flops(MODELS[model], 1, seq, recompute_layers=ac, recompute_head=tiled,
                         recompute_mlp=bool(tiled_mlp))
    out = {"step_flops_model": f.model, "step_flops_hardware": f.hardware,
           # the attention core's part: forward + backward (2.5x) + the recompute under AC
           "step_flops_attention_share": (3.5 + ac) * f.attention_fwd / f.hardware,
           "achieved_gflops_hardware": f.hardware / step_s / 1e9, "achieved_gflops_model": f.model / step_s / 1e9}
    rates = (gemm or {}).get(rank_threads(cp))
    if rates:
        out["rank_threads"] = rank_threads(cp)
        out["mm_gflops_per_rank"] = {k: v / 1e9 for k, v in rates.items()}
        for name, rate in rates.items():
            out[f"fraction_of_mm_{name}"] = f.hardware / step_s / (cp * rate)
    return out


def linear_fit(points: list[dict], budget_gb: float, field: str = "peak_gb_max_rank") -> list[dict]:
    """Per (model, cp, policy, tiled MLP): peak per rank = fixed + per_token x seq, fitted through
    the two longest measured points, and the longest sequence whose ``cp`` ranks together stay within
    ``budget_gb`` by that line — an *estimate* (extrapolated), reported as such beside ``--search``,
    which measures (and on CPU takes hours per point beyond ~128k tokens: attention is O(S^2))."""
    groups: dict = {}
    for p in points:
        if p["ok"] and field in p:
            groups.setdefault((p["model"], p["cp"], p.get("host_malloc"), p.get("tiled_mlp")), []).append(p)
    out = []
    for (model, cp, policy, tmlp), pts in sorted(groups.items(), key=lambda kv: str(kv[0])):
        pts = sorted(pts, key=lambda q: q["seq"])[-2:]
        if len(pts) < 2:
            continue
        (s0, m0), (s1, m1) = [(q["seq"], q[field]) for q in pts]
        per_token = (m1 - m0) / (s1 - s0)
        fixed = m0 - per_token * s0
        longest = int((budget_gb / cp - fixed) / per_token) if per_token > 0 else None
        out.append({"model": model, "cp": cp, "host_malloc": policy, "tiled_mlp": tmlp, "field": field, "fit_seqs": [s0, s1],
                    "fixed_gb_per_rank": fixed, "kb_per_global_token_per_rank": per_token * 1024 ** 2,
                    "budget_gb": budget_gb, "estimated_longest_seq": longest})
    return out


def summarize(result: dict, budget_gb: float) -> None:
    """Per point the CP=C / CP=1 ratio per rank at the same sequence (resident set and, where
    recorded, tensor storage); per group the fitted lines; prints the table."""
    def key(p):
        return p["model"], p["seq"], p.get("host_malloc"), p.get("tiled_mlp")

    base = {key(p): p for p in result["points"] if p["ok"] and p["cp"] == 1}
    for p in result["points"]:
        ref = base.get(key(p))
        if p["ok"] and ref:
            p["ratio_per_rank_vs_cp1"] = p["peak_gb_max_rank"] / ref["peak_gb_max_rank"]
            if "tensor_peak_gb_max_rank" in p and "tensor_peak_gb_max_rank" in ref:
                p["tensor_ratio_per_rank_vs_cp1"] = p["tensor_peak_gb_max_rank"] / ref["tensor_peak_gb_max_rank"]
    result["fit"] = linear_fit(result["points"], budget_gb)
    result["fit_tensor"] = linear_fit(result["points"], budget_gb, field="tensor_peak_gb_max_rank")
    for label, fits in (("resident", result["fit"]), ("tensor", result["fit_tensor"])):
        for f in fits:
            print(f"fit ({label}) {f['model']} cp={f['cp']} tiled_mlp={f['tiled_mlp']}: {f['fixed_gb_per_rank']:.2f} GB + "
                  f"{f['kb_per_global_token_per_rank']:.1f} KB per global token per rank (through {f['fit_seqs']}); "
                  f"estimated longest within {f['budget_gb']} GB (all ranks): {f['estimated_longest_seq']} tokens")
    print(f"\n{'model':12} {'seq':>6} {'cp':>3} {'malloc':>6} {'t.mlp':>5} {'peak GB/rank':>13} {'MB/token':>9} "
          f"{'vs CP=1':>8} {'tensor GB':>10} {'vs CP=1':>8} {'last step s':>11}")
    for p in result["points"]:
        if p["ok"]:
            ratio, tr = p.get("ratio_per_rank_vs_cp1"), p.get("tensor_ratio_per_rank_vs_cp1")
            tensor = p.get("tensor_peak_gb_max_rank")
            print(f"{p['model']:12} {p['seq']:>6} {p['cp']:>3} {p['host_malloc']:>6} {p['tiled_mlp']:>5} "
                  f"{p['peak_gb_max_rank']:13.2f} "
                  f"{p['mb_per_token_max_rank']:9.3f} {'' if ratio is None else f'{ratio:8.2f}'} "
                  f"{'' if tensor is None else f'{tensor:10.2f}'} {'' if tr is None else f'{tr:8.2f}'} "
                  f"{p['step_time_s'][-1]:11.1f}")


def plot(result: dict, path: str) -> None:
    """Peak per rank against the sequence, one line per CP size and model: the resident set (solid)
    and, where recorded, the tensor storage (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({p["model"] for p in result["points"] if p["ok"]})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        groups = sorted({(p["cp"], p["host_malloc"], p["tiled_mlp"]) for p in result["points"]
                         if p["ok"] and p["model"] == model})
        policies = {g[1] for g in groups}
        for cp, policy, tmlp in groups:
            pts = sorted((p for p in result["points"] if p["ok"] and p["model"] == model and p["cp"] == cp
                          and p["host_malloc"] == policy and p["tiled_mlp"] == tmlp), key=lambda q: q["seq"])
            label = f"CP={cp}" + (f" ({policy} malloc)" if len(policies) > 1 else "") + (f" tiled MLP {tmlp}" if tmlp else "")
            line, = ax.plot([p["seq"] for p in pts], [p["peak_gb_max_rank"] for p in pts], marker="o",
                            linestyle="-" if policy == "fixed" else "--", alpha=1.0 if not tmlp else 0.6,
                            label=label + " resident set")
            tp = [p for p in pts if "tensor_peak_gb_max_rank" in p]
            if tp:
                ax.plot([p["seq"] for p in tp], [p["tensor_peak_gb_max_rank"] for p in tp], marker="s",
                        linestyle=":", color=line.get_color(), label=label + " tensors")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("peak memory per rank (GB)")
        ax.set_title(f"{model} ({'tiled' if result.get('tiled_loss', True) else 'untiled'} loss)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def _save(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)


def search_longest(model: str, cp: int, budget_gb: float, *, start: int, steps: int, ac: bool, tiled: bool,
                   timeout: float) -> dict:
    """Double the sequence from ``start`` while every rank together stays under ``budget_gb``, then
    bisect between the last fit and the first miss (multiples of 1024)."""
    fit, miss, seq, points = None, None, start, []
    while True:
        p = run_point(model, cp, seq, steps=steps, ac=ac, tiled=tiled, timeout=timeout)
        points.append(p)
        if p["ok"] and p["total_gb_all_ranks"] <= budget_gb:
            fit = seq
            seq *= 2
        else:
            miss = seq
            break
    while fit is not None and miss - fit > 1024 * max(1, fit // 16384):
        mid = (fit + miss) // 2 // 1024 * 1024
        p = run_point(model, cp, mid, steps=steps, ac=ac, tiled=tiled, timeout=timeout)
        points.append(p)
        if p["ok"] and p["total_gb_all_ranks"] <= budget_gb:
            fit = mid
        else:
            miss = mid
    return {"model": model, "cp": cp, "budget_gb": budget_gb, "longest_fit": fit, "first_miss": miss,
            "points": points}


def flops_line(p: dict) -> str:
    """The point's FLOPs, the rate its last step reached and the fraction of the torch.mm rate."""
    line = (f"step {p['step_flops_hardware'] / 1e9:.1f} GFLOP hardware ({p['step_flops_model'] / 1e9:.1f} model), "
            f"{p['achieved_gflops_hardware']:.1f} GFLOP/s over {p['cp']} rank(s)")
    if "fraction_of_mm_fp32" in p:
        line += (f" = {100 * p['fraction_of_mm_fp32']:.1f}% of {p['cp']} x torch.mm fp32 "
                 f"({p['mm_gflops_per_rank']['fp32']:.1f} GFLOP/s/rank; bf16 torch.mm "
                 f"{p['mm_gflops_per_rank']['bf16']:.1f} GFLOP/s/rank, {100 * p['fraction_of_mm_bf16']:.0f}% of it)")
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--ac", action="store_true", help="activation checkpointing")
    ap.add_argument("--activation-offload", action="store_true", help="schedule.activation_offload (needs --ac)")
    ap.add_argument("--gemm-seconds", type=float, default=1.0,
                    help="seconds per torch.mm rate measurement at start (0: none, no fractions)")
    ap.add_argument("--method", default="sdpa_hf", help="CP wrapper for CP > 1: a registry name (sdpa_hf = "
                    "Colossal, sdpa_hf_ulysses) or a _target_ path (hyper_parallel.distributed.context_parallel."
                    "wrappers.sdpa_hf_load_balance_cp_wrapper = Head-Tail)")
    ap.add_argument("--untiled", action="store_true", help="the untiled loss (full [S, vocab] logits)")
    ap.add_argument("--host-malloc", nargs="+", default=["fixed"], choices=["fixed", "glibc"],
                    help="CPU allocator policy per point: fixed mmap threshold (default) and/or glibc's dynamic one")
    ap.add_argument("--tiled-mlp", type=int, nargs="+", default=[0], metavar="CHUNK",
                    help="schedule.tiled_mlp chunk sizes to run at each point (0 = off)")
    ap.add_argument("--search", action="store_true", help="longest sequence within --budget-gb per CP size")
    ap.add_argument("--budget-gb", type=float, default=24.0, help="all ranks of one machine together")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "memory_scaling.json"))
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="no runs: combine the points of these result files "
                    "(later files win on the same model/cp/seq/policy), recompute ratios and fits, write --out and its plot")
    args = ap.parse_args(argv)
    tiled = not args.untiled
    if args.merge:
        merged, points = None, {}
        for path in args.merge:
            with open(path) as fh:
                part = json.load(fh)
            merged = merged or {k: v for k, v in part.items() if k not in ("points", "fit", "fit_tensor")}
            merged.setdefault("merged_from", []).append({"file": os.path.basename(path), "command": part.get("command")})
            for p in part["points"]:
                points[(p["model"], p["cp"], p["seq"], p.get("host_malloc"), p.get("tiled_mlp"))] = p
        merged["merged_from"] = merged["merged_from"][-len(args.merge):]
        merged["points"] = sorted(points.values(), key=lambda p: (p["model"], p["seq"], p["cp"]))
        summarize(merged, args.budget_gb)
        _save(args.out, merged)
        plot(merged, args.out.replace(".json", ".png"))
        print(f"wrote {args.out}")
        return 0
    result = {"cpu": cpu_name(), "steps": args.steps, "ac": args.ac, "activation_offload": args.activation_offload,
              "load_average_at_start": list(os.getloadavg()), "tiled_loss": tiled, "method": args.method,
              "command": " ".join(["python", "benchmarks/memory_scaling.py"] + list(argv if argv is not None
                                                                                   else sys.argv[1:])),
              "points": [], "search": []}
    gemm = measure_gemm(args.cps, args.gemm_seconds)
    result["mm_gflops_per_rank_by_threads"] = {str(t): {k: v / 1e9 for k, v in r.items()} for t, r in gemm.items()}
    if args.search:
        for model in args.models:
            for cp in args.cps:
                res = search_longest(model, cp, args.budget_gb, start=args.seqs[0], steps=args.steps, ac=args.ac,
                                     tiled=tiled, timeout=args.timeout)
                print(f"{model} cp={cp}: longest within {args.budget_gb} GB: {res['longest_fit']} tokens "
                      f"(first miss {res['first_miss']})", flush=True)
                result["search"].append(res)
    else:
        for model in args.models:
            for seq in args.seqs:
                for cp in args.cps:
                    for policy, tmlp in [(p, t) for p in args.host_malloc for t in args.tiled_mlp]:
                        p = run_point(model, cp, seq, steps=args.steps, ac=args.ac, tiled=tiled,
                                      timeout=args.timeout, method=args.method, host_malloc=policy, tiled_mlp=tmlp,
                                      offload=args.activation_offload, gemm=gemm)
                        result["points"].append(p)
                        _save(args.out, result)      # after every point: a long run killed midway keeps its points
                        msg = (f"peak/rank {p['peak_gb_max_rank']:.2f} GB ({p['mb_per_token_max_rank']:.3f} MB/token), "
                               f"all ranks {p['total_gb_all_ranks']:.2f} GB, CPU user/sys "
                               f"{p['cpu_user_s']:.0f}/{p['cpu_sys_s']:.0f} s, step s "
                               f"{'/'.join(f'{t:.1f}' for t in p['step_time_s'])}, {p['wall_s']:.0f}s; "
                               + flops_line(p)) \
                            if p["ok"] else f"FAILED: {p['error'][-300:]}"
                        print(f"{model:12} seq={seq:>6} cp={cp} malloc={policy} tiled_mlp={tmlp}: {msg}", flush=True)
        summarize(result, args.budget_gb)
    _save(args.out, result)
    print(f"wrote {args.out} (CPU: {result['cpu']})")
    if result["points"]:
        plot(result, args.out.replace(".json", ".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
