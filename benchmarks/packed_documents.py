"""CP=1 against CP=2 on the main job's packed documents under each declared ``data.packed_documents``.

For each example (``examples/cp/qwen3_next_cp2.yaml``, ``examples/cp/llama4_text_cp2.yaml``: models
whose result depends on what a packed row means) the data is switched to the main job's
(``examples/train_long_cp2.yaml``: the Python standard library's source files, the shipped BPE,
rows of 8192 tokens, documents + EOS packed), fp32, and ``hyper-train`` runs 3 steps at cp_size 1
and 2 under ``independent`` and under ``as_transformers``. Prints a table and writes
``benchmarks/results/packed_documents.json`` (losses per step, relative errors, the CPU).

    python scripts/build_example_data.py && python benchmarks/packed_documents.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import cpu_name  # noqa: E402

EXAMPLES = ["qwen3_next_cp2.yaml", "llama4_text_cp2.yaml"]
DATA = ["data.source=files", "data.files=[examples/data/stdlib/stdlib_docs.jsonl]", "data.text_field=text",
        "data.tokenizer=examples/data/stdlib_tokenizer", "data.packing=true", "data.seq_len=8192",
        "data.micro_batch_size=1", "data.seed=0", "data.path=null", "model.config.vocab_size=4096",
        "model.config.max_position_embeddings=8192", "schedule.steps=3", "schedule.warmup_steps=1",
        "logging.progress=false", "logging.plot=false"]


def run(example: str, semantics: str, cp: int, out: str) -> list:
    cmd = ["hyper-train", os.path.join("examples", "cp", example), *DATA, f"data.packed_documents={semantics}",
           f"accelerator.cp_size={cp}", f"logging.out_dir={out}"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    with open(os.path.join(out, "train_log.json")) as fh:
        return [s["loss"] for s in json.load(fh)["steps"]]


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for example in EXAMPLES:
            for semantics in ("independent", "as_transformers"):
                t0 = time.perf_counter()
                losses = {cp: run(example, semantics, cp, os.path.join(tmp, f"{example}_{semantics}_{cp}"))
                          for cp in (1, 2)}
                rel = [abs(a - b) / abs(a) for a, b in zip(losses[1], losses[2])]
                rows.append({"example": example, "packed_documents": semantics, "cp1": losses[1], "cp2": losses[2],
                             "max_rel_err": max(rel), "seconds": round(time.perf_counter() - t0, 1)})
                print(f"{example:24s} {semantics:16s} cp1 {losses[1]} cp2 {losses[2]} max rel {max(rel):.2e}",
                      flush=True)
    for example in EXAMPLES:
        a, b = (next(r for r in rows if r["example"] == example and r["packed_documents"] == s)["cp1"]
                for s in ("independent", "as_transformers"))
        gap = max(abs(x - y) / abs(x) for x, y in zip(a, b))
        print(f"{example}: the two meanings differ by {gap:.2e} relative (CP=1)")
        for r in rows:
            if r["example"] == example:
                r["meanings_gap_rel"] = gap
    out = {"cpu": cpu_name(), "rows_tokens": 8192, "steps": 3, "dtype": "float32", "results": rows}
    path = os.path.join(ROOT, "benchmarks", "results", "packed_documents.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
