#!/usr/bin/env bash
# Device calls for shapes no measured table holds (specs/bench-unseen.yaml; planning.BORROW). Carry
# generated/unseen (both bundles: `build_variant.py specs/bench-unseen.yaml generated/unseen/rule
# planning.BORROW=False`, then `... generated/unseen/borrow`) and, for `peers`, .whl.
#   bash benchmarks/scripts/unseen.sh ab      # borrowed plans against the rule's, one process, identical operands,
#                                             # then the borrowed bundle against the float32 reference where plans differ
#   bash benchmarks/scripts/unseen.sh peers   # the borrowed bundle against humming and torch bf16 (peers.sh)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
RULE=generated/unseen/rule/bench-unseen
BORROW=generated/unseen/borrow/bench-unseen
MODELS=olmoe-1b-7b,qwen2-57b-a14b,phi-3.5-moe,deepseek-v3-tp8,deepseek-v2-lite
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
case "${1:-ab}" in
ab)
  timeout 330 python3 -m benchmarks.compare_layer --base "$RULE" --new borrow="$BORROW" \
    --m "${AB_M:-1,3,4,8,16,32,48,64,128,512,768,1024,2048,4096,8192,16384}" --rounds 3 --check \
    --json "$OUT/ab-unseen.json" > "$OUT/ab-unseen.txt" 2>&1; echo "compare_layer rc=$?"
  tail -n 100 "$OUT/ab-unseen.txt"
  timeout 200 python3 -m benchmarks.check_layer "$BORROW" "$MODELS" "${CHECK_M:-3,16,48,128,768,1024,4096,12000}" \
    > "$OUT/check-unseen.txt" 2>&1; echo "check_layer rc=$?"
  grep -E "rel err" "$OUT/check-unseen.txt" | awk '{e=$(NF-2); f=$NF; if (e+0 > w) w = e+0; if (f != "True") bad++} END {print "check_layer: worst rel err", w, "non-finite outputs", bad+0, "lines", NR}'
  grep -vE "rel err [0-9.e-]+ finite True" "$OUT/check-unseen.txt" | head -20
  ;;
peers)
  PEERS_TIMEOUT=${PEERS_TIMEOUT:-500} bash benchmarks/scripts/peers.sh --bundle "$BORROW" --models "$MODELS" \
    --m "${PEERS_M:-1,8,64,256,1024,4096}"
  ;;
esac
