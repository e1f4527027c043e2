#!/usr/bin/env bash
# Install, then run the main job: train a tiny Llama with CP=2 on 2 CPU ranks (see README).
#   prints the meshes and the resolved CP plan, a tqdm bar (loss, tokens/s), and writes
#   runs/tiny_cp2/train_log.json + runs/tiny_cp2/loss_curve.png
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -c constraints.txt torch==2.13.0
python -m pip install -q -c constraints.txt --no-build-isolation -e .
export OMP_NUM_THREADS=1
# `hyper-train` is the installed console script; the module form is the same entry point.
if command -v hyper-train >/dev/null 2>&1; then
    exec torchrun --nproc-per-node 2 --no-python hyper-train examples/train_cp2.yaml "$@"
fi
exec torchrun --nproc-per-node 2 -m hyper_parallel.trainer.cli examples/train_cp2.yaml "$@"
