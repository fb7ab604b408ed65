"""A/B-test two builds of the fused MoE layer on identical operands, in one process.

    python -m benchmarks.compare_layer --base generated/pf-off/bench-decode --new generated/pf-24m/bench-decode
                                       [--models qwen3-30b-a3b,...] [--m 1,2] [--rounds 5]

The layer-level twin of benchmarks/compare_gemm.py: every MoE layer problem the two bundles share
(plain variant: no expert map, no calibration, no bias, not deterministic) gets random NVFP4 weights
and, per M, one routing (uniform top-k) and one input; a MoeLayer of each bundle runs them.  Their
outputs are compared (‖new−base‖/‖base‖), then timed in interleaved rounds: each round times base
then new with `device_us` (CUDA-graph replay of an L2 flush and the call, the flush's own time
subtracted), and the median over rounds is reported with new / base.  Rounds interleave so that
clock and thermal drift hit both alike; judge a change by new / base within one call.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import FlushedTimer, comma_list, uniform_routing
from tests.reference.nvfp4 import random_nvfp4



def _problems(bundle) -> dict[str, dict]:
    out = {}
    for row in bundle.manifest["resolution"]:
        f = row["facts"]
        if row["op"] != "moe_layer" or f.get("expert_map") or f.get("calibration") or f.get("bias") \
                or f.get("deterministic") or row["profile"] != bundle.profile.name:
            continue
        out[row["problem"]] = f
    return out


def _layer(bundle, facts, w13, w2):
    from cuteaot.runtime import MoeLayer

    return MoeLayer(bundle, w13, w2, top_k=facts["top_k"], activation=facts["activation"],
                    swiglu_alpha=facts.get("swiglu_alpha"), swiglu_beta=facts.get("swiglu_beta"),
                    swiglu_limit=facts.get("swiglu_limit"), fast_math=facts.get("fast_math", True))


def compare(base, new, models, ms, rounds) -> list[dict]:
    from cuteaot.runtime import prepare_w2, prepare_w13

    shared = _problems(base).keys() & _problems(new).keys()
    names = [m for m in (models or sorted(shared)) if m in shared]
    missing = sorted(set(models or []) - shared)
    if missing:
        raise SystemExit(f"not in both bundles: {missing}; shared: {sorted(shared)}")
    timer = FlushedTimer()
    rows = []
    for name in names:
        f = _problems(base)[name]
        h, i, e, k = f["hidden_size"], f["intermediate_size"], f["num_experts"], f["top_k"]
        n1 = 2 * i if f["activation"] != "relu2" else i
        g = torch.Generator(device="cuda").manual_seed(len(name))
        w13 = prepare_w13(*random_nvfp4(e, n1, h, g), "bf16")
        w2 = prepare_w2(*random_nvfp4(e, h, i, g), "bf16")
        layers = {"base": _layer(base, f, w13, w2), "new": _layer(new, f, w13, w2)}
        for m in ms:
            x, w, ids = uniform_routing(m, h, e, k, g)
            outs = {n: torch.full((m, h), float("nan"), dtype=torch.bfloat16, device="cuda") for n in layers}
            for n, layer in layers.items():
                layer(x, w, ids, out=outs[n])
            diff = float((outs["new"].float() - outs["base"].float()).norm() / outs["base"].float().norm())
            us = timer.us({n: (lambda layer=layer, o=outs[n]: layer(x, w, ids, out=o)) for n, layer in layers.items()},
                          rounds)
            row = {"model": name, "M": m, "base_us": us["base"], "new_us": us["new"], "rel_diff": diff,
                   "base_plan": layers["base"].resolve(m).describe(), "new_plan": layers["new"].resolve(m).describe()}
            row["ratio"] = row["new_us"] / row["base_us"]
            rows.append(row)
            print(f"{name:22s} M={m:5d} base {row['base_us']:8.1f} us  new {row['new_us']:8.1f} us  "
                  f"new/base {row['ratio']:.3f}  diff {diff:.1e}", flush=True)
        del layers, w13, w2
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--models", default="", type=comma_list())
    p.add_argument("--m", default="1,2", type=comma_list(int))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from cuteaot.runtime import load_bundle

    rows = compare(load_bundle(args.base), load_bundle(args.new), args.models, args.m, args.rounds)
    print("\n| model | M | base µs | new µs | new / base | ‖new−base‖/‖base‖ |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['M']} | {r['base_us']:.1f} | {r['new_us']:.1f} | {r['ratio']:.3f} | "
              f"{r['rel_diff']:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"base": args.base, "new": args.new, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
