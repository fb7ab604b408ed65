"""Where a kernel's warps wait, by code region, from an Nsight Compute source page (issue 14).

    ncu --section SourceCounters --section WarpStateStats -o rep ...   (benchmarks/scripts/profile_stalls.sh)
    ncu -i rep.ncu-rep --page source --print-source sass --csv > kernel.csv
    python -m benchmarks.stall_regions kernel.csv [--min-share 0.5] [--top 20] [--json summary.json]

The source page has one row per SASS instruction: its warp-state samples (a sampled warp and why it did not
issue, or that it did) and how often it executed.  A persistent kernel's code falls into runs of
instructions executed equally often: a main-loop body (once per k-tile and warp), a tile's start (once per
tile and warp), a spin loop (once per poll), the grid barrier (once per warp).  The summary prints those runs
with their share of all samples and the instructions that mark them (MMA, barriers, copies, global loads),
then the instructions with the most samples and their largest stall reasons.  Samples are taken per warp at
a fixed interval, so a region's share of the samples is the share of the warps' time spent there.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
MARKERS = ("HMMA", "HGMMA", "BAR", "B2R", "DEPBAR", "LDGSTS", "LDG", "STG", "REDG", "ATOMG", "CCTL", "LDS", "LDSM",
           "STS", "MEMBAR", "EXIT")


def _opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):  # predicate
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def read_page(path: str) -> list[dict]:
    """The rows of an ncu source page CSV (its first line names the kernel, the second the columns)."""
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    header, body = rows[1], rows[2:]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    col = {h: i for i, h in enumerate(header)}
    out = []
    for n, r in enumerate(body):
        source = r[col["Source"]].strip()
        out.append({"index": n, "source": source, "opcode": _opcode(source),
                    "samples": int(r[col[SAMPLES]] or 0), "executed": int(r[col[EXECUTED]] or 0),
                    "stalls": {h[len("stall_"):]: int(r[col[h]] or 0) for h in reasons if r[col[h]] not in ("", "0")}})
    return out


def regions(rows: list[dict]) -> list[dict]:
    """Maximal runs of consecutive instructions with the same execution count."""
    runs: list[dict] = []
    for r in rows:
        if runs and runs[-1]["executed"] == r["executed"]:
            run = runs[-1]
        else:
            run = {"first": r["index"], "executed": r["executed"], "instructions": 0, "samples": 0,
                   "markers": Counter(), "stalls": Counter()}
            runs.append(run)
        run["last"] = r["index"]
        run["instructions"] += 1
        run["samples"] += r["samples"]
        run["stalls"].update(r["stalls"])
        if r["opcode"] in MARKERS:
            run["markers"][r["opcode"]] += 1
    return runs


def summarize(rows: list[dict], min_share: float, top: int) -> dict:
    total = sum(r["samples"] for r in rows) or 1
    reasons = Counter()
    for r in rows:
        reasons.update(r["stalls"])
    kept = [dict(run, share=100 * run["samples"] / total, markers=dict(run["markers"]),
                 stalls=dict(run["stalls"].most_common(3)))
            for run in regions(rows) if 100 * run["samples"] / total >= min_share]
    hot = sorted(rows, key=lambda r: -r["samples"])[:top]
    return {"samples": total, "reasons": dict(reasons.most_common()), "regions": kept,
            "hot": [{"index": r["index"], "source": r["source"], "samples": r["samples"], "executed": r["executed"],
                     "share": 100 * r["samples"] / total,
                     "stalls": dict(Counter(r["stalls"]).most_common(3))} for r in hot]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("page", help="ncu --page source --print-source sass --csv output")
    ap.add_argument("--min-share", type=float, default=0.5, help="print regions with at least this %% of samples")
    ap.add_argument("--top", type=int, default=20, help="instructions with the most samples")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    s = summarize(read_page(args.page), args.min_share, args.top)
    print(f"{s['samples']} samples; by reason: "
          + ", ".join(f"{k} {100 * v / s['samples']:.1f}%" for k, v in list(s["reasons"].items())[:8]))
    print("| instructions | executed | share % | markers | largest stalls |\n| --- | ---: | ---: | --- | --- |")
    for g in s["regions"]:
        print(f"| {g['first']}-{g['last']} | {g['executed']} | {g['share']:.1f} | {g['markers']} | {g['stalls']} |")
    print("\n| instruction | executed | share % | largest stalls |\n| --- | ---: | ---: | --- |")
    for h in s["hot"]:
        print(f"| {h['index']} `{h['source'][:56]}` | {h['executed']} | {h['share']:.1f} | {h['stalls']} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(s, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
