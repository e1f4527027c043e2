#!/usr/bin/env bash
# Install, then run the main job: long-context training on packed documents with CP=2 on 2 CPU
# ranks (see README / docs/quickstart.md).
#   1. the documents: the Python standard library's own source files -> examples/data/stdlib/*.jsonl
#      (scripts/build_example_data.py; the BPE tokenizer is shipped in examples/data/stdlib_tokenizer)
#   2. a small Llama (the tokenizer's 4096-token vocabulary) trains on rows of 8192 tokens (documents
#      + EOS packed, boundaries kept), Head-Tail CP over 2 ranks, held-out eval every 10 steps
#   3. prints where every artifact is: JSON log, loss curve (train + eval), checkpoint, HF export
# Extra arguments are config overrides, e.g.  scripts/main.sh schedule.steps=10
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -c constraints.txt torch==2.13.0
python -m pip install -q -c constraints.txt --no-build-isolation -e .
export OMP_NUM_THREADS=1
CONFIG=examples/train_long_cp2.yaml
python scripts/build_example_data.py
start=$(date +%s)
if command -v hyper-train >/dev/null 2>&1; then
    torchrun --nproc-per-node 2 --no-python hyper-train "$CONFIG" "$@"
else
    torchrun --nproc-per-node 2 -m hyper_parallel.trainer.cli "$CONFIG" "$@"
fi
echo "training took $(( $(date +%s) - start )) s"
python - "$CONFIG" "$@" <<'PY'
import json, sys
from pathlib import Path
from hyper_parallel.trainer.config import TrainerConfig
cfg = TrainerConfig.from_yaml(sys.argv[1], sys.argv[2:])
out = Path(cfg.logging.out_dir)
log = json.loads((out / cfg.logging.json_log).read_text())
steps = log["steps"]
last = steps[-1]
evals = [r for r in steps if r.get("eval_loss") is not None]
print(f"\nmain job: {len(steps)} steps of {cfg.data.seq_len} tokens per row, cp_size={cfg.accelerator.cp_size}; "
      f"loss {steps[0]['loss']:.3f} -> {last['loss']:.3f}"
      + (f", held-out loss {evals[-1]['eval_loss']:.3f} (ppl {evals[-1]['eval_ppl']:.1f})" if evals else ""))
print(f"peak memory per rank (GB): {last['peak_mem_gb_per_rank']}; "
      f"mean tokens/s {sum(r['tokens_per_s'] for r in steps) / len(steps):,.0f}")
print("artifacts:")
print(f"  JSON log        {(out / cfg.logging.json_log).resolve()}")
print(f"  step stream     {(out / cfg.logging.json_log).with_suffix('.jsonl').resolve()}")
if cfg.logging.plot:
    print(f"  loss curve      {(out / cfg.logging.plot_file).resolve()}")
ckpt = Path(cfg.schedule.checkpoint_dir or out / "checkpoints")
done = sorted(ckpt.glob("step_*[0-9]")) if ckpt.is_dir() else []
if done:
    print(f"  checkpoint      {done[-1].resolve()}")
if cfg.logging.export_hf and (out / "hf").is_dir():
    print(f"  HF export       {(out / 'hf').resolve()}  (AutoModelForCausalLM / AutoTokenizer.from_pretrained)")
PY
