# One device call: GPU tests, GEMM + fused-layer benchmarks, a short Nsight look at M = 64.
# Needs the bundles probes, tiny, tiny-gemm, tiny-fused, moe-models, bench-gemm, bench-moe carried.
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
export CUTEAOT_RESULTS=$OUT/results.jsonl
timeout 330 python3 -m pytest -q -m gpu --timeout=120 -p no:cacheprovider tests \
  --ignore=tests/gpu/test_parallel_gpu.py > $OUT/pytest.txt 2>&1; echo "pytest rc=$?"
tail -4 $OUT/pytest.txt; grep -E "FAILED|Error" $OUT/pytest.txt | head -20
timeout 200 python3 -m benchmarks.gemm --json $OUT/gemm.json > $OUT/gemm.txt 2>&1; echo "gemm rc=$?"
timeout 60 python3 -m benchmarks.moe --json $OUT/moe.json > $OUT/moe.txt 2>&1; echo "moe rc=$?"
timeout 90 ncu --clock-control none -k regex:W4A16 --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  python3 -m benchmarks.profile_gemm --case qwen3-30b-a3b:fc1:64 > $OUT/ncu.txt 2>&1; echo "ncu rc=$?"
grep -E "Duration|DRAM Throughput|Issued Warp|No Eligible|Stall" $OUT/ncu.txt | head -20
cat $OUT/results.jsonl 2>/dev/null | head -40
cat $OUT/gemm.txt; tail -25 $OUT/moe.txt
