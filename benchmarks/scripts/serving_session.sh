#!/usr/bin/env bash
# One device call of the serving-hardening work (issues 13, 17, 18). Usage on the GPU machine:
#   bash benchmarks/scripts/serving_session.sh tests        # every GPU test + memcheck of the bad-id paths
#   bash benchmarks/scripts/serving_session.sh layers       # the layer test files alone (bundles tiny, probes, tiny-gemm,
#                                                           # tiny-fused, tiny-modelopt, tune-micro: ~57 MiB with the tree, where
#                                                           # `tests` with every bundle is over the 64 MiB a call carries),
#                                                           # then racecheck of the fused tests 17-36 in the time left
#   bash benchmarks/scripts/serving_session.sh bench        # layer benchmarks: moe, large-M study, decoder example
#   bash benchmarks/scripts/serving_session.sh peers        # benchmarks/scripts/peers.sh (carry .whl)
#   bash benchmarks/scripts/serving_session.sh tails        # memcheck of the masked N / K tiles (tiny-gemm, tiny-fused)
#   bash benchmarks/scripts/serving_session.sh race         # racecheck of two fused-layer tests (decode, packed, wgmma
#                                                           # plans; tiny-fused) and of every GEMM path (tiny-gemm)
#   bash benchmarks/scripts/serving_session.sh nf3          # NF3 vs NVFP4 (bench-nf3), memcheck of the NF3
#                                                           # layer, host cost of a layer call (moe-models)
#   bash benchmarks/scripts/serving_session.sh modelopt     # NVFP4 read as stored: its GPU tests and probes
#                                                           # (tiny-modelopt, probes), memcheck of three layer
#                                                           # tests (two with masked N tiles), modelopt vs packed
#                                                           # (bench-modelopt), racecheck of a masked one
#   OLD_RUNTIME=ab-old/runtime bash benchmarks/scripts/serving_session.sh host
#                                                           # host cost of a layer call (moe-models), this runtime
#                                                           # against an older copy of runtime/ (e.g. `git archive
#                                                           # <rev> runtime | tar -x -C ab-old`), interleaved twice
# Carry generated/ (tiny, probes, tiny-gemm, tiny-fused, tiny-modelopt, moe-models, bench-*). Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || cat "$OUT/pip.log"
# a pytest log's last counts, its failures (and lines matching the extra pattern $2, e.g. "|mismatch") and the
# worst relative errors the tests recorded
report_tests() {
  grep -E "passed|failed" "$1" | tail -2
  grep -E "^(FAILED|ERROR)${2:-}" "$1" | head -30
  sed -n '/worst relative error/,/^=/p' "$1" | head -60
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
case "${1:-tests}" in
tests)
  export CUTEAOT_RESULTS="$OUT/gpu_results.jsonl"
  timeout 430 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=150 tests ${2:+-k "$2"} \
    > "$OUT/gpu_tests.log" 2>&1; echo "pytest rc=$?"
  report_tests "$OUT/gpu_tests.log"
  timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_bad_ids_gpu.py -k "decode_path or packed_path or gemm_drops" > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
  ;;
layers)
  # END: seconds of the call this mode may take (the racecheck gets what the tests leave, one test at a time)
  export CUTEAOT_RESULTS="$OUT/gpu_results.jsonl"; T=tests/gpu; F=$T/test_moe_fused_gpu.py
  timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=100 $T/test_bad_ids_gpu.py $T/test_capture_gpu.py \
    $T/test_checkpoint_gpu.py $T/test_concurrent_gpu.py $T/test_example_gpu.py $T/test_modelopt_gpu.py $F \
    $T/test_moe_workspace_gpu.py $T/test_moe_micro_gpu.py > "$OUT/gpu_tests.log" 2>&1; echo "pytest rc=$?"
  report_tests "$OUT/gpu_tests.log"
  # fused tests 17-36 (1-16: `race_tests.sh` over the file's first 16; all 36 were clean by the forty-third session),
  # one kernel family after another; the first takes ~180 s under racecheck on an H100, the others 5-85 s
  PER_TEST=200 BUDGET=$((${END:-570} - SECONDS)) bash benchmarks/scripts/race_tests.sh \
    "$F::test_gated_fc1_epilogue[silu-bf16]" "$F::test_fused_kernel_activates_in_fc1[silu-bf16]" \
    "$F::test_mxfp4_checkpoint_layer" "$F::test_nf3_layer_matches_reference[silu]" \
    "$F::test_biases_in_both_epilogues[swigluoai]" "$F::test_fc2_reads_fc1_wide_packing_as_narrow_blocks" \
    "$F::test_nvfp4_nf3_hybrid_layer" "$F::test_bias_of_one_projection_only" "$F::test_in_kernel_route_packing" \
    "$F::test_torch_compile" "$F::test_fused_kernel_activates_in_fc1[swigluoai-whole-bias]" \
    "$F::test_gated_fc1_epilogue[swigluoai-whole-bias]" "$F::test_biases_in_both_epilogues[relu2-bias-fp16]" \
    "$F::test_nf3_layer_matches_reference[relu2]" "$F::test_nf3_layer_matches_reference[swigluoai]" \
    "$F::test_nf3_graph_replay_equals_eager" "$F::test_gated_fc1_epilogue[silu-fp16]" \
    "$F::test_fused_kernel_activates_in_fc1[silu-fp16]" "$F::test_bias_layer_needs_bias_kernels" \
    "$F::test_nf3_layer_refuses_mixed_formats"
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
nf3)
  timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=60 tests/gpu/test_intrinsics_gpu.py -k nf3 2>&1 | tail -3
  timeout 240 python3 -m benchmarks.nf3 --bundle generated/bench-nf3 --json "$OUT/nf3.json" > "$OUT/nf3.txt" 2>&1
  echo "nf3 rc=$?"; tail -12 "$OUT/nf3.txt"
  timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider -m gpu tests/gpu/test_moe_fused_gpu.py -k "nf3_layer_matches and silu" > "$OUT/memcheck_nf3.log" 2>&1
  echo "memcheck nf3 rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_nf3.log" | tail -3
  timeout 120 python3 -m benchmarks.layer_overhead --bundle generated/moe-models --json "$OUT/layer_overhead.json"
  echo "layer_overhead rc=$?"
  ;;
