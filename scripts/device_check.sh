#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (no CI runs there; see docs/performance.md, "CUDA").
# Builds hyper_parallel against that machine's own torch (nothing can be downloaded there), runs
# tests/ops (the CUDA route parity tests are among those CI skips), the attention route benchmark
# (benchmarks/attention_routes.py: every route per visible score vs SDPA flash / cuDNN, S_local
# 16k-128k) and the long-context trainer sweep (benchmarks/long_context_cuda.py: 8B-shaped Llama,
# bf16, tiled loss + MLP, activation checkpointing + offload, doubling lengths until OOM or budget),
# then writes device_check.json and the table into docs/performance.md (the section between the
# device_check markers). Everything lands in $OUT (the device tool's output folder;
# /tmp/hp_device_out elsewhere), the edited docs/performance.md included.
#   device run:  bash scripts/device_check.sh          (at most ~8 minutes: build (~1.5 min), tests
#                100 s, routes 130 s, trainer sweep 160 s, each under its own timeout; timeout_s 540)
#   CPU dry run: bash scripts/device_check.sh --dry-run (tiny sizes and model; docs untouched,
#                the edited copy goes to $OUT; tests/ops/test_device_script.py runs it)
set -uo pipefail
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-/tmp/hp_device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ $DRY = 0 ]; then
  # The image's default /opt/gcc/bin/g++ links libstdc++ statically (setup.py refuses that build:
  # C++ errors would crash instead of raising); the system g++ links it like torch does.
  if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
  $py -m pip install -q --no-build-isolation --no-deps --no-index -e . >"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
  $py - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, hyper_parallel
from hyper_parallel.ops import engine_info
from hyper_parallel.ops.cuda_routes import flash_attn_installed
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(),
      "flash_attn", flash_attn_installed())
print(engine_info())
PY
  timeout 100 $py -m pytest -q tests/ops -rs -x 2>&1 | tee "$OUT/tests_ops.log" | tail -8
  ROUTE_ARGS=(--budget-s 90)
  LONG_ARGS=(--budget-s 140)
  DOC_OUT=docs/performance.md
else
  ROUTE_ARGS=(--dry-run)
  LONG_ARGS=(--dry-run)
  DOC_OUT="$OUT/performance.md"
fi
timeout 130 $py benchmarks/attention_routes.py "${ROUTE_ARGS[@]}" --out "$OUT/attention_routes.json" \
  2>&1 | grep -v -i warn | tee "$OUT/bench_routes.log" | tail -30
timeout 160 $py benchmarks/long_context_cuda.py "${LONG_ARGS[@]}" --out "$OUT/long_context.json" \
  2>&1 | tee "$OUT/long_context.log" | tail -12
LONG=()
[ -f "$OUT/long_context.json" ] && LONG=(--long "$OUT/long_context.json")
$py benchmarks/device_report.py --routes "$OUT/attention_routes.json" "${LONG[@]}" \
  --doc docs/performance.md --doc-out "$DOC_OUT" --json-out "$OUT/device_check.json" >"$OUT/report.md" \
  || { echo "device_report failed"; exit 1; }
[ $DRY = 0 ] && cp docs/performance.md "$OUT/performance.md"
echo "device_check done: $OUT/device_check.json, $OUT/performance.md"
