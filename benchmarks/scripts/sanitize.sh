# compute-sanitizer memcheck and racecheck over every GEMM path (benchmarks/sanitize_gemm.py, tiny-gemm bundle).
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool python3 -m benchmarks.sanitize_gemm > $OUT/sanitize_$tool.txt 2>&1
  echo "$tool rc=$? ok-lines=$(grep -c ': ok, finite=True' $OUT/sanitize_$tool.txt)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race|hazard" $OUT/sanitize_$tool.txt | sort | uniq -c | head -8
done
