#!/usr/bin/env bash
# One device call of a planner-choice tuning (issues 13, 14): numerics of the "always" candidate bundle,
# then `benchmarks.tune_blocks measure` (rule vs always). Carry $B (from `python -m benchmarks.tune_blocks
# build specs/moe-models.yaml --knob $KNOB --targets h200 --out $B`). KNOB (tall | decode, default tall),
# B (default generated/tune), MS / ROUNDS override the defaults; COMMIT=<sha> records the source the bundles
# were built from. Rows under $OUT/tune-$KNOB.json.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
KNOB=${KNOB:-tall}
B=${B:-generated/tune}
CUTEAOT_MODELS_BUNDLE=$B/always/moe-models timeout ${TEST_TIMEOUT:-150} python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/gpu/test_moe_models_gpu.py -k "model_layer" > "$OUT/test_always.log" 2>&1
echo "always tests rc=$?: $(grep -E 'passed|failed' "$OUT/test_always.log" | tail -1)"
grep -E "^(FAILED|E  )" "$OUT/test_always.log" | head -5
timeout ${TUNE_TIMEOUT:-360} python3 -m benchmarks.tune_blocks measure --knob $KNOB --rule $B/rule/moe-models \
  --always $B/always/moe-models --m "${MS:-256,384,512,768,1024,1536,2048,3072}" --rounds ${ROUNDS:-3} \
  --json "$OUT/tune-$KNOB.json" > "$OUT/tune.txt" 2>&1
echo "measure rc=$?"; sed -n '/^| model/,$p' "$OUT/tune.txt"; tail -2 "$OUT/tune.txt"
