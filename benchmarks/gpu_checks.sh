#!/usr/bin/env bash
# Every GPU-only check of the repository in one device call: the GPU-marked tests, then the short
# benchmarks whose numbers docs/benchmarks.md and docs/reliability.md quote. Writes logs and JSON under
# $OUT (default: ./gpu-out). Each step has its own time limit so one hang does not take the rest.
#   bash benchmarks/gpu_checks.sh            # about 8 minutes on one H200
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
run() {  # run NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?" >> "$OUT/$name.log"
  tail -n 6 "$OUT/$name.log"
}
run gpu-tests 240 python -m pytest -q -s -p no:cacheprovider tests/test_gpu.py
run soak 240 python benchmarks/soak.py --out "$OUT/soak.json"
run bubble 150 python benchmarks/bubble_check.py --out "$OUT/bubble.json"
