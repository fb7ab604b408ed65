#!/usr/bin/env bash
# One device call: install the pure-Python package, run every GPU test and the
# benchmarks, leave logs under $OUT.  Usage (on the GPU machine, bundles carried
# in generated/: tiny, tiny-gemm, probes, tiny-fused, moe-models; optional: bench-gemm,
# tune-gemm, bench-moe):
#   bash benchmarks/gpu_session.sh [pytest -k expression]
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export CUTEAOT_RESULTS="$OUT/gpu_results.jsonl"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -m gpu -p no:cacheprovider -q -s --timeout=300 ${1:+-k "$1"} tests 2>&1 | tee "$OUT/gpu_tests.log"
if [ -d generated/bench-gemm ]; then
  timeout 420 python3 -m benchmarks.gemm --json "$OUT/gemm.json" 2>&1 | tee "$OUT/bench_gemm.log"
fi
if [ -d generated/bench-moe ]; then
  timeout 400 python3 -m benchmarks.moe --json "$OUT/moe.json" 2>&1 | tee "$OUT/bench_moe.log"
fi
if [ -d generated/moe-models ] && [ -n "${COLD_START:-}" ]; then
  timeout 300 python3 -m benchmarks.cold_start --json "$OUT/cold_start.json" 2>&1 | tee "$OUT/cold_start.log"
fi
if [ -d generated/parallel ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 timeout 400 python3 -m benchmarks.parallel \
    --json "$OUT/parallel.json" 2>&1 | tee "$OUT/bench_parallel.log"
fi
if [ -d generated/tune-gemm ]; then
  timeout 240 python3 -m benchmarks.tune_gemm run --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune_gemm.log"
fi
if [ -n "${LAUNCH_BENCH:-}" ]; then
  python3 -m benchmarks.launch_overhead --json "$OUT/launch_overhead.json" 2>&1 | tee "$OUT/bench.log"
fi
