"""Measure, per MoE layer shape and token count, where a planner choice ("knob") beats the planner's
rule, and record the answers where the build reads them (codegen/kernels/w4a16/measured_blocks.json).

Knobs: "tall" (128-row wgmma route blocks below 128 routes per expert), "decode" (the fused decode
regime, direct routes and the top-k sum in FC2, past M = 2 up to fused_planning.DECODE_MEASURED_MAX_M),
"wide" (256-row wgmma route blocks from 256 routes per expert where a GEMM's K is below
planning.WGMMA_WIDE_MIN_K), "promote" (16-row wgmma route blocks where the rule packs 8-row ones),
"producer" (128- and 256-row blocks on the wgmma loop with a producer warpgroup, wgmma_ws.py),
"onewave" (decode launches whose grid covers the larger GEMM's whole tiles in one wave), "topksum"
(packed plans of the fused kernel whose FC2 adds the routes' rows into the output: no top-k sum
kernel), "splitsum" (the same for the FC2 GEMM of a layer run as two GEMMs) and "tallwide" (the two
GEMMs' 128-row blocks on the 256-wide tile of two warpgroups, planning.WGMMA_TALL_WIDE_TILE), "splitk"
(decode launches that split K over every co-resident CTA where one wave of whole tiles would do) and
"fusepack" (the fused kernel, packing its routes itself, where the rule runs two GEMM launches), "narrow"
(128-row wgmma route blocks where the rule or "wide" packs 256-row ones for a layer run as two GEMMs) and
"micro" (a decode launch on the barrier-free micro kernel, codegen/kernels/w4a16/micro.py) and "microstored" (the
same for weights read as stored: measured on them, `measure --weights modelopt`, the default for that knob).

    # 1. builder (CPU): the spec's bundle planned twice, by the rule and with the choice wherever it runs
    python -m benchmarks.tune_blocks build specs/moe-models.yaml --knob tall --targets h200 --out generated/tune
    # 2. GPU: both on identical operands (benchmarks.compare_layer's timing), raw rows to JSON
    python -m benchmarks.tune_blocks measure --knob tall --rule generated/tune/rule/moe-models \\
        --always generated/tune/always/moe-models --m 256,384,512,768,1024,1536,2048,3072 --json rows.json
    # 3. builder: the rows become the planner's table (the choice where it took <= 1 - margin of the
    #    rule's time); then rebuild the shipped bundles
    python -m benchmarks.tune_blocks record rows.json [more-rows.json ...] [--margin 0.02]
    # 4. builder, any time: how a shape nobody measured fares borrowing the others' tables (each
    #    recorded shape left out in turn, planning.borrowed_choice, the recorded ratios read off)
    python -m benchmarks.tune_blocks holdout [--json summary.json]

Each measured M stands for the token counts up to the geometric midpoints with its measured
neighbours; where the choice did not win (or the rule already makes it) the rule decides.  Why a
table and not a threshold: docs/benchmarks.md, "Route blocks measured per layer".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "codegen" / "kernels" / "w4a16" / "measured_blocks.json"
POLICIES = ("rule", "always")
# = planning.MEASURED_KNOBS (not imported: `record` runs without cutlass)
KNOBS = ("tall", "decode", "wide", "promote", "producer", "onewave", "topksum", "splitsum", "tallwide", "splitk",
         "fusepack", "narrow", "micro", "microstored")


def build(spec: str, knob: str, out: str, targets: str | None, jobs: int) -> None:
    """Build `spec` under out/rule and out/always (the second reuses the first's compiled kernels)."""
    import shutil

    from cuteaot.codegen import cli
    from cuteaot.codegen.kernels.w4a16 import planning

    for policy in POLICIES:
        for one in knob.split(","):  # (several knobs: a bundle whose layers take one or the other, tiny-micro's)
            planning.POLICY[one] = policy  # planning runs in this process; workers only compile
        dest = Path(out) / policy
        if policy != POLICIES[0] and not (dest / ".cache").exists():
            shutil.copytree(Path(out) / POLICIES[0] / ".cache", dest / ".cache")
        argv = ["build", spec, "--out", str(dest), "-j", str(jobs)] + (["--targets", targets] if targets else [])
        if cli.main(argv):
            raise SystemExit(f"building {spec} with POLICY[{knob!r}] = {policy!r} failed")


# the weights a knob's layers are measured on where --weights is not given
KNOB_WEIGHTS = {"microstored": "modelopt"}


def measure(knob: str, rule: str, always: str, models: list[str], ms: list[int], rounds: int,
            json_path: str | None, check: bool = False, weights: str | None = None) -> None:
    import torch

    from benchmarks.common import write_results
    from benchmarks.compare_layer import _problems, compare
    from cuteaot.runtime import load_bundle

    weights = weights or KNOB_WEIGHTS.get(knob, "nvfp4")
    base = load_bundle(rule)
    rows = compare(base, {"always": load_bundle(always)}, models, ms, rounds, check, weights)
    facts = _problems(base, weights)
    for row in rows:
        f = facts[row["model"]]
        row["facts"] = {k: f[k] for k in ("hidden_size", "intermediate_size", "num_experts", "top_k", "activation")}
        row["profile"] = base.profile.name
        row["knob"] = knob
        row["weights"] = weights
    path = write_results(json_path, f"tune-{knob}", _commit(), "benchmarks.tune_blocks measure: compare_layer "
                         f"timing, {rounds} interleaved rounds, uniform routing, {weights} weights", rows)
    print(f"{len(rows)} rows -> {path} ({torch.cuda.get_device_name()})")


def _commit() -> str | None:
    """COMMIT from the environment (the device copy of the tree may carry no, or a stale, .git), else HEAD."""
    import os
    import subprocess

    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def decide(points: list[tuple[int, float, bool]], margin: float) -> tuple[tuple[int, int], list[list[int]]]:
    """Measured points (M, always / rule time, plans differ) -> (measured M range, tall M ranges).

    A point wins when its plans differ and the 128-row plan took <= 1 - margin of the rule's time;
    it stands for the Ms up to the geometric midpoints with its neighbours.  A point whose plans are
    the same (the rule plans 128-row blocks there itself) joins the range of an adjacent win, so
    that no token count between two 128-row plans falls back to a shorter block.  Several runs of the
    same M (routing drawn anew each run) count as one point: the geometric mean of the ratios of those
    whose plans differ (if none differ, one point whose plans are the same)."""
    points = _one_per_m(points)
    ms = [p[0] for p in points]
    bounds = [ms[0]] + [math.isqrt(a * b) + 1 for a, b in zip(ms, ms[1:])] + [ms[-1] + 1]
    kinds = ["win" if differs and ratio <= 1.0 - margin else "lose" if differs else "same"
             for _, ratio, differs in points]
    tall: list[list[int]] = []
    i = 0
    while i < len(points):  # runs of win/same points that hold at least one win
        j = i
        while j < len(points) and kinds[j] != "lose":
            j += 1
        if "win" in kinds[i:j]:
            tall.append([bounds[i], bounds[j] - 1])
        i = j + 1
    return (ms[0], ms[-1]), tall


def _one_per_m(points: list[tuple[int, float, bool]]) -> list[tuple[int, float, bool]]:
    """The runs of each M as one point, in M order: the geometric mean of the ratios of the runs whose plans
    differ, or (none differ) the first run, whose plans are the same."""
    by_m: dict[int, list[tuple[float, bool]]] = {}
    for m, ratio, differs in points:
        by_m.setdefault(m, []).append((ratio, differs))
    out = []
    for m, runs in sorted(by_m.items()):
        compared = [ratio for ratio, differs in runs if differs]
        if compared:
            out.append((m, math.prod(compared) ** (1.0 / len(compared)), True))
        else:
            out.append((m, runs[0][0], False))
    return out


def _points_by_shape(rows: list[dict]) -> dict[tuple, list[tuple[int, float, bool]]]:
    """Measured rows -> {(knob, profile, hidden, intermediate, experts, top_k, gated): [(M, ratio, plans
    differ), ...]} (rows without a knob are the first knob's, "tall")."""
    from cuteaot.runtime.types import Activation

    out: dict[tuple, list] = {}
    for row in rows:
        f, new = row["facts"], row["new"]["always"]
        key = (row.get("knob", "tall"), row["profile"], f["hidden_size"], f["intermediate_size"], f["num_experts"],
               f["top_k"], Activation(f["activation"]).is_gated)
        out.setdefault(key, []).append((row["M"], new["ratio"], new["plan"] != row["base_plan"]))
    return out


def record(rows_paths: list[str], margin: float, table: Path = TABLE) -> dict:
    """Merge measured rows (one or several runs) into the planner's table (entries of the same
    profile and shape replaced)."""
    runs = [json.loads(Path(p).read_text()) for p in rows_paths]
    by_shape = _points_by_shape([r for run in runs for r in run["rows"]])
    out = json.loads(table.read_text())
    for key, points in sorted(by_shape.items()):
        knob, profile, h, i, e, k, gated = key
        measured, won = decide(points, margin)
        entries = out.setdefault(knob, {}).setdefault(profile, [])
        entries[:] = [x for x in entries if (x["hidden_size"], x["intermediate_size"], x["num_experts"],
                                             x["top_k"], x["gated"]) != (h, i, e, k, gated)]
        entries.append({"hidden_size": h, "intermediate_size": i, "num_experts": e, "top_k": k, "gated": gated,
                        "measured_m": list(measured), "won_m": won})
        entries.sort(key=lambda x: (x["hidden_size"], x["intermediate_size"], x["num_experts"], x["top_k"],
                                    x["gated"]))
        provenance = out["measured"].setdefault(knob, {})
        provenance[profile] = {"runs": [{"date": run.get("date"), "gpu": run.get("gpu"), "commit": run.get("commit"),
                                         "rows": Path(p).as_posix()} for run, p in zip(runs, rows_paths)],
                               "margin": margin}
        print(f"{knob} {profile} H={h} I={i} E={e} top_k={k} gated={gated}: measured M {measured}, won at {won}")
    table.write_text(_dump(out))
    return out


def holdout(margin: float, table: Path = TABLE) -> dict:
    """Leave each measured shape out in turn and plan it from the other shapes' tables, as an unmeasured
    shape is planned (planning.borrowed_choice), over the rows the table was recorded from.

    Per knob: the geometric mean, over every recorded point whose two plans differ, of the time the
    borrowed choice takes against the rule's (1 where it borrows nothing), the points borrowed faster and
    slower, and the same mean for the shape's own table (in sample: what measuring the shape bought)."""
    from cuteaot.codegen.kernels.w4a16 import planning

    data = json.loads(table.read_text())
    summary = {}
    for knob, provenance in data["measured"].items():
        for profile, prov in provenance.items():
            rows = [r for run in prov["runs"] for r in json.loads((ROOT / run["rows"]).read_text())["rows"]]
            by_shape = {k[1:]: v for k, v in _points_by_shape(rows).items() if k[:2] == (knob, profile)}
            tables = {k[1:]: decide(v, margin) for k, v in by_shape.items()}
            logs, own, faster, slower = [], [], 0, 0
            for key, points in sorted(by_shape.items()):
                shape = key[1:]
                others = {s: t for s, t in tables.items() if s != shape}
                taken = []
                for m, ratio, differs in _one_per_m(points):
                    if not differs:
                        continue
                    borrowed = knob not in planning.NOT_BORROWED and planning.borrowed_choice(m, shape, others)
                    logs.append(math.log(ratio) if borrowed else 0.0)
                    own.append(math.log(ratio) if any(lo <= m <= hi for lo, hi in tables[shape][1]) else 0.0)
                    if borrowed:
                        faster, slower = faster + (ratio < 1.0), slower + (ratio >= 1.0)
                        taken.append(f"{m}:{ratio:.3f}")
                if taken:
                    print(f"  {knob} {profile} {shape}: borrowed at {' '.join(taken)}")
            if not logs:
                continue
            result = {"points": len(logs), "borrowed": math.exp(sum(logs) / len(logs)),
                      "own_table": math.exp(sum(own) / len(own)), "faster": faster, "slower": slower,
                      "borrowed_at_all": knob not in planning.NOT_BORROWED}
            summary[f"{knob}/{profile}"] = result
            print(f"{knob:9s} {profile}: {len(logs)} points whose plans differ; borrowed {result['borrowed']:.4f}x "
                  f"the rule's time ({faster} faster, {slower} slower), own table {result['own_table']:.4f}x"
                  + ("" if result["borrowed_at_all"] else " (not borrowed: planning.NOT_BORROWED)"))
    return summary


def _dump(table: dict) -> str:
    """The table as JSON with one line per layer shape (a diff then shows which shapes changed)."""
    lines = ["{"]
    for i, (key, value) in enumerate(table.items()):
        comma = "," if i + 1 < len(table) else ""
        if key in KNOBS:
            lines.append(f" {json.dumps(key)}: {{")
            for j, (profile, entries) in enumerate(value.items()):
                lines.append(f"  {json.dumps(profile)}: [")
                lines += [f"   {json.dumps(e)}" + ("," if n + 1 < len(entries) else "") for n, e in enumerate(entries)]
                lines.append("  ]" + ("," if j + 1 < len(value) else ""))
            lines.append(" }" + comma)
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}{comma}")
    return "\n".join(lines + ["}"]) + "\n"


