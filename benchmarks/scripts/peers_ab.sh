#!/usr/bin/env bash
# One device call: the peer benchmark (benchmarks/peers.py, cuteaot and humming) of two runtimes in
# alternating processes, for changes the in-process A/B (benchmarks/compare_layer.py) cannot take: a new
# weight layout, which each runtime must prepare itself.  BASE_PKG: a directory holding the base's runtime
# as cuteaot/runtime (a copy of its runtime/); BASE_BUNDLE: the bundle that base built; NEW_BUNDLE: the
# working tree's.  humming runs in every process: its ratio across processes shows the drift between them.
# Carry both bundles, BASE_PKG and .whl.  MODELS, MS, ROUNDS (default 1), BASE_COMMIT, COMMIT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
ARGS="--impls cuteaot,humming --models $MODELS --m $MS"
for r in $(seq "${ROUNDS:-1}"); do
  PYTHONPATH="$BASE_PKG:/tmp/site" timeout "${RUN_TIMEOUT:-240}" python3 -m benchmarks.peers $ARGS --bundle "$BASE_BUNDLE" \
    --commit "${BASE_COMMIT:-base}" --json "$OUT/base-$r.json" > "$OUT/base-$r.txt" 2>&1; echo "base $r rc=$?"
  PYTHONPATH=/tmp/site timeout "${RUN_TIMEOUT:-240}" python3 -m benchmarks.peers $ARGS --bundle "$NEW_BUNDLE" \
    --commit "${COMMIT:-new}" --json "$OUT/new-$r.json" > "$OUT/new-$r.txt" 2>&1; echo "new $r rc=$?"
done
grep -hE "Traceback|Error" "$OUT"/base-*.txt "$OUT"/new-*.txt | head -5
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
rows = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/*-*.json")):
    side = path.rsplit("/", 1)[1].split("-")[0]
    for row in json.load(open(path))["rows"]:
        if row.get("us"):
            rows.setdefault((row["model"], row["M"], row["impl"], side), []).append(row["us"])
print("| model | M | base µs | new µs | new / base | humming new / base | rel_err new |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
errs = {}
for path in glob.glob(f"{sys.argv[1]}/new-*.json"):
    for row in json.load(open(path))["rows"]:
        if row["impl"] == "cuteaot" and row.get("rel_err") is not None:
            errs[(row["model"], row["M"])] = row["rel_err"]
for model, m in sorted({(k[0], k[1]) for k in rows}):
    med = {(impl, side): statistics.median(rows[(model, m, impl, side)])
           for impl in ("cuteaot", "humming") for side in ("base", "new") if (model, m, impl, side) in rows}
    if ("cuteaot", "base") in med and ("cuteaot", "new") in med:
        b, n = med["cuteaot", "base"], med["cuteaot", "new"]
        h = med.get(("humming", "new"), 0) / med.get(("humming", "base"), float("nan"))
        e = errs.get((model, m))
        print(f"| {model} | {m} | {b:.1f} | {n:.1f} | {n / b:.3f} | {h:.3f} | {'' if e is None else f'{e:.2e}'} |")
PY
