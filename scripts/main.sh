#!/usr/bin/env bash
# Install, then run the main job: long-context training on packed documents with CP=2 on 2 CPU
# ranks (see README / docs/quickstart.md).
#   1. the documents: the Python standard library's own source files -> examples/data/stdlib/*.jsonl
#      (scripts/build_example_data.py; the BPE tokenizer is shipped in examples/data/stdlib_tokenizer)
#   2. a small Llama (the tokenizer's 4096-token vocabulary) trains on rows of 8192 tokens (documents
#      + EOS packed, boundaries kept), CP over 2 ranks with the balanced split, held-out eval every 10 steps
#   3. hyper-train prints where every artifact is: JSON log, loss curve (train + eval), checkpoint, HF export
# Extra arguments are config overrides, e.g.  scripts/main.sh schedule.steps=10
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -c constraints.txt torch==2.13.0
python -m pip install -q -c constraints.txt --no-build-isolation -e .
export OMP_NUM_THREADS=1
CONFIG=examples/train_long_cp2.yaml
python scripts/build_example_data.py
start=$(date +%s)
# hyper-train checks the whole config here, then starts the 2 ranks itself (torch's elastic launch);
# rank 0 ends by printing the losses and where every artifact is (JSON log, loss curve, checkpoint, HF export)
hyper-train "$CONFIG" "$@"
echo "training took $(( $(date +%s) - start )) s"
