#!/usr/bin/env bash
# Does the wgmma loop's proxy fence cost the layer its copy pipeline (issue 13)?  Two measurements, one device
# call: the stream probe (benchmarks/stream_probe.py: 16-byte cp.async streaming with and without
# `fence.proxy.async` after each wait) and the layer A/B of the peer bundle against the same bundle whose 128-row
# wgmma kernels leave the fence out (ablate part `fence`; their outputs are still checked against the float32
# reference, since leaving the fence out is a race the tensor cores may or may not lose).
#
#   bash benchmarks/scripts/fence_ab.sh build   # builder (CuTeDSL, ~30 min on two cores without a built bundle):
#                                               #   generated/moe-models, generated/nofence-patch, generated/stream-probe
#   bash benchmarks/scripts/fence_ab.sh run     # GPU, carrying those three: raw output and JSON under $OUT
#
# MODELS / MS / ROUNDS choose the A/B's points (default: Qwen3-30B and gpt-oss-120b at 2048 and 4096 tokens).
# Read new / base: about 1.00 means the fence costs nothing and the hypothesis is closed; a few percent under 1
# is what a fence-free stage fill (bulk copies on an mbarrier for FC2's activations) could win.
set -euo pipefail
case "${1:-}" in
build)
  [ -f generated/moe-models/manifest.json ] || python3 -m cuteaot.codegen.cli build specs/moe-models.yaml --targets h200 -j 2
  rm -rf generated/nofence generated/nofence-patch
  python3 benchmarks/scripts/set_ablate.py fence -- python3 benchmarks/scripts/splice_kernels.py generated/moe-models \
    generated/nofence --where mainloop="'wgmma'" moe_block_size=128 --patch generated/nofence-patch -j 2
  rm -rf generated/nofence  # the patch (manifest + changed cubins) is what travels
  python3 -m benchmarks.stream_probe build --out generated/stream-probe
  ;;
run)
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1 PYTHONPATH=.
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  timeout 90 python3 -m benchmarks.stream_probe run --dir generated/stream-probe > "$OUT/probe.txt" 2>&1 \
    || echo "stream_probe rc=$?"
  cat "$OUT/probe.txt"
  rm -rf /tmp/nofence && cp -r generated/moe-models /tmp/nofence && cp -r generated/nofence-patch/. /tmp/nofence/
  timeout "${AB_TIMEOUT:-300}" python3 -m benchmarks.compare_layer --base generated/moe-models --new nofence=/tmp/nofence \
    --models "${MODELS:-qwen3-30b-a3b,gpt-oss-120b}" --m "${MS:-2048,4096}" --rounds "${ROUNDS:-3}" --check \
    --json "$OUT/fence-ab.json" > "$OUT/fence-ab.txt" 2>&1 || echo "compare_layer rc=$?"
  grep "ref err" "$OUT/fence-ab.txt" || true
  sed -n '/^| model/,$p' "$OUT/fence-ab.txt"
  ;;
*) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
