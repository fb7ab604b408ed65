#!/usr/bin/env bash
# Nsight Compute on the W4A16 kernels (the wgmma loop at large M): sections + tensor-pipe, L2,
# shared-memory and per-reason stall metrics. CASES (benchmarks/profile_gemm.py arguments: GEMMs
# `--case model:fc1|fc2:M`, or whole layer calls `--layer problem:M`) and BUNDLE override the
# defaults; SOURCE=1 adds SASS-level stall samples ($OUT/source.csv.gz). Writes $OUT/details.txt.
#   CASES="--layer glm-4.5-air:8192" BUNDLE=generated/moe-models SOURCE=1 bash benchmarks/scripts/profile_large_m.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
C="${CASES:---case qwen3-30b-a3b:fc1:4096 --case qwen3-30b-a3b:fc2:4096 --case gpt-oss-120b:fc1:4096 --case qwen3-30b-a3b:fc1:1024}"
S="--section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats"
[ -n "${SOURCE:-}" ] && S="$S --section SchedulerStats --section SourceCounters --section InstructionStats --import-source no"
STALLS=""
for r in barrier long_scoreboard wait math_pipe_throttle short_scoreboard mio_throttle lg_throttle dispatch_stall \
         selected not_selected tex_throttle misc sleeping membar no_instruction branch_resolving; do
  STALLS="$STALLS,smsp__average_warp_latency_issue_stalled_$r.ratio"
done
M="sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum"
M="$M,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"  # (the gmma one reads n/a on the H200)
M="$M,lts__t_bytes.sum.per_second,lts__t_sectors_srcunit_tex.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum$STALLS"
timeout 420 ncu --clock-control none -k regex:'W4A16' --launch-skip 0 $S --metrics "$M" -o "$OUT/prof" \
  python3 -m benchmarks.profile_gemm --bundle "${BUNDLE:-generated/bench-large-m}" $C > "$OUT/ncu_log.txt" 2>&1
echo "ncu rc=$?"; grep -v "^==PROF==" "$OUT/ncu_log.txt" | tail -5
ncu -i "$OUT/prof.ncu-rep" --page details --print-units base > "$OUT/details.txt" 2>&1
if [ -n "${SOURCE:-}" ]; then
  ncu -i "$OUT/prof.ncu-rep" --page source --print-source sass --csv > "$OUT/source.csv" 2>&1; echo "src rc=$?"
  gzip -9 "$OUT/source.csv"
fi
rm -f "$OUT/prof.ncu-rep"; wc -l "$OUT/details.txt"
grep -E "^  [A-Za-z_]|Duration|DRAM Throughput|Compute \(SM\)|Issued Ipc|No Eligible|Achieved Occupancy|hmma" "$OUT/details.txt" | cut -c1-150 | head -80
