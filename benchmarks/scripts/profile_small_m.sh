# Nsight Compute on the GEMM kernels only (-k): per-kernel summary + SASS-level stall samples.
# CASES="--case model:fc1|fc2:M ..." and BUNDLE=generated/<bundle> override the defaults.
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
C="${CASES:---case qwen3-30b-a3b:fc1:64 --case qwen3-30b-a3b:fc2:64 --case qwen3-30b-a3b:fc1:8 --case qwen3-235b-a22b:fc1:64 --case qwen3-30b-a3b:fc2:4096}"
S="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SourceCounters --section InstructionStats"
timeout 300 ncu --clock-control none -k regex:'W4A16|RoutePack|route' --launch-skip 0 $S --import-source no -o $OUT/prof \
  python3 -m benchmarks.profile_gemm --bundle ${BUNDLE:-generated/bench-gemm} $C > $OUT/ncu_log.txt 2>&1; echo ncu rc=$?
grep -c "Profiling" $OUT/ncu_log.txt
ncu -i $OUT/prof.ncu-rep --page details --print-units base > $OUT/details.txt 2>&1
ncu -i $OUT/prof.ncu-rep --page source --print-source sass --csv > $OUT/source.csv 2>&1; echo src rc=$?
gzip -9 $OUT/source.csv; rm -f $OUT/prof.ncu-rep; ls -la $OUT
grep -E "^  [A-Za-z_]|Duration|DRAM Throughput|Compute \(SM\)|Issued Ipc|No Eligible|Achieved Occupancy|Registers Per" $OUT/details.txt | cut -c1-150 | head -120
