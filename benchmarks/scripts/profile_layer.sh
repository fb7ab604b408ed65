#!/usr/bin/env bash
# Nsight Compute on the W4A16 kernels of whole layer calls (benchmarks/profile_gemm.py --layer): per-kernel
# details and SASS-level stall samples. CASES="--layer problem:M ..." and BUNDLE override the defaults.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
C="${CASES:---layer qwen3-30b-a3b:4096 --layer qwen3-30b-a3b:256 --layer qwen3-30b-a3b:64}"
S="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats --section SourceCounters --section InstructionStats"
M="sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum"
timeout 420 ncu --clock-control none -k regex:'W4A16' $S --metrics "$M" --import-source no -o "$OUT/prof" \
  python3 -m benchmarks.profile_gemm --bundle "${BUNDLE:-generated/moe-models}" $C > "$OUT/ncu_log.txt" 2>&1
echo "ncu rc=$?"; grep -v "^==PROF==" "$OUT/ncu_log.txt" | tail -5
ncu -i "$OUT/prof.ncu-rep" --page details --print-units base > "$OUT/details.txt" 2>&1
ncu -i "$OUT/prof.ncu-rep" --page source --print-source sass --csv > "$OUT/source.csv" 2>&1; echo "src rc=$?"
gzip -9 "$OUT/source.csv"; rm -f "$OUT/prof.ncu-rep"
grep -E "^  [A-Za-z_]|Duration|DRAM Throughput|Compute \(SM\)|Issued Ipc|No Eligible|Achieved Occupancy|gmma|hmma" "$OUT/details.txt" | cut -c1-150 | head -80
