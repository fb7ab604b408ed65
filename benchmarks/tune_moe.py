"""Where should the fused layer stop using the decode path?  Decode vs packed at M = 1..8.

    python -m benchmarks.tune_moe build [--out generated]          # on the builder (CuTeDSL)
    python -m benchmarks.tune_moe run [--bundle generated/tune-moe] # on the GPU

`build` compiles, for the models of benchmarks/moe.py, the fused kernels the planner picks
for M = 1..8 both ways (decode, and packed as if DECODE_MAX_M were 0) plus route packing and
the top-k sum; `run` times MoeLayer both ways (CUDA-graph replay, routing included), checks
the two outputs agree, and prints the table.  The winner sets DECODE_MAX_M in
runtime/fused_planning.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json

MS = range(1, 9)


@contextlib.contextmanager
def decode_max_m(value: int):
    import cuteaot.runtime.fused_planning as fp

    saved = fp.DECODE_MAX_M
    fp.DECODE_MAX_M = value
    try:
        yield
    finally:
        fp.DECODE_MAX_M = saved


def specs():
    from benchmarks.moe import MODELS
    from cuteaot.runtime.devices import PROFILES
    from cuteaot.runtime.fused_planning import plan_fused
    from cuteaot.runtime.kernels import ActivationSpec, TopKSumSpec
    from cuteaot.runtime.kernels.fused_spec import FusedSpec

    out = set()
    for h, i, e, k, act in MODELS.values():
        for limit in (8, 0):
            with decode_max_m(limit):
                for m in MS:
                    plan = plan_fused(m, h, i, e, k, True, PROFILES["h200"])
                    out.add(FusedSpec.for_plan(plan, "bf16", h, i, e, k, act))
        out.add(ActivationSpec.create(act, "bf16", i))
        out.add(TopKSumSpec("bf16", k, h))
    return out


def build(out: str) -> None:
    from benchmarks.variants import build_variant_bundle

    build_variant_bundle("tune-moe", [s.key() for s in specs()], out, "benchmarks/tune_moe.py")


def run(bundle_path: str, json_path: str | None) -> None:
    import torch

    from benchmarks.common import device_us
    from benchmarks.gemm import random_packed
    from benchmarks.moe import MODELS
    from cuteaot.runtime import load_bundle
    from cuteaot.runtime.moe import MoeLayer

    bundle = load_bundle(bundle_path)
    rows = []
    print(f"{'model':14s} {'M':>3s} {'decode us':>10s} {'packed us':>10s}  max rel diff")
    for model, (h, i, e, k, act) in MODELS.items():
        w13, w2 = random_packed(e, 2 * i, h), random_packed(e, h, i)
        layers = {}
        for name, limit in (("decode", 8), ("packed", 0)):
            with decode_max_m(limit):
                layers[name] = MoeLayer(bundle, w13, w2, top_k=k, activation=act, max_tokens=16)
                for m in MS:
                    layers[name].resolve(m)  # plans cached now, under this limit
        for m in MS:
            g = torch.Generator().manual_seed(m)
            ids = torch.rand(m, e, generator=g).topk(k, dim=1).indices.to(torch.int32).cuda()
            w = torch.softmax(torch.randn(m, k, generator=g), 1).cuda()
            x = torch.randn(m, h, generator=g).to(torch.bfloat16).cuda()
            outs, times = {}, {}
            for name, layer in layers.items():
                out = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
                times[name] = device_us(lambda layer=layer, out=out: layer(x, w, ids, out=out))
                outs[name] = layer(x, w, ids).float()
            diff = float((outs["decode"] - outs["packed"]).norm() / outs["packed"].norm())
            rows.append({"model": model, "M": m, **{f"{n}_us": t for n, t in times.items()}, "rel_diff": diff})
            print(f"{model:14s} {m:3d} {times['decode']:10.1f} {times['packed']:10.1f}  {diff:.1e}", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=("build", "run"))
    ap.add_argument("--out", default="generated")
    ap.add_argument("--bundle", default="generated/tune-moe")
    ap.add_argument("--json")
    args = ap.parse_args()
    build(args.out) if args.cmd == "build" else run(args.bundle, args.json)


if __name__ == "__main__":
    main()
