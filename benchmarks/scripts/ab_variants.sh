#!/usr/bin/env bash
# One device call of a layer A/B (issue 13): the model test on each candidate bundle, then
# benchmarks.compare_layer of every candidate against the base on identical operands (--check: each
# output's error against the float32 reference too).  Carry the bundles; name them as
#   BASE=generated/ab/base/moe-models NEW="gated=generated/moe-models w2=generated/ab/w2/moe-models"
# MODELS / MS / ROUNDS override the defaults. Logs and JSON under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
NEWS=""
for pair in $NEW; do
  label=${pair%%=*}; path=${pair#*=}; NEWS="$NEWS --new $pair"
  if [ -z "${SKIP_TESTS:-}" ]; then
    CUTEAOT_MODELS_BUNDLE=$path timeout ${TEST_TIMEOUT:-150} python3 -m pytest -m gpu -q -p no:cacheprovider \
      tests/gpu/test_moe_models_gpu.py -k "model_layer" > "$OUT/test_$label.log" 2>&1
    echo "$label tests rc=$?: $(grep -E 'passed|failed' "$OUT/test_$label.log" | tail -1)"
    grep -E "^(FAILED|E  )" "$OUT/test_$label.log" | head -5
  fi
done
timeout ${AB_TIMEOUT:-400} python3 -m benchmarks.compare_layer --base "$BASE" $NEWS --check \
  --models "${MODELS:-qwen3-30b-a3b,gpt-oss-120b,glm-4.5-air,mixtral-8x7b,nemotron-3-nano,qwen3-235b-a22b-tp1}" \
  --m "${MS:-512,1024,4096,16384}" --rounds ${ROUNDS:-3} --json "$OUT/ab.json" > "$OUT/ab.txt" 2>&1
echo "compare rc=$?"; sed -n '/^| model/,$p' "$OUT/ab.txt"; grep -iE "error|Traceback" "$OUT/ab.txt" | head -5
