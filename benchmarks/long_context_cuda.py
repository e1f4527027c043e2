"""The longest sequence one accelerator trains: an 8B-shaped Llama at increasing lengths.

Runs the real trainer (``torchrun -m hyper_parallel.trainer.cli``, one rank, CP=1) per length:
Llama-3-8B's layer shape (hidden 4096, intermediate 14336, 32 / 8 heads, vocab 128256), random
init, ``schedule.mixed_precision: bf16`` (fp32 master weights), SGD (no optimizer state), tiled
loss, tiled MLP, activation checkpointing and ``schedule.activation_offload``. Lengths double from
``--start`` until a run fails (out of memory) or ``--budget-s`` is spent; per point the allocator's
peak (``peak_mem_gb_per_rank``) and the last step's time. The fit ``peak = fixed + per_token * S``
through the two longest points gives the longest length within the device's memory (an estimate,
reported beside the longest measured one).

Layers: fp32 weights + fp32 grads are 8 bytes per parameter (~1.75 GB per 8B layer), so 32 layers do
not fit one H100 beside long activations; ``--layers auto`` keeps the weights under half the device
memory and the JSON says how many of the 32 layers ran. With the checkpointed layer inputs in host
memory, the device memory per token is one layer's working set, so the per-token slope holds for
32 layers; ``fitted_longest_32_layers`` adds the missing layers' weights to the fixed part.

``--dry-run``: CPU, a tiny model, one short length (the code path and the JSON, not the numbers).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_scaling import _corpus  # noqa: E402

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
BYTES_PER_PARAM = 8  # fp32 master weight + fp32 grad (SGD keeps no state)


def params(cfg: dict, layers: int | None = None) -> tuple[int, int]:
    """(per-layer, embedding + head) parameter counts of a Llama config."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    layer = h * d * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) + 3 * h * i + 2 * h
    return layer, 2 * cfg["vocab_size"] * h + h


def auto_layers(cfg: dict, device_gb: float) -> int:
    layer, fixed = params(cfg)
    fit = int((0.5 * device_gb * 2**30 / BYTES_PER_PARAM - fixed) // layer)
    return max(1, min(cfg["num_hidden_layers"], fit))


def trainer_config(model: dict, seq: int, steps: int, out_dir: str, mixed_bf16: bool) -> dict:
    corpus = _corpus(os.path.join(os.path.dirname(out_dir), "corpus.txt"), seq * (steps + 2))
    return {
        "model": {"architecture": "llama", "config": dict(model, max_position_embeddings=max(seq, 8192)), "seed": 0},
        "data": {"path": corpus, "seq_len": seq, "micro_batch_size": 1, "seed": 0},
        "optimizer": {"name": "sgd", "lr": 1e-4},
        "schedule": {"steps": steps, "warmup_steps": 0, "activation_checkpointing": True,
                     "activation_offload": True, "tiled_mlp": True, "tiled_mlp_chunk_size": 8192,
                     "mixed_precision": "bf16" if mixed_bf16 else None},
        "accelerator": {"cp_size": 1},
        "logging": {"out_dir": out_dir, "log_every": 1, "progress": False, "plot": False},
        "loss": {"tiled": True},
    }


def run_point(model: dict, seq: int, steps: int, timeout: float, mixed_bf16: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="hp_long_") as tmp:
        path = os.path.join(tmp, "cfg.yaml")
        with open(path, "w") as fh:
            yaml.safe_dump(trainer_config(model, seq, steps, os.path.join(tmp, "run"), mixed_bf16), fh)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               "-m", "hyper_parallel.trainer.cli", path]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"seq": seq, "ok": False, "error": f"timeout {timeout:.0f}s", "wall_s": time.time() - t0}
        log = os.path.join(tmp, "run", "train_log.json")
        if proc.returncode != 0 or not os.path.exists(log):
            tail = (proc.stderr or proc.stdout)[-1200:]
            return {"seq": seq, "ok": False, "oom": "out of memory" in tail.lower(), "error": tail,
                    "wall_s": time.time() - t0}
        with open(log) as fh:
            steps_log = json.load(fh)["steps"]
    return {"seq": seq, "ok": True, "peak_gb": max(max(r["peak_mem_gb_per_rank"]) for r in steps_log),
            "step_time_s": [r["time_s"] for r in steps_log], "loss": steps_log[-1]["loss"],
            "wall_s": time.time() - t0}


def fit(points: list[dict], device_gb: float, missing_weights_gb: float) -> dict | None:
    ok = sorted((p for p in points if p["ok"]), key=lambda p: p["seq"])[-2:]
    if len(ok) < 2:
        return None
    (s0, m0), (s1, m1) = [(p["seq"], p["peak_gb"]) for p in ok]
    per_token = (m1 - m0) / (s1 - s0)
    fixed = m0 - per_token * s0
    longest = int((device_gb - fixed) / per_token) if per_token > 0 else None
    longest32 = int((device_gb - fixed - missing_weights_gb) / per_token) if per_token > 0 else None
    return {"fit_seqs": [s0, s1], "fixed_gb": fixed, "kb_per_token": per_token * 2**20,
            "fitted_longest": longest, "fitted_longest_32_layers": longest32}


def device_memory_gb() -> float:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_properties(0).total_memory)"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip()) / 2**30


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=16384)
    ap.add_argument("--max-seq", type=int, default=1 << 20)
    ap.add_argument("--layers", default="auto")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, one short length")
    ap.add_argument("--dry-run-bf16", action="store_true", help="the dry run with schedule.mixed_precision bf16")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "long_context_cuda.json"))
    a = ap.parse_args(argv)
    if a.dry_run:
        model, device_gb, mixed, start, max_seq, name = dict(TINY), 1.0, a.dry_run_bf16, 128, 128, "cpu (dry run)"
    else:
        model, device_gb, mixed, start, max_seq = dict(LLAMA_8B), device_memory_gb(), True, a.start, a.max_seq
        name = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
                              capture_output=True, text=True).stdout.strip()
    full_layers = model["num_hidden_layers"]
    layers = auto_layers(model, device_gb) if a.layers == "auto" else int(a.layers)
    model["num_hidden_layers"] = layers
    per_layer, _ = params(model)
    missing_gb = (full_layers - layers) * per_layer * BYTES_PER_PARAM / 2**30
    t0, points, seq = time.time(), [], start

    def result():
        return dict(machine=dict(device=name, device_gb=device_gb), model=model, layers_run=layers,
                    layers_full=full_layers, missing_weights_gb=missing_gb, mixed_precision_bf16=mixed,
                    points=points, fit=fit(points, device_gb, missing_gb),
                    longest_measured=max((p["seq"] for p in points if p["ok"]), default=None))

    def save():  # after every point: a run cut by its timeout keeps what it measured
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(result(), fh, indent=1)

    save()
    while seq <= max_seq:
        left = a.budget_s - (time.time() - t0)
        if left < 10:
            print(f"budget {a.budget_s}s spent: lengths from {seq} not run", flush=True)
            break
        p = run_point(model, seq, a.steps, left, mixed)
        points.append(p)
        save()
        print(json.dumps({k: v for k, v in p.items() if k != "error"}), flush=True)
        if not p["ok"]:
            print(p["error"][-600:], flush=True)
            break
        seq *= 2
    save()
    res = result()
    print(f"wrote {a.out}: longest measured {res['longest_measured']}, fit {res['fit']}")
    return res


if __name__ == "__main__":
    main()
