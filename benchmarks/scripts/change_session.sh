#!/usr/bin/env bash
# One device call for a kernel change: the GPU suite and memcheck, racecheck of fused-layer tests and
# of every GEMM path, then the layer A/B against the previous bundle (BASE, default
# generated/moe-models-base) on identical operands (MODELS, MS, ROUNDS).
# Carry generated/{tiny,probes,tiny-gemm,tiny-fused,tiny-modelopt,moe-models} and $BASE. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BASE=${BASE:-generated/moe-models-base}
export PYTHONUNBUFFERED=1
bash benchmarks/scripts/serving_session.sh tests 2>&1 | grep -vE "^  (fused|gemm|modelopt|route|topk|act)" | tail -12
timeout 150 compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
  -m gpu tests/gpu/test_moe_fused_gpu.py -k "fused_layer_matches_reference and (silu-bf16 or relu2)" > "$OUT/racecheck_fused.log" 2>&1
echo "racecheck fused rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed|failed" "$OUT/racecheck_fused.log" | tail -3
timeout 150 compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 python3 -m benchmarks.sanitize_gemm \
  > "$OUT/racecheck_gemm.log" 2>&1
echo "racecheck gemm rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY" "$OUT/racecheck_gemm.log" | tail -2
timeout ${AB_TIMEOUT:-260} python3 -m benchmarks.compare_layer --base "$BASE" --new generated/moe-models \
  --models ${MODELS:-qwen3-30b-a3b,gpt-oss-120b,glm-4.5-air,mixtral-8x7b,nemotron-3-nano} --m ${MS:-1,8,64,256,1024,4096} \
  --rounds ${ROUNDS:-3} --json "$OUT/ab.json" > "$OUT/ab.txt" 2>&1
echo "compare_layer rc=$?"; tail -45 "$OUT/ab.txt"
