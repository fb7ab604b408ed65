"""MoE layer calls of a bundle's spec'd problems for Nsight Compute, one (problem, M) at a time.

    ncu --clock-control none --set full -k regex:W4A16 \
        python -m benchmarks.profile_layer --bundle generated/moe-models --case qwen3-30b-a3b:4096

Each case gets random NVFP4 weights and a uniform top-k routing (as benchmarks/compare_layer.py)
and calls the layer eagerly twice, so every kernel of the layer shows up twice in the profile.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import uniform_routing
from benchmarks.compare_layer import _layer, _problems
from tests.reference.nvfp4 import random_nvfp4


def run_case(bundle, problem: str, m: int) -> None:
    from cuteaot.runtime import prepare_w2, prepare_w13

    f = _problems(bundle)[problem]
    h, i, e, k = f["hidden_size"], f["intermediate_size"], f["num_experts"], f["top_k"]
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = prepare_w13(*random_nvfp4(e, 2 * i if f["activation"] != "relu2" else i, h, g), "bf16")
    w2 = prepare_w2(*random_nvfp4(e, h, i, g), "bf16")
    layer = _layer(bundle, f, w13, w2)
    x, w, ids = uniform_routing(m, h, e, k, g)
    for _ in range(2):
        layer(x, w, ids)
    torch.cuda.synchronize()
    print(f"{problem} M={m}: {layer.resolve(m).describe()}", flush=True)


def main() -> None:
    from cuteaot.runtime import load_bundle

    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="generated/moe-models")
    ap.add_argument("--case", action="append", required=True, help="problem:M")
    args = ap.parse_args()
    bundle = load_bundle(args.bundle)
    for case in args.case:
        problem, m = case.rsplit(":", 1)
        run_case(bundle, problem, int(m))


if __name__ == "__main__":
    main()
