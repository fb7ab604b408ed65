#!/usr/bin/env bash
# One device call of the serving-hardening work (issues 13, 17, 18). Usage on the GPU machine:
#   bash benchmarks/scripts/serving_session.sh tests        # every GPU test + memcheck of the bad-id paths
#   bash benchmarks/scripts/serving_session.sh bench        # layer benchmarks: moe, large-M study, decoder example
#   bash benchmarks/scripts/serving_session.sh peers        # benchmarks/scripts/peers.sh (carry .whl)
# Carry generated/ (tiny, probes, tiny-gemm, tiny-fused, moe-models, bench-large-m). Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
case "${1:-tests}" in
tests)
  export CUTEAOT_RESULTS="$OUT/gpu_results.jsonl"
  timeout 430 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=150 tests ${2:+-k "$2"} \
    > "$OUT/gpu_tests.log" 2>&1; echo "pytest rc=$?"
  grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -30
  sed -n '/worst relative error/,/^=/p' "$OUT/gpu_tests.log" | head -60
  timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_bad_ids_gpu.py -k "decode_path or packed_path or gemm_drops" > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
  ;;
bench)
  timeout 200 python3 -m benchmarks.moe --bundle generated/moe-models --json "$OUT/moe.json" > "$OUT/moe.txt" 2>&1
  echo "moe rc=$?"; cat "$OUT/moe.txt"
  timeout 240 python3 -m benchmarks.large_m --json "$OUT/large_m.json" > "$OUT/large_m.txt" 2>&1
  echo "large_m rc=$?"; cat "$OUT/large_m.txt"
  timeout 140 python3 -m examples.moe_decoder --bundle generated/moe-models --layers 4 --reps 30 \
    --json "$OUT/moe_decoder.json" > "$OUT/moe_decoder.txt" 2>&1
  echo "moe_decoder rc=$?"; tail -25 "$OUT/moe_decoder.txt"
  ;;
peers)
  shift
  bash benchmarks/scripts/peers.sh "$@"
  ;;
esac
