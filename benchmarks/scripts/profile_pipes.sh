#!/usr/bin/env bash
# Nsight Compute: which execution pipe bounds the W4A16 kernels. Per kernel launch: duration, DRAM
# throughput, issue-slot use, and the share of peak of each pipe the decode loads (integer ALU, FMA and
# its heavy half, fp16, shared memory, tensor), plus the largest stall reasons. CASES takes
# benchmarks/profile_gemm.py arguments (`--layer problem:M`, `--case model:fc1|fc2:M`); BUNDLE the bundle.
#   CASES="--layer qwen3-30b-a3b:8 --layer gpt-oss-120b:1" BUNDLE=generated/moe-models bash benchmarks/scripts/profile_pipes.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
C="${CASES:---layer qwen3-30b-a3b:8 --layer qwen3-30b-a3b:64 --layer gpt-oss-120b:1}"
M="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active"
for p in alu fma fmaheavy fmalite fp16 lsu uniform tensor_op_hmma tensor_op_gmma cbu adu; do
  M="$M,sm__inst_executed_pipe_$p.avg.pct_of_peak_sustained_active"
done
for p in alu fma fmaheavy shared fp16; do
  M="$M,sm__pipe_${p}_cycles_active.avg.pct_of_peak_sustained_active"
done
for r in barrier long_scoreboard wait math_pipe_throttle short_scoreboard mio_throttle dispatch_stall selected not_selected; do
  M="$M,smsp__average_warp_latency_issue_stalled_$r.ratio"
done
timeout "${LIMIT:-300}" ncu --clock-control none -k regex:'W4A16' --metrics "$M" --csv --print-units base \
  python3 -m benchmarks.profile_gemm --bundle "${BUNDLE:-generated/moe-models}" $C > "$OUT/pipes.csv" 2> "$OUT/pipes.err"
echo "ncu rc=$?"; tail -3 "$OUT/pipes.err"
python3 - "$OUT/pipes.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
ix = {k: head.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Value")}
kern = {}
for r in rows:
    k = (int(r[ix["ID"]]), r[ix["Kernel Name"]][:40])
    kern.setdefault(k, {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]]
for (i, name), m in sorted(kern.items()):
    short = {k.replace("sm__inst_executed_pipe_", "inst_").replace("sm__pipe_", "pipe_")
              .replace(".avg.pct_of_peak_sustained_active", "%").replace("smsp__average_warp_latency_issue_stalled_", "stall_")
              .replace(".ratio", ""): v for k, v in m.items()}
    print(i, name, " ".join(f"{k}={v}" for k, v in sorted(short.items())))
PY
