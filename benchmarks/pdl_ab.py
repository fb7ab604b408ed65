"""The MoE layer with and without programmatic dependent launch (PDL), on identical operands, in one process.

    python -m benchmarks.pdl_ab [--bundle generated/moe-models] [--models qwen3-30b-a3b,...]
                                [--m 1,8,64,256,1024,4096] [--rounds 5] [--weights nvfp4|modelopt] [--json F]

One MoeLayer per model (random ModelOpt NVFP4 weights, packed or read as stored), one uniform routing
per M; each call is captured twice, once with every kernel launched plainly and once with the kernels
that wait for their predecessors launched with programmatic stream serialization
(`cuteaot.runtime.bundle.set_programmatic_launch`), and the two are timed interleaved
(benchmarks/common.FlushedTimer: each call replayed from a one-call CUDA graph after an untimed L2 flush,
nothing subtracted; medians). The two outputs must agree (‖pdl−plain‖/‖plain‖ ≤ 5e-3; only the order of
atomic adds may differ): the kernels are the same, only when their CTAs launch differs.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import FlushedTimer, comma_list, run_layers, uniform_routing, write_results
from benchmarks.compare_layer import _layer, _prepared, _problems, random_layer_weights
from cuteaot.runtime.bundle import set_programmatic_launch
from tests.reference.moe_elementwise import relative_error

# The outputs may differ in the last bits: the decode path and the folded top-k sum add rows with atomics.
SAME = 5e-3


class _Launching:
    """A layer called with programmatic launch on or off (the setting is restored after each call)."""

    def __init__(self, layer, programmatic: bool):
        self.layer, self.programmatic = layer, programmatic

    def __call__(self, *args, **kwargs):
        previous = set_programmatic_launch(self.programmatic)
        try:
            return self.layer(*args, **kwargs)
        finally:
            set_programmatic_launch(previous)


def compare(bundle, models, ms, rounds, weights: str) -> list[dict]:
    problems = _problems(bundle, weights)
    names = [m for m in (models or sorted(problems)) if m in problems]
    if models and len(names) != len(models):
        raise SystemExit(f"not in the bundle: {sorted(set(models) - set(names))}; it has {sorted(problems)}")
    timer = FlushedTimer()
    rows = []
    for name in names:
        f = problems[name]
        g = torch.Generator(device="cuda").manual_seed(len(name))
        w13, w2 = _prepared(f, *random_layer_weights(f, g, weights), weights)
        layer = _layer(bundle, f, w13, w2)
        variants = {"plain": _Launching(layer, False), "pdl": _Launching(layer, True)}
        for m in ms:
            x, w, ids = uniform_routing(m, f["hidden_size"], f["num_experts"], f["top_k"], g)
            _, outs = run_layers(variants, x, w, ids, eager=True)
            diff = relative_error(outs["pdl"], outs["plain"])
            if not diff <= SAME:
                raise SystemExit(f"{name} M={m}: the outputs with and without PDL differ (rel. {diff:.1e})")
            timed, _ = run_layers(variants, x, w, ids, timer=timer, rounds=rounds)
            plain, pdl = timed["plain"]["us"], timed["pdl"]["us"]
            row = {"model": name, "M": m, "plain_us": plain, "pdl_us": pdl, "ratio": pdl / plain, "rel_diff": diff,
                   "plan": layer.resolve(m).describe()}
            rows.append(row)
            print(f"{name:22s} M={m:5d} plain {plain:8.1f} us  pdl {pdl:8.1f} us  ({pdl / plain:.3f})  {row['plan']}",
                  flush=True)
        del layer, w13, w2
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="generated/moe-models")
    p.add_argument("--models", default="", type=comma_list())
    p.add_argument("--m", default="1,8,64,256,1024,4096", type=comma_list(int))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--weights", default="nvfp4", choices=("nvfp4", "modelopt"))
    p.add_argument("--commit", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from cuteaot.runtime import load_bundle

    rows = compare(load_bundle(args.bundle), args.models, args.m, args.rounds, args.weights)
    print("\n| model | M | plain µs | PDL µs | PDL / plain | plan |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['M']} | {r['plain_us']:.1f} | {r['pdl_us']:.1f} | {r['ratio']:.3f} | {r['plan']} |")
    if args.json:
        write_results(args.json, "pdl-ab", args.commit,
                      "same MoeLayer, launches plain vs programmatic (PDL), CUDA-graph replay, L2 flushed, "
                      f"medians of {args.rounds} interleaved rounds", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
