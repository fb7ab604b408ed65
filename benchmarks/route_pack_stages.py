"""Route packing alone, single-CTA stage against the multi-CTA one at several chunk sizes, per route count.

    python -m benchmarks.route_pack_stages [--bundle generated/moe-models] [--experts 128] [--top-k 8]
                                           [--routes 512,1024,2048,4096,8192,32768,131072] [--rounds 5]

Each variant sets the planner's constants (`SINGLE_CTA_MAX_ROUTES`, `MULTI_MIN_CHUNK` of
cuteaot.runtime.kernels.route_pack) for its calls; every output is checked against the plain-torch
reference first; then the variants are timed interleaved (benchmarks/common.FlushedTimer: each call
replayed from a one-call CUDA graph after an untimed L2 flush, nothing subtracted; medians).  Uniform
top-k routing.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import cuteaot.runtime.kernels.route_pack as rp
from benchmarks.common import FlushedTimer, comma_list, uniform_routing
from tests.reference.route_pack import pack_routes_reference

# label -> (SINGLE_CTA_MAX_ROUTES, MULTI_MIN_CHUNK)
VARIANTS = {"single up to 4096": (4096, 2048), "multi, chunks of 2048": (0, 2048),
            "multi, chunks of 1024": (0, 1024), "multi, chunks of 512": (0, 512)}


@contextlib.contextmanager
def planned(single_max: int, min_chunk: int):
    saved = rp.SINGLE_CTA_MAX_ROUTES, rp.MULTI_MIN_CHUNK
    rp.SINGLE_CTA_MAX_ROUTES, rp.MULTI_MIN_CHUNK = single_max, min_chunk
    try:
        yield
    finally:
        rp.SINGLE_CTA_MAX_ROUTES, rp.MULTI_MIN_CHUNK = saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="generated/moe-models")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--routes", default="512,1024,2048,4096,8192,32768,131072", type=comma_list(int))
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    from cuteaot.runtime import load_bundle

    bundle = load_bundle(args.bundle)
    e, k, b = args.experts, args.top_k, args.block
    g = torch.Generator(device="cuda").manual_seed(0)
    timer = FlushedTimer()
    print(f"| routes (E = {e}, top-{k}, b = {b}) | " + " | ".join(VARIANTS) + " |")
    print("| ---: | " + " | ".join("---:" for _ in VARIANTS) + " |")
    for routes in args.routes:
        _, _, ids = uniform_routing(routes // k, 64, e, k, g)
        calls = {}
        for label, (single_max, min_chunk) in VARIANTS.items():
            with planned(single_max, min_chunk):
                slots = rp.max_packed_route_slots(routes, b, e)
                bufs = dict(packed_route_indices=torch.empty(slots, dtype=torch.int32, device="cuda"),
                            block_expert_ids=torch.empty(slots // b, dtype=torch.int32, device="cuda"),
                            packed_route_count=torch.empty(1, dtype=torch.int32, device="cuda"),
                            workspace=rp.route_pack_workspace(routes, e, "cuda"))
                outs = rp.pack_routes(bundle, ids, e, b, **bufs)
                want = pack_routes_reference(ids.cpu(), e, b, slots, slots // b)
                if not all(torch.equal(o.cpu(), w) for o, w in zip(outs, want)):
                    raise SystemExit(f"{label}: {routes} routes packed wrong")

            def call(bufs=bufs, single_max=single_max, min_chunk=min_chunk):
                with planned(single_max, min_chunk):
                    rp.pack_routes(bundle, ids, e, b, **bufs)

            calls[label] = call
        us = timer.us(calls, args.rounds)
        print(f"| {routes} | " + " | ".join(f"{us[label]:.1f}" for label in VARIANTS) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