modelopt)
  export CUTEAOT_RESULTS="$OUT/gpu_results.jsonl"
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=100 tests/gpu/test_modelopt_gpu.py \
    tests/gpu/test_intrinsics_gpu.py -k "modelopt or e2m1_codes or e4m3_pair" > "$OUT/modelopt_tests.log" 2>&1
  echo "pytest rc=$?"; report_tests "$OUT/modelopt_tests.log" "|probe e|mismatch"
  # memcheck of the layer tests whose sizes are 64 mod 128 (a last N tile masked) and one on whole tiles
  timeout 170 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider -m gpu tests/gpu/test_modelopt_gpu.py -k "matches_reference and (silu-fp16 or tail)" \
    > "$OUT/memcheck_modelopt.log" 2>&1
  echo "memcheck modelopt rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_modelopt.log" | tail -3
  [ -d generated/bench-modelopt ] && { timeout 200 python3 -m benchmarks.modelopt --bundle generated/bench-modelopt \
    --rounds 3 --json "$OUT/modelopt.json" > "$OUT/modelopt.txt" 2>&1; echo "modelopt bench rc=$?"; tail -22 "$OUT/modelopt.txt"; }
  BUDGET=100 bash benchmarks/scripts/race_tests.sh \
    "tests/gpu/test_modelopt_gpu.py::test_modelopt_layer_matches_reference[relu2-tail-gate_up]"
  ;;
peers)
  shift
  bash benchmarks/scripts/peers.sh "$@"
  ;;
tails)
  # masked tiles (N or K = 64 mod 128): memcheck of the GEMM cases past N and K (tiny-gemm) and of the fused
  # layer whose both sizes end in part tiles (tiny-fused relu2: decode, packed, wgmma)
  timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m benchmarks.sanitize_gemm \
    > "$OUT/memcheck_tails_gemm.log" 2>&1
  echo "memcheck tails gemm rc=$?"; grep -E "ERROR SUMMARY" "$OUT/memcheck_tails_gemm.log" | tail -1
  timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider -m gpu tests/gpu/test_moe_fused_gpu.py -k "matches_reference and relu2" \
    > "$OUT/memcheck_tails_fused.log" 2>&1
  echo "memcheck tails fused rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck_tails_fused.log" | tail -3
  ;;
host)
  for round in 1 2; do
    for side in old new; do
      root=/tmp/runtime-$side
      mkdir -p $root/cuteaot
      ln -sfn "$PWD/$([ $side = old ] && echo "${OLD_RUNTIME:?a copy of an older runtime/}" || echo runtime)" $root/cuteaot/runtime
      ln -sfn "$PWD/codegen" $root/cuteaot/codegen
      PYTHONPATH=$root:$PWD python3 -c "import cuteaot.runtime as r; print('$side runtime:', r.__file__)"
      PYTHONPATH=$root:$PWD timeout 100 python3 -m benchmarks.layer_overhead --bundle generated/moe-models \
        --json "$OUT/layer-overhead-$side-$round.json" $([ $side = new ] && echo "${STEPS:+--steps}")
    done
  done
  ;;
race)
  BUDGET=200 bash benchmarks/scripts/race_tests.sh "tests/gpu/test_moe_fused_gpu.py::test_fused_layer_matches_reference[silu-bf16]" \
    "tests/gpu/test_moe_fused_gpu.py::test_fused_layer_matches_reference[relu2]"
  timeout 200 compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 python3 -m benchmarks.sanitize_gemm \
    > "$OUT/racecheck_gemm.log" 2>&1
  echo "racecheck gemm rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY" "$OUT/racecheck_gemm.log" | tail -2
  ;;
esac