def main(argv=None) -> int:
    from benchmarks.common import comma_list

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="builder: the rule and the always-the-choice bundles of a spec")
    b.add_argument("spec")
    b.add_argument("--knob", required=True, help=f"one of {', '.join(KNOBS)}, or several, comma-separated")
    b.add_argument("--out", required=True)
    b.add_argument("--targets", default=None)
    b.add_argument("-j", "--jobs", type=int, default=2)
    m = sub.add_parser("measure", help="GPU: time both bundles on identical operands")
    m.add_argument("--knob", choices=KNOBS, required=True)
    m.add_argument("--rule", required=True)
    m.add_argument("--always", required=True)
    m.add_argument("--models", default="", type=comma_list())
    m.add_argument("--m", required=True, type=comma_list(int))
    m.add_argument("--rounds", type=int, default=3)
    m.add_argument("--json", default=None)
    m.add_argument("--check", action="store_true", help="also each output's error against the float32 reference")
    m.add_argument("--weights", default=None, choices=("nvfp4", "modelopt", "nf3"),
                   help="the layers' weights (default: modelopt for microstored, else nvfp4)")
    r = sub.add_parser("record", help="builder: measured rows -> the planner's table")
    r.add_argument("rows", nargs="+", help="rows JSON of one or several measure runs")
    r.add_argument("--margin", type=float, default=0.02)
    h = sub.add_parser("holdout", help="builder: how unmeasured shapes fare borrowing the others' tables")
    h.add_argument("--margin", type=float, default=0.02)
    h.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.cmd == "build":
        unknown = [k for k in args.knob.split(",") if k not in KNOBS]
        if unknown:
            p.error(f"unknown knob(s) {unknown}; the knobs: {', '.join(KNOBS)}")
        build(args.spec, args.knob, args.out, args.targets, args.jobs)
    elif args.cmd == "measure":
        measure(args.knob, args.rule, args.always, args.models, args.m, args.rounds, args.json, args.check,
                args.weights)
    elif args.cmd == "holdout":
        summary = holdout(args.margin)
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    else:
        record(args.rows, args.margin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
