#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (no CI runs there; see docs/performance.md, "CUDA").
# Builds hyper_parallel against that machine's own torch (nothing can be downloaded there), runs
# the engine tests (the CUDA parity tests are the ones CI skips) and the CUDA benchmark.
# Everything lands in $OUT (the device tool's output folder; /tmp/hp_device_out elsewhere).
#   device run:  bash scripts/device_check.sh        (timeout_s ~ 540 leaves time for a rerun)
set -uo pipefail
OUT=${OUT:-/tmp/hp_device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py=python3
# The image's default /opt/gcc/bin/g++ links libstdc++ statically (setup.py refuses that build:
# C++ errors would crash instead of raising); the system g++ links it like torch does.
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
$py -m pip install -q --no-build-isolation --no-deps --no-index -e . >"$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
$py - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, hyper_parallel
from hyper_parallel.ops import engine_info
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print(engine_info())
PY
timeout 200 $py -m pytest -q tests/ops -rs 2>&1 | tee "$OUT/tests_ops.log" | tail -8
timeout 300 $py benchmarks/attention_cuda.py --sizes 4096 16384 --out "$OUT/attention_cuda.json" \
  2>&1 | tee "$OUT/bench_cuda.log" | tail -16
