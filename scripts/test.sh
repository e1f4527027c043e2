#!/usr/bin/env bash
# Install (CPU torch pinned through constraints.txt, C++ engine built in place) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -c constraints.txt torch==2.13.0
python -m pip install -q -c constraints.txt --no-build-isolation -e '.[test,hf]'
# Timeouts catch hangs, not slowness: every test timeout is multiplied by this (see
# hyper_parallel/testing/multirank.py), so a busy 2-core machine makes the suite slower, not red.
export HYPER_PARALLEL_TEST_TIMEOUT_SCALE="${HYPER_PARALLEL_TEST_TIMEOUT_SCALE:-4}"
python -m pytest -q --durations=30 "$@"
