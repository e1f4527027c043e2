"""How long ``hyper-train`` takes to refuse a bad config on 2 CPU ranks, end to end, and where it goes.

Cases (each run ``--repeats`` times as ``python -m hyper_parallel.trainer.cli CONFIG k=v ...``
from a shell that is no torchrun worker, exactly as a user starts ``hyper-train``):

* ``parent``: ``accelerator.cp_size=two``, refused by the parent's schema check, no rank started;
* ``parent-model``: ``schedule.tiled_mlp=true`` on a mixture-of-experts model, a check that needs
  the model (refused in the parent on the meta device, when the parent checks the model);
* ``rank``: a refusal only a rank can make (``HYPER_PARALLEL_FAULT_INJECT=rank=1,step=1,
  kind=raise,at=setup``: rank 1 raises during set-up, the stand-in for any rank-side error).

Then the pieces: a bare interpreter, ``import torch``, ``import transformers``, importing the CLI,
and the parent's own check of a valid config (:func:`hyper_parallel.trainer.launch.check_before_launch`).
Writes ``benchmarks/results/refusal_latency.json`` (or ``--out``) with the CPU, the load average
before each run and the ranks' start method (``--start-method``, passed as
``HYPER_PARALLEL_START_METHOD``; ``auto``: fork on a CPU-only machine, see trainer/start_method.py).

    python benchmarks/refusal_latency.py --repeats 3
    python benchmarks/refusal_latency.py --cases rank --no-pieces --start-method spawn --out ...
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_name  # noqa: E402

BASE = ["examples/train_cp2.yaml", "schedule.steps=1", "data.seq_len=64", "logging.progress=false",
        "logging.plot=false"]
MOE = ["model.architecture=qwen3_moe", "model.config_file=examples/models/tiny_qwen3_moe.yaml"]
CASES = {
    "parent": (["accelerator.cp_size=two"], {}),
    "parent-model": (MOE + ["schedule.tiled_mlp=true"], {}),
    "rank": ([], {"HYPER_PARALLEL_FAULT_INJECT": "rank=1,step=1,kind=raise,at=setup"}),
}
PIECES = {
    "python": "pass",
    "import torch": "import torch",
    "import transformers": "import torch, transformers",
    "import the CLI": "import hyper_parallel.trainer.cli",
    "parent check (valid config)": "from hyper_parallel.trainer.launch import check_before_launch; "
                                   f"check_before_launch({BASE!r}, None)",
}


def _env(extra: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def _timed(cmd: list, env: dict, out_dir: str) -> dict:
    load = os.getloadavg()
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:   # recorded, not fatal: the other runs still count
        return {"seconds": None, "exit": "timeout 600 s", "load_avg_1_5_15": [round(x, 2) for x in load],
                "line": ""}
    took = time.perf_counter() - t0
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hyper-train")]
    return {"seconds": round(took, 2), "exit": p.returncode, "load_avg_1_5_15": [round(x, 2) for x in load],
            "line": lines[-1][:200] if lines else p.stderr[-200:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    ap.add_argument("--no-pieces", action="store_true", help="skip the per-piece timings")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "refusal_latency.json"))
    ap.add_argument("--start-method", default="auto",
                    help="HYPER_PARALLEL_START_METHOD for the launched ranks (auto, fork, spawn); a comma-separated "
                         "list alternates them within each repeat (same load for both)")
    args = ap.parse_args()
    out = {"cpu": cpu_name(), "cores": os.cpu_count(), "start_methods": args.start_method.split(","),
           "cases": {}, "pieces": {}}

    def save():   # after every run: a run killed by a time limit keeps what it measured
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)

    for name in args.cases.split(","):
        over, env = CASES[name]
        runs = []
        for i in range(args.repeats):
            for method in args.start_method.split(","):
                run_dir = f"/tmp/hp_refusal_latency/{name}{i}{method}"
                runs.append({"start_method": method, **_timed(
                    [sys.executable, "-m", "hyper_parallel.trainer.cli", *BASE, *over, f"logging.out_dir={run_dir}"],
                    _env({**env, "HYPER_PARALLEL_START_METHOD": method}), run_dir)})
                print(name, runs[-1], flush=True)
                out["cases"][name] = runs
                save()
    for name, code in ({} if args.no_pieces else PIECES).items():
        runs = [_timed([sys.executable, "-c", code], _env({}), "") for _ in range(args.repeats)]
        out["pieces"][name] = runs
        print(name, [r["seconds"] for r in runs], flush=True)
        save()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
