"""Where a kernel's warps wait, by code region, from an Nsight Compute source page (issue 14).

    ncu --section SourceCounters --section WarpStateStats -o rep ...   (benchmarks/scripts/profile_stalls.sh)
    ncu -i rep.ncu-rep --page source --print-source sass --csv > kernel.csv
    python -m benchmarks.stall_regions kernel.csv [--min-share 0.5] [--top 20] [--span NAME=FIRST-LAST ...]
                                       [--json summary.json]

The source page has one row per SASS instruction: its warp-state samples (a sampled warp and why it did not
issue, or that it did) and how often it executed.  A persistent kernel's code falls into runs of
instructions executed equally often: a main-loop body (once per k-tile and warp), a tile's start (once per
tile and warp), a spin loop (once per poll), the grid barrier (once per warp).  The summary prints those runs
with their share of all samples and the instructions that mark them (MMA, barriers, copies, global loads),
then, for each `--span` (a named range of instruction indices, e.g. a main loop found among those runs), its
share and stall reasons, then the instructions with the most samples and their largest stall reasons.  Samples
are taken per warp at a fixed interval, so a region's share of the samples is the share of the warps' time spent
there.
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


def parse_span(text: str) -> tuple[str, int, int]:
    """`NAME=FIRST-LAST` (instruction indices of the source page, both included) -> (name, first, last)."""
    name, sep, bounds = text.rpartition("=")
    first, dash, last = bounds.partition("-")
    if not sep or not name or not dash or not first.isdigit() or not last.isdigit() or int(first) > int(last):
        raise argparse.ArgumentTypeError(f"expected NAME=FIRST-LAST with FIRST <= LAST, got {text!r}")
    return name, int(first), int(last)


def span_shares(rows: list[dict], spans: list[tuple[str, int, int]]) -> list[dict]:
    """Each named span's share of all samples and its three largest stall reasons (% of its own samples),
    then "other" for the instructions no span covers.  Spans may not overlap."""
    total = sum(r["samples"] for r in rows) or 1
    owner: dict[int, str] = {}
    for name, first, last in spans:
        for i in range(first, last + 1):
            if i in owner:
                raise ValueError(f"span {name!r} overlaps {owner[i]!r} at instruction {i}")
            owner[i] = name
    out = []
    for name, first, last in list(spans) + [("other", None, None)]:
        picked = [r for r in rows if owner.get(r["index"], "other") == name]
        samples = sum(r["samples"] for r in picked)
        stalls = Counter()
        for r in picked:
            stalls.update(r["stalls"])
        out.append({"name": name, "first": first, "last": last, "samples": samples, "share": 100 * samples / total,
                    "stalls": {k: 100 * v / (samples or 1) for k, v in stalls.most_common(3)}})
    return out


def summarize(rows: list[dict], min_share: float, top: int, spans: list[tuple[str, int, int]] = ()) -> dict:
    total = sum(r["samples"] for r in rows) or 1
    reasons = Counter()
    for r in rows:
        reasons.update(r["stalls"])
    kept = [dict(run, share=100 * run["samples"] / total, markers=dict(run["markers"]),
                 stalls=dict(run["stalls"].most_common(3)))
            for run in regions(rows) if 100 * run["samples"] / total >= min_share]
    hot = sorted(rows, key=lambda r: -r["samples"])[:top]
    return {"samples": total, "reasons": dict(reasons.most_common()), "regions": kept,
            "spans": span_shares(rows, list(spans)) if spans else [],
            "hot": [{"index": r["index"], "source": r["source"], "samples": r["samples"], "executed": r["executed"],
                     "share": 100 * r["samples"] / total,
                     "stalls": dict(Counter(r["stalls"]).most_common(3))} for r in hot]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("page", help="ncu --page source --print-source sass --csv output")
    ap.add_argument("--min-share", type=float, default=0.5, help="print regions with at least this %% of samples")
    ap.add_argument("--top", type=int, default=20, help="instructions with the most samples")
    ap.add_argument("--span", action="append", type=parse_span, default=[], metavar="NAME=FIRST-LAST",
                    help="a named range of instruction indices (repeatable): their share and stalls, as one row")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    s = summarize(read_page(args.page), args.min_share, args.top, args.span)
    print(f"{s['samples']} samples; by reason: "
          + ", ".join(f"{k} {100 * v / s['samples']:.1f}%" for k, v in list(s["reasons"].items())[:8]))
    print("| instructions | executed | share % | markers | largest stalls |\n| --- | ---: | ---: | --- | --- |")
    for g in s["regions"]:
        print(f"| {g['first']}-{g['last']} | {g['executed']} | {g['share']:.1f} | {g['markers']} | {g['stalls']} |")
    if s["spans"]:
        print("\n| span | share % | largest stalls (% of its samples) |\n| --- | ---: | --- |")
        for g in s["spans"]:
            stalls = ", ".join(f"{k} {v:.0f} %" for k, v in g["stalls"].items())
            print(f"| {g['name']} | {g['share']:.1f} | {stalls} |")
    print("\n| instruction | executed | share % | largest stalls |\n| --- | ---: | ---: | --- |")
    for h in s["hot"]:
        print(f"| {h['index']} `{h['source'][:56]}` | {h['executed']} | {h['share']:.1f} | {h['stalls']} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(s, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
