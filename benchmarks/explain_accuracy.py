"""How close ``hyper-train --explain``'s memory estimate is to measured peaks (no training here).

For every successful point of the given ``benchmarks/memory_scaling.py`` result files (real
trainer runs: ``tensor_peak_gb_max_rank`` is the counting allocator's tensor peak, the figure a
device allocator reports; ``peak_gb_max_rank`` the resident set), the same config is rebuilt
(``memory_scaling._config``) and :func:`hyper_parallel.trainer.explain.explain` estimates it on
the meta device in this one process. Prints a table and writes ``benchmarks/results/
explain_accuracy.json`` (estimate, measurement and relative error per point; the CPU, the load and
this process's runtime baseline, which the resident-set estimate adds).

    python benchmarks/explain_accuracy.py      # the default result files below
    python benchmarks/explain_accuracy.py --main-log runs/long_cp2/train_log.json   # + the main job
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from _machine import cpu_name  # noqa: E402
from memory_scaling import _config  # noqa: E402

DEFAULT = ["memory_scaling_h256_tensor.json", "memory_scaling_h1024_tensor.json", "memory_128k_cp124.json",
           "memory_256k_cp124.json"]


def _estimate(cfg_dict: dict) -> dict:
    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.explain import explain

    return explain(TrainerConfig.from_dict(cfg_dict), echo=lambda *a: None)


def _row(source: str, label: str, est: dict, tensor_gb, resident_gb) -> dict:
    t, r = est["tensor_peak"] / 1e9, est["peak"] / 1e9
    return {"source": source, "point": label, "est_tensor_gb": round(t, 4), "measured_tensor_gb": tensor_gb,
            "tensor_rel_err": None if not tensor_gb else round(t / tensor_gb - 1, 4),
            "est_resident_gb": round(r, 4), "measured_resident_gb": resident_gb,
            "resident_rel_err": None if not resident_gb else round(r / resident_gb - 1, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", default=DEFAULT)
    ap.add_argument("--main-log", help="the main job's train_log.json (examples/train_long_cp2.yaml)")
    ap.add_argument("--main-overrides", nargs="*", default=[])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "explain_accuracy.json"))
    args = ap.parse_args()
    rows = []
    if args.main_log:
        from hyper_parallel.trainer.config import TrainerConfig
        from hyper_parallel.trainer.explain import explain

        steps = json.load(open(args.main_log))["steps"]
        cfg = TrainerConfig.from_yaml(os.path.join(ROOT, "examples", "train_long_cp2.yaml"), args.main_overrides)
        est = explain(cfg, echo=lambda *a: None)
        tensor = max(max(r.get("peak_tensor_gb_per_rank") or [0]) for r in steps) or None
        rows.append(_row("main job", f"cp 2, seq {cfg.data.seq_len}, {len(steps)} steps", est, tensor,
                         max(max(r["peak_mem_gb_per_rank"]) for r in steps)))
    with tempfile.TemporaryDirectory(prefix="hp_explain_") as tmp:
        for name in args.files:
            data = json.load(open(os.path.join(ROOT, "benchmarks", "results", name)))
            for p in data.get("points", []):
                if not p.get("ok") or p.get("tiled_mlp") or p.get("activation_offload"):
                    continue   # explain does not model the tiled MLP or offload
                method = p.get("method") or "sdpa_hf"
                cfg = _config(p["model"], p["cp"], p["seq"], 1, bool(p.get("ac")), data.get("tiled_loss", True),
                              os.path.join(tmp, "run"), method)
                est = _estimate(cfg)
                short = method.rsplit(".", 1)[-1].replace("_cp_wrapper", "")
                rows.append(_row(name, f"{p['model']} cp {p['cp']} seq {p['seq']} {short if p['cp'] > 1 else ''}".strip(),
                                 est, p.get("tensor_peak_gb_max_rank"), p.get("peak_gb_max_rank")))
                print(rows[-1], flush=True)
    load = os.getloadavg()
    out = {"cpu": cpu_name(), "load_avg_1_5_15": [round(x, 1) for x in load],
           "baseline_gb": round(est["baseline"] / 1e9, 4), "rows": rows}
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print("| point | est. tensors GB | measured tensors GB | err | est. resident GB | measured resident GB | err |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        te = "" if r["tensor_rel_err"] is None else f"{100 * r['tensor_rel_err']:+.1f} %"
        re_ = "" if r["resident_rel_err"] is None else f"{100 * r['resident_rel_err']:+.1f} %"
        print(f"| {r['source']}: {r['point']} | {r['est_tensor_gb']:.3f} | {r['measured_tensor_gb'] or ''} | {te} | "
              f"{r['est_resident_gb']:.3f} | {r['measured_resident_gb']} | {re_} |")
    print(f"wrote {args.out} (CPU {out['cpu']}, load {out['load_avg_1_5_15']})")


if __name__ == "__main__":
    main()
