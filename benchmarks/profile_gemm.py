"""GEMM launches of real MoE shapes for Nsight Compute, one (model, GEMM, M) at a time.

    ncu --clock-control none --set full -k regex:W4A16 \
        python -m benchmarks.profile_gemm --case qwen3-30b-a3b:fc1:64 --case qwen3-30b-a3b:fc2:4096

Each case builds its operands exactly as `benchmarks.gemm` does (FC2 reads one row per route
and multiplies the router weight), runs once to warm up and once more to be profiled, so with
`--launch-skip`-free ncu each kernel shows up twice; route packing runs too (its own kernel).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.gemm import Problem
from cuteaot.runtime import load_bundle


def run_case(bundle, model: str, which: str, m: int) -> None:
    g = Problem(model, which, m).gemm(bundle)
    for _ in range(2):
        g.run()  # packs its routes too (the route-pack kernel shows up in the profile)
    torch.cuda.synchronize()
    print(f"{model} {which} M={m} done", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="generated/bench-gemm")
    ap.add_argument("--case", action="append", required=True, help="model:fc1|fc2:M")
    args = ap.parse_args()
    bundle = load_bundle(args.bundle)
    for case in args.case:
        model, which, m = case.split(":")
        run_case(bundle, model, which, int(m))


if __name__ == "__main__":
    main()
