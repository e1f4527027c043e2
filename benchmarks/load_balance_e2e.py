"""Per-rank attention engine CPU time inside the trainer: Head-Tail vs the balanced split, end to end.

For each config (default: the main job's ``examples/train_long_cp2.yaml`` at cp 2 and
``examples/train_long_cp4_balanced.yaml`` at cp 4) and each split, the trainer runs ``--steps``
steps (``hyper-train`` itself, its own launcher; eval, checkpoint and HF export off; the attention
method of the config's ``*.self_attn`` override swapped: ``head_tail`` = the Head-Tail wrapper,
``balanced`` = ``sdpa_hf_balanced``). ``benchmarks/_e2e_hook/sitecustomize.py`` (put on PYTHONPATH
here only) times every call of the CPU engine (``attn_fwd`` / ``attn_bwd``) in thread CPU time, per
rank and optimizer step. Reported per step: slowest rank / mean; aggregated over the steps after
the first (warm-up): the per-step spreads' median and the spread of the ranks' summed times::

    python benchmarks/load_balance_e2e.py [--steps 4] [--only cp2|cp4]

Appends to ``benchmarks/results/load_balance_e2e.json`` (each record numbered ``run`` per config and split;
earlier runs are kept) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._machine import cpu_name  # noqa: E402

CONFIGS = {"cp2": "examples/train_long_cp2.yaml", "cp4": "examples/train_long_cp4_balanced.yaml"}
WRAPPERS = {"head_tail": {"_target_": "hyper_parallel.distributed.context_parallel.wrappers."
                                        "sdpa_hf_load_balance_cp_wrapper"},
            "balanced": "sdpa_hf_balanced"}


def run_one(config: str, split: str, steps: int, tmp: str) -> dict:
    with open(os.path.join(ROOT, config), encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    for ov in cfg["plan_overrides"]:
        if ov.get("match") == "*.self_attn":
            ov["inner_wrapper"] = WRAPPERS[split]
    out = os.path.join(tmp, split)
    os.makedirs(out, exist_ok=True)
    cfg["data"]["eval_every"] = 10 ** 6
    cfg["schedule"].update(steps=steps, save_every=10 ** 6)
    cfg["logging"].update(out_dir=os.path.join(out, "run"), export_hf=False)
    path = os.path.join(out, "config.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg, fh)
    # spawned ranks: the timing hook (sitecustomize) installs itself at interpreter start of a rank
    # (LOCAL_RANK set), which a rank forked from hyper-train's parent never has
    env = dict(os.environ, HP_E2E_ATTN_OUT=out, OMP_NUM_THREADS="1", HYPER_PARALLEL_START_METHOD="spawn",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "benchmarks", "_e2e_hook"), ROOT,
                                           os.environ.get("PYTHONPATH", "")]))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "hyper_parallel.trainer.cli", path], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{config} {split}: trainer exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    recs = []
    for name in sorted(os.listdir(out)):
        if name.startswith("rank") and name.endswith(".jsonl"):
            with open(os.path.join(out, name), encoding="utf-8") as fh:
                recs.extend(json.loads(line) for line in fh)
    cp = max(r["rank"] for r in recs) + 1
    t, whole = np.zeros((steps, cp)), np.zeros((steps, cp))
    for r in recs:
        t[r["step"] - 1, r["rank"]] = r["fwd_s"] + r["bwd_s"]
        whole[r["step"] - 1, r["rank"]] = r.get("step_cpu_s", np.nan)
    spreads = (t.max(1) / t.mean(1)).tolist()
    later = t[1:]
    summed = later.sum(0)
    work = []
    log = os.path.join(out, "run", "train_log.jsonl")
    if os.path.exists(log):
        with open(log, encoding="utf-8") as fh:
            work = [json.loads(line).get("attn_work_max_over_mean") for line in fh if '"step"' in line]
    return {"config": config, "split": split, "cp": cp, "steps": steps, "wall_s": round(time.time() - t0, 1),
            "rank_attn_cpu_s_per_step": t.round(4).tolist(), "step_max_over_mean": [round(s, 4) for s in spreads],
            "median_step_max_over_mean_after_first": round(float(np.median(spreads[1:])), 4),
            "summed_after_first_max_over_mean": round(float(summed.max() / summed.mean()), 4),
            "slowest_rank_attn_s_per_step_after_first": round(float(later.max(1).mean()), 4),
            "rank_step_cpu_s": whole.round(3).tolist(),
            "slowest_rank_step_cpu_s_after_first": round(float(whole[1:].max(1).mean()), 3),
            "cost_model_work_max_over_mean": [w for w in work if w is not None],
            "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def table(doc: dict) -> str:
    """Markdown table of the results (the docs page's)."""
    lines = ["| config, cp, run | split | per-step max/mean attention time (every step) | slowest rank attention s / "
             "step (after the first) | slowest rank step CPU s (after the first) | cost model per step | load average "
             "(start -> end) |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        name = f'{os.path.basename(r["config"]).replace(".yaml", "")}, {r["cp"]}, run {r.get("run", 1)}'
        step_cpu = r.get("slowest_rank_step_cpu_s_after_first")
        lines.append(f"| {name} | {r['split']} | {' / '.join(f'{x:.3f}' for x in r['step_max_over_mean'])} | "
                     f"{r['slowest_rank_attn_s_per_step_after_first']:.2f} | "
                     f"{'-' if step_cpu is None else f'{step_cpu:.2f}'} | "
                     f"{' / '.join(f'{x:.2f}' for x in r['cost_model_work_max_over_mean'])} | "
                     f"{r['loadavg_at_start'][0]:.0f} -> {r['loadavg_1_5_15'][0]:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only", choices=sorted(CONFIGS), default=None)
    ap.add_argument("--splits", default="head_tail,balanced")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "load_balance_e2e.json"))
    args = ap.parse_args(argv)
    doc = {"machine": {}, "results": []}
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as fh:
            doc = json.load(fh)
    keys = [args.only] if args.only else list(CONFIGS)
    with tempfile.TemporaryDirectory(prefix="hp_e2e_") as tmp:
        for key in keys:
            for split in args.splits.split(","):
                load0 = [round(x, 2) for x in os.getloadavg()]
                rec = run_one(CONFIGS[key], split, args.steps, os.path.join(tmp, key))
                rec["loadavg_at_start"] = load0
                rec["run"] = 1 + max((r.get("run", 1) for r in doc["results"]
                                      if (r["config"], r["split"]) == (rec["config"], split)), default=0)
                doc["results"].append(rec)   # earlier runs stay: the docs quote them by number
                print(f"{key} {split:<9} per-step max/mean {rec['step_max_over_mean']}  summed(after 1st) "
                      f"{rec['summed_after_first_max_over_mean']}  slowest {rec['slowest_rank_attn_s_per_step_after_first']} s"
                      f"  load {load0}->{rec['loadavg_1_5_15']}", flush=True)
    doc["machine"] = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads_per_rank": 1,
                      "note": "ranks share the cores with each other and with other jobs; thread CPU time"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
    print(table(doc))
    return doc


if __name__ == "__main__":
    main()
