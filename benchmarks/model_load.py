"""Build-and-shard and load-and-shard memory and time, meta build vs the old full build (issue 18 item 4).

One command::

    python benchmarks/model_load.py            # the 0.54B Llama: build / load, CP=2 vs one process,
                                               # before (full model on every rank) vs after (meta build)
    python benchmarks/model_load.py --quick    # a 0.1B model (smoke run)

What it does, each point a fresh ``torchrun`` (so the resident-set peak is the point's own):

* writes once a local HF checkpoint of the model (random init, ``save_hf``, one process);
* ``build``: ``TextTrainer(cfg)`` with a random model (steps 0): **after** = the trainer's meta build
  (plan on the empty model, each rank materializes its shards); **before** = what the trainer did
  before issue 18 (``HyperAutoModel.from_config`` materializes the whole model on every rank, then
  the trainer parallelizes it: ``TextTrainer(cfg, model=full)``);
* ``load``: the same with ``model.path`` = that checkpoint: **after** = sharded DCP load of each
  rank's slices; **before** = ``transformers.AutoModelForCausalLM.from_pretrained`` on every rank
  (the old ``model.path`` path), then parallelize;
* ``build+proof``: the CP=2 meta build with the CP preflight proof on (the other points run with
  ``accelerator.cp_preflight_proof: false`` so that they measure build-and-shard alone; the proof's
  forward on the sharded model unshards the FSDP root and one layer, as every training forward does);
* ``step``: build + one AdamW step with CP=2 + FSDP2 on a smaller model (``--step-layers``),
  before and after: peak per rank and the sum over ranks, whence bytes per parameter and the
  largest model one 24 GiB machine trains one step with (an estimate, stated as such: the sum of
  the two ranks' peaks minus their fixed part, divided by the parameters, extrapolated to 24 GiB).

Peak memory: CPU — each rank's peak resident set (``ru_maxrss``) and, beside it, its peak anonymous
resident memory (``RssAnon`` sampled every 20 ms: the heap, without the pages of a memory-mapped
checkpoint, which are page cache shared between the ranks that map the same file); CUDA/NPU — the
allocator's peak on the device. Seconds: the trainer's construction (build or load, plan, shard, CP proof).
Writes ``benchmarks/results/model_load.json`` and prints a table.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_name  # noqa: E402

# ~0.54B parameters, fp32 2.0 GiB (vocab 32000, untied head)
LLAMA_054B = dict(vocab_size=32000, hidden_size=1280, intermediate_size=3456, num_hidden_layers=27,
                  num_attention_heads=20, num_key_value_heads=4, tie_word_embeddings=False,
                  max_position_embeddings=4096)
CP_PLAN = [{"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_target": "self",
            "inner_wrapper": {"_target_": "hyper_parallel.distributed.context_parallel.wrappers.sdpa_hf_cp_wrapper"}}]


def _cfg(model_cfg: dict, cp: int, out_dir: str, path: str | None = None, proof: bool = False) -> dict:
    model = {"path": path, "seed": 0} if path else {"architecture": "llama", "config": model_cfg, "seed": 0}
    return {"model": model,
            "data": {"path": os.path.join(ROOT, "examples", "data", "corpus.txt"), "seq_len": 256,
                     "micro_batch_size": 1, "seed": 0},
            "optimizer": {"name": "adamw", "lr": 1e-4},
            "schedule": {"steps": 1, "warmup_steps": 0},
            "accelerator": {"cp_size": cp, "cp_preflight_proof": proof},
            "plan_overrides": CP_PLAN if cp > 1 else [],
            "logging": {"out_dir": out_dir, "progress": False, "plot": False}}


def _peak_gb(device) -> float:
    if device.type in ("cuda", "npu"):
        mod = getattr(__import__("torch"), device.type)
        return mod.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class _AnonPeak:
    """Peak anonymous resident memory (``RssAnon`` of /proc/self/status, sampled every 20 ms): the
    process's own heap, without the file pages a memory-mapped checkpoint adds to the resident set
    (page cache, shared by every rank that maps the same file, dropped when the file is closed)."""

    def __init__(self):
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> int:
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            self._stop.wait(0.02)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.now()) / 1e9


# ---------------------------------------------------------------------- one rank (under torchrun)
def worker(args) -> None:
    import torch

    from hyper_parallel.trainer.config import TrainerConfig
    from hyper_parallel.trainer.model import HyperAutoModel
    from hyper_parallel.trainer.text import TextTrainer

    cfg = TrainerConfig.from_dict(json.loads(open(args.cfg).read()))
    fixed = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9    # imports, before any model
    anon = _AnonPeak()
    t0 = time.perf_counter()
    if args.mode == "write":
        from hyper_parallel.trainer.hf_checkpoint import save_hf

        model = HyperAutoModel.from_config(cfg.model)
        save_hf(model, args.ckpt)
        trainer = None
    elif args.variant == "before":
        if cfg.model.path:
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model.path, local_files_only=True,
                                                                      dtype=torch.float32)
            model.config.use_cache = False
            model.train()
        else:
            model = HyperAutoModel.from_config(cfg.model)
        trainer = TextTrainer(cfg, model=model)
        del model
    else:
        trainer = TextTrainer(cfg)
    build_s = time.perf_counter() - t0
    build_peak = _peak_gb(trainer.device) if trainer is not None else _peak_gb(torch.device("cpu"))
    build_anon = anon.stop()
    step_s = None
    if args.mode == "step":
        t1 = time.perf_counter()
        trainer.train_step(trainer.data.next_micro_batches(1))
        step_s = time.perf_counter() - t1
    n_params = None
    if trainer is not None:
        n_params = sum(p.numel() for p in trainer.model.parameters())
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "build_s": build_s, "build_peak_gb": build_peak, "fixed_gb": fixed,
                   "build_anon_peak_gb": build_anon,
                   "peak_gb": _peak_gb(trainer.device) if trainer is not None else build_peak,
                   "step_s": step_s, "params": n_params}, fh)


# ---------------------------------------------------------------------- driver
def run_point(mode: str, variant: str, cp: int, model_cfg: dict, tmp: str, ckpt: str | None,
              timeout: float = 900, proof: bool = False) -> dict:
    out = tempfile.mkdtemp(dir=tmp, prefix=f"{mode}_{variant}_cp{cp}_")
    cfg_path = os.path.join(out, "cfg.json")
    path = ckpt if mode == "load" else None
    with open(cfg_path, "w") as fh:
        json.dump(_cfg(model_cfg, cp, os.path.join(out, "run"), path, proof), fh)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
           os.path.abspath(__file__), "--worker", "--mode", mode, "--variant", variant, "--cfg", cfg_path,
           "--out", out, "--ckpt", ckpt or ""]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // cp)))
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"mode": mode, "variant": variant, "cp": cp, "ok": False, "error": (proc.stderr or proc.stdout)[-2000:]}
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(cp)]
    return {"mode": mode, "variant": variant, "cp": cp, "ok": True, "proof": proof, "wall_s": time.time() - t0,
            "build_s": max(r["build_s"] for r in ranks),
            "build_peak_gb_per_rank": [r["build_peak_gb"] for r in ranks],
            "build_anon_peak_gb_per_rank": [r["build_anon_peak_gb"] for r in ranks],
            "peak_gb_per_rank": [r["peak_gb"] for r in ranks],
            "fixed_gb_per_rank": [r["fixed_gb"] for r in ranks],
            "step_s": ranks[0]["step_s"], "params": ranks[0]["params"]}


def _count(model_cfg: dict) -> int:
    h, i, v, n = (model_cfg[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers"))
    kv = h // model_cfg["num_attention_heads"] * model_cfg["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return n * layer + v * h * (1 if model_cfg.get("tie_word_embeddings") else 2) + h


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="build")
    ap.add_argument("--variant", default="after")
    ap.add_argument("--cfg")
    ap.add_argument("--out")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--quick", action="store_true", help="a 0.1B model instead of 0.54B")
    ap.add_argument("--step-layers", type=int, default=4, help="decoder layers of the one-step model")
    ap.add_argument("--budget-gb", type=float, default=24.0 * 1.073741824, help="machine memory (GB) of the estimate")
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "model_load.json"))
    ap.add_argument("--largest", action="store_true",
                    help="only the search for the largest model that trains one AdamW step with CP=2 + FSDP2 "
                         "within --budget-gb (writes model_load_largest.json)")
    ap.add_argument("--fit-layers", default="4,16", help="decoder layers of the two fitting points of --largest")
    ap.add_argument("--margin", type=float, default=0.95,
                    help="--largest confirms at this fraction of the predicted largest size")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.largest:
        return largest_search(args)
    model_cfg = dict(LLAMA_054B, num_hidden_layers=4) if args.quick else dict(LLAMA_054B)
    step_cfg = dict(LLAMA_054B, num_hidden_layers=args.step_layers)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hp_model_load_") as tmp:
        ckpt = os.path.join(tmp, "hf_ckpt")
        w = run_point("write", "after", 1, model_cfg, tmp, ckpt)
        if not w["ok"]:
            print(w["error"])
            return 1
        print(f"wrote {ckpt} ({w['build_s']:.1f} s)", flush=True)
        for mode in ("build", "load"):
            for variant in ("before", "after"):
                for cp in (1, 2):
                    r = run_point(mode, variant, cp, model_cfg, tmp, ckpt)
                    rows.append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "error"}) if r["ok"] else r, flush=True)
        # the same build with the CP preflight proof on (the trainer's default): its forward on the
        # FSDP model unshards the root (embedding + head) and one layer, as the first step's forward does
        r = run_point("build", "after", 2, model_cfg, tmp, ckpt, proof=True)
        r["mode"] = "build+proof"
        rows.append(r)
        print(json.dumps(r) if r["ok"] else r, flush=True)
        for variant in ("before", "after"):
            r = run_point("step", variant, 2, step_cfg, tmp, None)
            rows.append(r)
            print(json.dumps(r) if r["ok"] else r, flush=True)
    summary = _summarize(rows, _count(model_cfg), _count(step_cfg), args.budget_gb)
    result = {"cpu": cpu_name(), "model": model_cfg, "params": _count(model_cfg), "step_model": step_cfg,
              "step_params": _count(step_cfg), "points": rows, "summary": summary}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=2)
    _print_table(result)
    return 0


def largest_search(args) -> int:
    """The largest model (0.54B Llama's layer shape, more or fewer decoder layers) that trains one
    AdamW step with CP=2 + FSDP2 on this machine within ``--budget-gb`` (sum of both ranks' peaks),
    found by measurement: two step points (``--fit-layers``) fit ``total peak = a + b * params`` (the
    fixed part — processes, FSDP's unsharded root, activations — and the bytes per parameter);
    the fit predicts the largest layer count; that size times ``--margin`` is then run, and
    the search walks down a layer at a time until a run's measured total is inside the budget.
    The confirmed point is a measured run, the predicted maximum is stated as a prediction."""
    fit_layers = [int(x) for x in args.fit_layers.split(",")]
    rows = []
    layer_params = _count(dict(LLAMA_054B, num_hidden_layers=1)) - _count(dict(LLAMA_054B, num_hidden_layers=0))
    base_params = _count(dict(LLAMA_054B, num_hidden_layers=0))

    def step(layers: int, variant: str = "after") -> dict:
        cfg = dict(LLAMA_054B, num_hidden_layers=layers)
        with tempfile.TemporaryDirectory(prefix="hp_largest_") as tmp:
            r = run_point("step", variant, 2, cfg, tmp, None, timeout=3600)
        r.update(layers=layers, params=_count(cfg))
        if r.get("ok"):
            r["total_peak_gb"] = sum(r["peak_gb_per_rank"])
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "error"}) if r["ok"] else r, flush=True)
        return r

    fit = {}
    for variant in ("before", "after"):
        pts = [step(n, variant) for n in fit_layers]
        if not all(p.get("ok") for p in pts):
            print("a fitting point failed")
            return 1
        (p0, p1) = pts
        b = (p1["total_peak_gb"] - p0["total_peak_gb"]) / (p1["params"] - p0["params"])    # GB per parameter
        a = p0["total_peak_gb"] - b * p0["params"]
        n_max = (args.budget_gb - a) / b
        fit[variant] = {"fixed_gb": a, "bytes_per_param": b * 1e9, "predicted_largest_params": n_max,
                        "predicted_largest_layers": int((n_max - base_params) // layer_params)}
        print(f"{variant}: total peak = {a:.2f} GB + {b * 1e9:.2f} B/param -> predicted largest "
              f"{n_max / 1e9:.3f}B params", flush=True)
    confirmed = None
    layers = int((fit["after"]["predicted_largest_params"] * args.margin - base_params) // layer_params)
    while layers > max(fit_layers):
        r = step(layers)
        if r.get("ok") and r["total_peak_gb"] <= args.budget_gb:
            confirmed = r
            break
        layers -= 1
    result = {"cpu": cpu_name(), "budget_gb": args.budget_gb, "layer_shape": LLAMA_054B, "fit": fit,
              "confirmed": confirmed and {k: confirmed[k] for k in ("layers", "params", "total_peak_gb",
                                                                     "peak_gb_per_rank", "step_s", "build_s")},
              "points": rows}
    out = os.path.join(os.path.dirname(args.json), "model_load_largest.json")
    with open(out, "w") as fh:
        json.dump(result, fh, indent=2)
    if confirmed:
        print(f"measured: {confirmed['params'] / 1e9:.3f}B params ({confirmed['layers']} layers) trained one step, "
              f"both ranks' peaks {confirmed['total_peak_gb']:.2f} GB <= {args.budget_gb:.2f} GB")
    print(f"wrote {out}")
    return 0 if confirmed else 1


def _summarize(rows: list, params: int, step_params: int, budget_gb: float) -> dict:
    ok = {(r["mode"], r["variant"], r["cp"]): r for r in rows if r.get("ok")}
    out = {}
    for mode in ("build", "load"):
        for variant in ("before", "after"):
            one, two = ok.get((mode, variant, 1)), ok.get((mode, variant, 2))
            if one and two:
                for key in ("build_peak_gb_per_rank", "build_anon_peak_gb_per_rank"):
                    tag = "rss" if key.startswith("build_peak") else "anon"
                    out[f"{mode}_{variant}_cp2_over_cp1_per_rank_{tag}"] = max(two[key]) / max(one[key])
    for variant in ("before", "after"):
        r = ok.get(("step", variant, 2))
        if r:
            total = sum(r["peak_gb_per_rank"])
            fixed = sum(r["fixed_gb_per_rank"])
            per_param = (total - fixed) * 1e9 / step_params
            out[f"step_{variant}_bytes_per_param_all_ranks"] = per_param
            out[f"step_{variant}_largest_params_estimate"] = (budget_gb - fixed) * 1e9 / per_param
    return out


def _print_table(result: dict) -> None:
    print(f"\nmodel: {result['params'] / 1e9:.3f}B params (fp32 {result['params'] * 4 / 2**30:.2f} GiB); "
          f"CPU: {result['cpu']}")
    print(f"{'what':<12}{'variant':<9}{'ranks':>6}{'peak RSS GB/rank':>18}{'peak anon GB/rank':>19}{'seconds':>10}")
    for r in result["points"]:
        if not r.get("ok"):
            print(f"{r['mode']:<12}{r['variant']:<9}{r['cp']:>6}   failed")
            continue
        peak = max(r["build_peak_gb_per_rank"] if r["mode"] != "step" else r["peak_gb_per_rank"])
        sec = r["build_s"] + (r["step_s"] or 0)
        anon = max(r["build_anon_peak_gb_per_rank"])
        print(f"{r['mode']:<12}{r['variant']:<9}{r['cp']:>6}{peak:>18.2f}{anon:>19.2f}{sec:>10.1f}")
    for k, v in result["summary"].items():
        print(f"{k}: {v:.3g}")


if __name__ == "__main__":
    sys.exit(main())
