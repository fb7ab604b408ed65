"""GEMM launches of real MoE shapes, or whole layer calls, for Nsight Compute, one at a time.

    ncu --clock-control none --set full -k regex:W4A16 \
        python -m benchmarks.profile_gemm --case qwen3-30b-a3b:fc1:64 --case qwen3-30b-a3b:fc2:4096
    ncu ... python -m benchmarks.profile_gemm --bundle generated/moe-models --layer qwen3-30b-a3b:4096

Each GEMM case builds its operands exactly as `benchmarks.gemm` does (FC2 reads one row per route
and multiplies the router weight), runs once to warm up and once more to be profiled, so with
`--launch-skip`-free ncu each kernel shows up twice; route packing runs too (its own kernel).
Each layer case (a problem of the bundle's spec) gets random NVFP4 weights and a uniform top-k
routing (as benchmarks/compare_layer.py) and calls the layer eagerly twice.
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


def run_layer(bundle, problem: str, m: int) -> None:
    from benchmarks.common import uniform_routing
    from benchmarks.compare_layer import _layer, _problems, random_layer_weights
    from cuteaot.runtime import prepare_w2, prepare_w13

    f = _problems(bundle)[problem]
    g = torch.Generator(device="cuda").manual_seed(0)
    q13, q2 = random_layer_weights(f, g)
    layer = _layer(bundle, f, prepare_w13(*q13, "bf16"), prepare_w2(*q2, "bf16"))
    x, w, ids = uniform_routing(m, f["hidden_size"], f["num_experts"], f["top_k"], g)
    for _ in range(2):
        layer(x, w, ids)
    torch.cuda.synchronize()
    print(f"{problem} M={m}: {layer.resolve(m).describe()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="generated/bench-gemm")
    ap.add_argument("--case", action="append", default=[], help="model:fc1|fc2:M (one GEMM)")
    ap.add_argument("--layer", action="append", default=[], help="problem:M (a layer call of the bundle)")
    args = ap.parse_args()
    if not args.case and not args.layer:
        ap.error("give at least one --case or --layer")
    bundle = load_bundle(args.bundle)
    for case in args.case:
        model, which, m = case.split(":")
        run_case(bundle, model, which, int(m))
    for case in args.layer:
        problem, m = case.rsplit(":", 1)
        run_layer(bundle, problem, int(m))


if __name__ == "__main__":
    main()
