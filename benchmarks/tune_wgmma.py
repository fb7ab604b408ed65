"""Large-M wgmma tiles head to head: 64-row blocks (256- or 128-wide tile) against 128-row blocks.

    python -m benchmarks.tune_wgmma build [--out generated]   # on the builder (needs CuTeDSL)
    python -m benchmarks.tune_wgmma run [--bundle generated/tune-wgmma]   # on the GPU

For each shape at M = 4096 the routes are packed for each block size and each variant runs
on its own grid; the planner picks 128-row blocks once routes >= 128 * experts
(planning.WGMMA_TALL_BLOCK).  Prints median device µs and TFLOP/s.
"""

from __future__ import annotations

import argparse

from benchmarks.tune_gemm import SHAPES

M = 4096
VARIANTS = {  # name: (moe_block_size, tile_n, blocks_per_sm)
    "b64 256x64 2/SM": (64, 256, 2),
    "b128 128x64 2/SM": (128, 128, 2),
}


def specs():
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

    return {(shape, name): GemmSpec(dtype="bf16", n=n, k=k, top_k=1 if per_route else top_k, tile_n=tile_n, tile_k=64,
                                    moe_block_size=block, blocks_per_sm=bps, mul_topk_weights=per_route,
                                    mainloop="wgmma")
            for shape, (n, k, top_k, _, per_route) in SHAPES.items()
            for name, (block, tile_n, bps) in VARIANTS.items() if n % tile_n == 0}


def run(bundle_path: str) -> None:
    from benchmarks.gemm import random_packed, routed_inputs
    from benchmarks.tune_gemm import _time_variant
    from cuteaot.runtime import load_bundle, pack_routes
    from cuteaot.codegen.kernels.w4a16.planning import plan_for
    from cuteaot.runtime.kernels.w4a16.gemm import GemmWorkspace

    bundle = load_bundle(bundle_path)
    sms = bundle.profile.sm_count
    for shape, (n, k, top_k, experts, per_route) in SHAPES.items():
        packed = random_packed(experts, n, k)
        ids, topk_w, a = routed_inputs(M, k, top_k, experts, per_route)
        plan = plan_for(M, n, k, top_k, experts, bundle.profile)  # split-K scratch for any variant's tail
        ws = GemmWorkspace.allocate({"lock_slots": 8 * sms, "c_tmp_floats": 8 * sms * 128 * 256,
                                         "route_slots": plan.max_route_slots, "route_blocks": plan.max_route_blocks},
                                        M * top_k, experts, "cuda")  # room for every variant's grid
        for name, (block, tile_n, bps) in VARIANTS.items():
            if n % tile_n:
                continue
            r_idx, b_exp, r_cnt = pack_routes(bundle, ids, experts, block)  # buffers sized for this block
            operands = dict(a=a, packed=packed, r_idx=r_idx, b_exp=b_exp, r_cnt=r_cnt, topk_w=topk_w, ws=ws,
                            out_shape=(M * top_k, n))
            timed = _time_variant(bundle, specs()[(shape, name)], sms * bps, operands, M * top_k if per_route else M)
            if timed is not None:
                us = timed[0]
                print(f"{shape:15s} M={M} {name:18s} {us:8.1f} us {2 * M * top_k * n * k / us / 1e6:6.1f} TF/s",
                      flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["build", "run"])
    ap.add_argument("--out", default="generated")
    ap.add_argument("--bundle", default="generated/tune-wgmma")
    args = ap.parse_args()
    if args.mode == "build":
        from benchmarks.variants import build_variant_bundle

        build_variant_bundle("tune-wgmma", [s.key() for s in specs().values()], args.out, "benchmarks/tune_wgmma.py")
    else:
        run(args.bundle)


if __name__ == "__main__":
    main()
