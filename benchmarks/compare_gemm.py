"""A/B two builds of the GEMM bundle on identical operands, on one GPU in one process.

Single benchmark runs on the H200 vary by up to ~10 %, more than many kernel changes
are worth, so a change is judged here: for every case both bundles run the same routes,
weights and activations, their timings interleaved round by round (drift hits both
alike); the table gives each one's median and the ratio new / base.

    python -m benchmarks.compare_gemm --base generated/bench-gemm-base --new generated/bench-gemm
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.common import device_us, hbm_copy_bandwidth
from benchmarks.gemm import MODELS, Problem
from cuteaot.runtime import load_bundle


def _gemm_call(bundle, p: Problem):
    """The bundle's GEMM on p's operands with routes packed beforehand, and its output."""
    g = p.gemm(bundle)
    routes = g.pack_routes()
    return (lambda: g.run(routes)), g.out


def compare(base, new, model: str, which: str, m: int, rounds: int, hbm: float) -> dict:
    p = Problem(model, which, m)
    base_call, base_out = _gemm_call(base, p)
    new_call, new_out = _gemm_call(new, p)
    base_call()
    new_call()
    torch.cuda.synchronize()
    # the same operands, so the same result up to summation order (split-K slices may differ)
    diff = float((new_out.float() - base_out.float()).norm() / base_out.float().norm().clamp_min(1e-30))
    times = {"base": [], "new": []}
    for _ in range(rounds):
        times["base"].append(device_us(base_call, reps=3))
        times["new"].append(device_us(new_call, reps=3))
    b, n = statistics.median(times["base"]), statistics.median(times["new"])
    weight_bytes = p.weight_bytes
    return {"model": model, "gemm": which, "M": m, "base_us": b, "new_us": n, "new/base": n / b,
            "base_pct_hbm": 100 * weight_bytes / hbm / (b * 1e-6), "new_pct_hbm": 100 * weight_bytes / hbm / (n * 1e-6),
            "rel_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--m", type=int, nargs="*", default=[1, 8, 64, 4096])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    base, new = load_bundle(args.base), load_bundle(args.new)
    hbm = hbm_copy_bandwidth()
    print(f"HBM copy {hbm / 1e12:.2f} TB/s; base {args.base}, new {args.new}")
    print("| model | GEMM | M | base µs | new µs | new / base | base % HBM | new % HBM | ‖new−base‖/‖base‖ |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for model in args.models:
        for which in ("fc1", "fc2"):
            for m in args.m:
                r = compare(base, new, model, which, m, args.rounds, hbm)
                rows.append(r)
                print(f"| {model} | {which} | {m} | {r['base_us']:.1f} | {r['new_us']:.1f} | {r['new/base']:.3f} | "
                      f"{r['base_pct_hbm']:.1f} | {r['new_pct_hbm']:.1f} | {r['rel_diff']:.1e} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
