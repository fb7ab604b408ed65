#!/usr/bin/env bash
# Nsight Compute's warp-state samples per SASS instruction of the fused kernel of layer calls, summarized by
# code region (benchmarks/stall_regions.py). LAYERS: problem:M of BUNDLE; one ncu run each, the second call.
#   LAYERS="qwen3-30b-a3b:8 qwen3-30b-a3b:64" BUNDLE=generated/moe-models bash benchmarks/scripts/profile_stalls.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=$(mktemp -d)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
for c in ${LAYERS:-qwen3-30b-a3b:8 qwen3-30b-a3b:64 qwen3-30b-a3b:1}; do
  n=${c//:/_}
  timeout "${LIMIT:-200}" ncu --clock-control none -k regex:"${KERNEL:-Fused}" --launch-skip 1 --launch-count 1 \
    --section SourceCounters --section WarpStateStats -o "$W/$n" -f \
    python3 -m benchmarks.profile_gemm --bundle "${BUNDLE:-generated/moe-models}" --layer "$c" > "$W/$n.log" 2>&1
  echo "$c: ncu rc=$?"; tail -1 "$W/$n.log"
  ncu -i "$W/$n.ncu-rep" --page source --print-source sass --csv > "$W/$n.csv" 2>/dev/null
  python3 -m benchmarks.stall_regions "$W/$n.csv" --json "$OUT/stalls-$n.json"
done
