#!/usr/bin/env bash
# What each part of the GEMM tiles costs in place (issues 13, 14): the layer's time with the stages' copies,
# their waits and barriers, the weight decode or the epilogue taken out of both main loops (mma.sync and wgmma;
# codegen/kernels/w4a16/ablate.py), against the same bundle as shipped, on identical operands.  Outputs are
# wrong with any part out: no --check.  The default points cover the decode regime (M = 1), the packed 8-row
# loop (8, 64) and the wgmma GEMMs (1024, 4096).
#
#   bash benchmarks/scripts/ablate_tile.sh build   # builder (CuTeDSL): generated/ablate/<parts>/bench-ablate
#   bash benchmarks/scripts/ablate_tile.sh run     # GPU, carrying generated/ablate: compare_layer, JSON under $OUT
#
# PARTS overrides the sets built and run ("+"-joined parts, "none" = as shipped); MS / MODELS / ROUNDS the points.
# `fence` (not in the default sets) takes out only the wgmma loop's proxy fence, keeping its waits and barriers:
# PARTS="none fence" times what that fence costs (benchmarks/scripts/fence_ab.sh: a quicker A/B of only the
# kernels it changes, spliced into the peer bundle).
set -euo pipefail
PARTS=${PARTS:-"none copy copy+sync decode epilogue copy+sync+decode copy+sync+decode+epilogue"}
case "${1:-}" in
build)
  for parts in $PARTS; do  # set_ablate.py: ABLATE = parts for the build, the shipped line back however it ends
    python3 benchmarks/scripts/set_ablate.py "$parts" -- \
      python3 -m cuteaot.codegen.cli build specs/bench-ablate.yaml --out "generated/ablate/$parts" --targets h200 -j 2
  done
  ;;
run)
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1 PYTHONPATH=.
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
  NEWS=""; for parts in $PARTS; do [ "$parts" = none ] || NEWS="$NEWS --new $parts=generated/ablate/$parts/bench-ablate"; done
  timeout "${AB_TIMEOUT:-400}" python3 -m benchmarks.compare_layer --base generated/ablate/none/bench-ablate $NEWS \
    --models "${MODELS:-qwen3-30b-a3b,gpt-oss-120b}" --m "${MS:-1,8,64,1024,4096}" --rounds "${ROUNDS:-5}" \
    --json "$OUT/ablate.json" > "$OUT/ablate.txt" 2>&1 || echo "compare_layer rc=$?"
  sed -n '/^| model/,$p' "$OUT/ablate.txt"
  ;;
*) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
