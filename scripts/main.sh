#!/usr/bin/env bash
# Install and run the main job: 2 CPU ranks, CP=2 (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -c constraints.txt torch==2.13.0
python -m pip install -q -c constraints.txt --no-build-isolation -e .
torchrun --nproc-per-node 2 -m hyper_parallel.demo examples/demo_plan_cp2.yaml
