# One device call: the 8-row-block GEMM variants of benchmarks.tune_gemm (M = 1, 8, 64).
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 400 python3 -m benchmarks.tune_gemm run --small-only --json $OUT/tune.json 2>&1 | grep -v skipped
