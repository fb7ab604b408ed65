#!/usr/bin/env bash
# One device call of the large-M A/B (issue 13): numerics of each variant bundle through the model
# test, then benchmarks.compare_layer of every variant against the base on identical operands.
# Carry generated/ab (base/moe-models and one folder per variant). VARIANTS="v128 v64 ..." and
# TEST_VARIANTS (default: all), MS / MODELS / ROUNDS override the defaults. Logs and JSON under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
VARIANTS=${VARIANTS:-$(ls generated/ab | grep -v '^base$')}
for v in ${TEST_VARIANTS-$VARIANTS}; do
  CUTEAOT_MODELS_BUNDLE=generated/ab/$v/moe-models timeout ${TEST_TIMEOUT:-150} python3 -m pytest -m gpu -q \
    -p no:cacheprovider tests/gpu/test_moe_models_gpu.py -k "model_layer" > "$OUT/test_$v.log" 2>&1
  echo "$v tests rc=$?: $(grep -E 'passed|failed' "$OUT/test_$v.log" | tail -1)"
  grep -E "^(FAILED|E  )" "$OUT/test_$v.log" | head -5
done
NEWS=""; for v in $VARIANTS; do NEWS="$NEWS --new $v=generated/ab/$v/moe-models"; done
timeout ${AB_TIMEOUT:-400} python3 -m benchmarks.compare_layer --base generated/ab/base/moe-models $NEWS \
  --models "${MODELS:-qwen3-30b-a3b,gpt-oss-120b,glm-4.5-air,mixtral-8x7b,nemotron-3-nano,qwen3-235b-a22b-tp1}" \
  --m "${MS:-256,512,1024,2048,4096,16384}" --rounds ${ROUNDS:-5} --json "$OUT/ab.json" > "$OUT/ab.txt" 2>&1
echo "compare rc=$?"; sed -n '/^| model/,$p' "$OUT/ab.txt"; grep -E "Error|error" "$OUT/ab.txt" | head -5
