"""How much of a layer call route packing takes: the layer, and `pack_routes` alone on the same ids and
block size, timed alike (benchmarks/common.FlushedTimer: one-call CUDA-graph replays after an untimed L2
flush, nothing subtracted, interleaved; medians).

    python -m benchmarks.route_pack_share [--bundle generated/moe-models] [--models qwen3-30b-a3b,...]
                                          [--m 64,256,1024,4096,16384] [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import FlushedTimer, comma_list, uniform_routing
from benchmarks.compare_layer import _layer, _prepared, _problems, random_layer_weights
from cuteaot.runtime.kernels.route_pack import RouteChunking, max_packed_route_slots, pack_routes, route_pack_workspace


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="generated/moe-models")
    p.add_argument("--models", default="qwen3-30b-a3b,glm-4.5-air", type=comma_list())
    p.add_argument("--m", default="64,256,1024,4096,16384", type=comma_list(int))
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    from cuteaot.runtime import load_bundle

    bundle = load_bundle(args.bundle)
    problems = _problems(bundle)
    timer = FlushedTimer()
    print("| model | M | routes | route-pack stage (CTAs) | layer µs | route packing µs | share | plan |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in args.models:
        f = problems[name]
        g = torch.Generator(device="cuda").manual_seed(len(name))
        layer = _layer(bundle, f, *_prepared(f, *random_layer_weights(f, g), "nvfp4"))
        e = f["num_experts"]
        for m in args.m:
            x, w, ids = uniform_routing(m, f["hidden_size"], e, f["top_k"], g)
            r = layer.resolve(m)
            if r.decode:
                continue  # no route packing
            block, routes = r.launch.route_block, m * f["top_k"]
            slots = max_packed_route_slots(routes, block, e)
            bufs = dict(packed_route_indices=torch.empty(slots, dtype=torch.int32, device="cuda"),
                        block_expert_ids=torch.empty(slots // block, dtype=torch.int32, device="cuda"),
                        packed_route_count=torch.empty(1, dtype=torch.int32, device="cuda"),
                        workspace=route_pack_workspace(routes, e, "cuda"))
            out = torch.empty_like(x)
            us = timer.us({"layer": lambda layer=layer: layer(x, w, ids, out=out),
                           "pack": lambda: pack_routes(bundle, ids, e, block, **bufs)}, args.rounds)
            chunking = RouteChunking.for_routes(routes)
            stage = "single" if chunking.single else f"multi x{chunking.num_chunks}"
            print(f"| {name} | {m} | {routes} | {stage} | {us['layer']:.1f} | {us['pack']:.1f} | "
                  f"{us['pack'] / us['layer']:.1%} | {r.describe()} |", flush=True)
        del layer
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
