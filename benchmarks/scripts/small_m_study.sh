# One device call: the stream probe, the A/B method's noise floor (the GEMM bundle against
# itself), the GPU tests, and Nsight on a long 8-row-block GEMM (steady state).
# Carry generated/{stream-probe,bench-gemm,probes,tiny,tiny-gemm,tiny-fused,moe-models}.
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 60 python3 -m benchmarks.stream_probe run; echo "stream_probe rc=$?"
timeout 120 python3 -m benchmarks.compare_gemm --base generated/bench-gemm --new generated/bench-gemm \
  --m 8 64 --json $OUT/noise.json; echo "compare rc=$?"
export CUTEAOT_RESULTS=$OUT/results.jsonl
timeout 330 python3 -m pytest -q -m gpu --timeout=120 -p no:cacheprovider tests \
  --ignore=tests/gpu/test_parallel_gpu.py > $OUT/pytest.txt 2>&1; echo "pytest rc=$?"
tail -3 $OUT/pytest.txt; grep -E "FAILED|Error" $OUT/pytest.txt | head -20
CASES="--case gpt-oss-120b:fc1:64" bash benchmarks/scripts/profile_small_m.sh | tail -12
cat $OUT/results.jsonl 2>/dev/null | head -30
