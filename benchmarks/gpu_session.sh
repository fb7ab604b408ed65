#!/usr/bin/env bash
# One device call: install the pure-Python package, run every GPU test and the
# launch benchmark, leave logs under $OUT.  Usage (on the GPU machine):
#   bash benchmarks/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/.pth:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -m gpu -p no:cacheprovider -q -s --timeout=300 tests 2>&1 | tee "$OUT/gpu_tests.log"
python3 -m benchmarks.launch_overhead --json "$OUT/launch_overhead.json" 2>&1 | tee "$OUT/bench.log"
