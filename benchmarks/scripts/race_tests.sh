#!/usr/bin/env bash
# compute-sanitizer racecheck over GPU tests one at a time (GPU machine), so that a device call that runs out of
# time still leaves a result for every test it finished (racecheck runs tests 40-100x slower than they run bare).
#
#   PER_TEST=150 BUDGET=480 bash benchmarks/scripts/race_tests.sh <pytest node id>...
#
# One line a test on stdout and in $OUT/race-tests.txt: "<id> rc=<rc> <pytest result> <racecheck summary>",
# rc 0 = passed with no hazard, 9 = a hazard reported, 124 = stopped by PER_TEST. Tests left when BUDGET seconds
# have gone are listed as "not run". Each test's full output: $OUT/race-<n>.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PER_TEST=${PER_TEST:-150}; BUDGET=${BUDGET:-480}
start=$SECONDS; n=0
for id in "$@"; do
  n=$((n + 1))
  left=$((BUDGET - (SECONDS - start)))
  if [ "$left" -le 10 ]; then echo "$id not run (budget)" | tee -a "$OUT/race-tests.txt"; continue; fi
  limit=$(( left < PER_TEST ? left : PER_TEST ))
  t0=$SECONDS
  timeout "$limit" compute-sanitizer --tool racecheck --racecheck-report hazard --report-api-errors no --error-exitcode 9 \
    python3 -m pytest -m gpu -q -p no:cacheprovider "$id" > "$OUT/race-$n.log" 2>&1
  rc=$?
  result=$(grep -E "[0-9]+ (passed|failed|skipped|deselected|errors?)\b.* in [0-9.]+s" "$OUT/race-$n.log" | tail -1 | tr -d '=')
  summary=$(grep -E "RACECHECK SUMMARY" "$OUT/race-$n.log" | tail -1 | sed 's/=* *//')
  echo "$id rc=$rc $((SECONDS - t0))s ${result:-no pytest result} ${summary:-no racecheck summary}" | tee -a "$OUT/race-tests.txt"
done
