#!/usr/bin/env bash
# One device call: every GPU test, racecheck of the fused kernel's gated FC1 epilogue, then the fused
# layer A/B (benchmarks.compare_layer) of generated/moe-models-base against generated/moe-models.
# Carry generated/{tiny,probes,tiny-gemm,tiny-fused,tiny-modelopt,moe-models,moe-models-base}.
#   MODELS=qwen3-30b-a3b,... M=1,2,8 ROUNDS=5 bash benchmarks/scripts/ab_fused.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUTEAOT_RESULTS="$OUT/gpu_results.jsonl"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=150 tests > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -2
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
sed -n '/worst relative error/,/^=/p' "$OUT/gpu_tests.log" | grep -iE "gated|fused silu|modelopt silu|worst" | head -20
timeout 150 compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q \
  -p no:cacheprovider -m gpu tests/gpu/test_moe_fused_gpu.py -k "fused_kernel_activates_in_fc1 and silu-fp16" \
  > "$OUT/racecheck.log" 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck.log" | tail -3
timeout ${AB_TIMEOUT:-220} python3 -m benchmarks.compare_layer --base generated/moe-models-base --new generated/moe-models \
  --models "${MODELS:-qwen3-30b-a3b,gpt-oss-120b,glm-4.5-air,mixtral-8x7b,qwen3-235b-a22b-tp4,nemotron-3-nano}" \
  --m "${M:-1,2,4,8,64,256,512}" --rounds "${ROUNDS:-3}" --check --json "$OUT/ab.json" > "$OUT/ab.txt" 2>&1
echo "ab rc=$?"; tail -60 "$OUT/ab.txt"
