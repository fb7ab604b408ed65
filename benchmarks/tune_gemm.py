"""Try GEMM kernel variants (tile, CTAs/SM, pipeline depth, split-K for 8-row blocks) on real shapes.

    python -m benchmarks.tune_gemm build [--out generated]   # on the builder (needs CuTeDSL)
    python -m benchmarks.tune_gemm run [--bundle generated/tune-gemm] [--json F]   # on the GPU

`build` compiles every variant into one bundle; `run` launches each variant for
the shapes and token counts below with the planner's routes but the variant's
kernel and grid, checks it against the planner's own choice, and prints the
median device time and the share of HBM bandwidth.  The winners go into
codegen/kernels/w4a16/planning.py; this tool is how they were found.
"""

from __future__ import annotations

import argparse
import json

SHAPES = {  # name: (n, k, top_k, experts, a_per_route)
    "qwen3-30b fc1": (1536, 2048, 8, 128, False),
    "qwen3-30b fc2": (2048, 768, 8, 128, True),
    "qwen3-235b fc1": (3072, 4096, 8, 128, False),
    "gpt-oss fc2": (2944, 2944, 4, 128, True),  # stored (zero-padded) sizes of 2880 x 2880
}
MS = (1, 8, 64)
# name: (tile_n, tile_k, blocks_per_sm, stages, whole_tiles_m8) for 8-row blocks (M <= 115 here)
VARIANTS = {
    "seed": (128, 128, 1, 4, True),
    "splitk": (128, 128, 1, 4, False),
    "splitk 2/SM": (128, 128, 2, 4, False),
    "splitk 2/SM 8st": (128, 128, 2, 8, False),
    "whole 2/SM 8st": (128, 128, 2, 8, True),
    "n128k64 4/SM": (128, 64, 4, 4, False),
    "n128k64 3/SM 8st": (128, 64, 3, 8, False),
    "n64k128 4/SM": (64, 128, 4, 4, False),
    "n128k64 5/SM": (128, 64, 5, 4, False),
    "n128k64 5/SM 6st": (128, 64, 5, 6, False),
    "n128k128 3/SM": (128, 128, 3, 4, False),
}


# Large M (block 64, M = 4096): name -> (tile_n, tile_k, blocks_per_sm, stages)
LARGE_MS = (512, 4096)
LARGE_VARIANTS = {
    "n128k64 2/SM": (128, 64, 2, 4),
    "n128k64 2/SM 3st": (128, 64, 2, 3),
    "n128k64 1/SM 6st": (128, 64, 1, 6),
    "n256k64 1/SM": (256, 64, 1, 4),
    "n64k128 2/SM": (64, 128, 2, 4),
}


def large_specs(block: int):
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

    specs = []
    for n, k, top_k, _, per_route in SHAPES.values():
        for tile_n, tile_k, bps, stages in LARGE_VARIANTS.values():
            specs.append(GemmSpec(
                dtype="bf16", n=n, k=k, top_k=1 if per_route else top_k, tile_n=tile_n, tile_k=tile_k,
                moe_block_size=block, blocks_per_sm=bps, mul_topk_weights=per_route, stages=stages,
            ))
    return specs


def variant_specs():
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

    specs = []
    for n, k, top_k, _, per_route in SHAPES.values():
        for routes in ("direct", "packed"):
            for tile_n, tile_k, bps, stages, whole in VARIANTS.values():
                specs.append(GemmSpec(
                    dtype="bf16", n=n, k=k, top_k=1 if per_route else top_k, tile_n=tile_n, tile_k=tile_k,
                    moe_block_size=8, blocks_per_sm=bps, mul_topk_weights=per_route, routes=routes,
                    stages=stages, whole_tiles_m8=whole,
                ))
    return specs


def build(out: str, small_only: bool) -> None:
    from benchmarks.variants import build_variant_bundle

    specs = variant_specs() + ([] if small_only else large_specs(48) + large_specs(64))
    build_variant_bundle("tune-gemm", [s.key() for s in specs], out, "benchmarks/tune_gemm.py")


def _time_variant(bundle, spec, grid: int, operands: dict, tokens: int, **timing):
    """Launch one GEMM variant on fixed operands: (device us, output as float32), or None if it is
    not co-resident on this GPU (reported, not run)."""
    import torch

    from benchmarks.common import device_us
    from cuteaot.runtime import LaunchError
    from cuteaot.runtime.kernels.w4a16.gemm import PersistentLaunch

    try:
        launch = PersistentLaunch(bundle, spec)
    except LaunchError as exc:
        print(f"  {spec.key().describe()} skipped: {exc}", flush=True)
        return None
    o = operands
    out = torch.full(o["out_shape"], float("nan"), device="cuda", dtype=torch.bfloat16)

    def call():
        launch.kernel.launch(
            grid, torch.cuda.current_stream().cuda_stream,
            a=o["a"].data_ptr(), qweight=o["packed"].qweight.data_ptr(), out=out.data_ptr(),
            scales=o["packed"].scales.data_ptr(), global_scale=o["packed"].global_scale.data_ptr(),
            route_indices=o["r_idx"].data_ptr(), block_experts=o["b_exp"].data_ptr(), route_count=o["r_cnt"].data_ptr(),
            topk_weights=o["topk_w"].data_ptr(), c_tmp=o["ws"].c_tmp.data_ptr(), locks=o["ws"].locks.data_ptr(),
            tokens=tokens, num_experts=o["packed"].num_experts,
        )

    call()
    torch.cuda.synchronize()
    return device_us(call, **timing), out.float()


def run(bundle_path: str, json_path: str | None, small_only: bool) -> None:
    import torch

    from benchmarks.common import hbm_copy_bandwidth
    from benchmarks.gemm import random_packed, routed_inputs
    from cuteaot.runtime import load_bundle, pack_routes
    from cuteaot.codegen.kernels.w4a16.planning import plan_for
    from cuteaot.runtime.kernels.w4a16.gemm import GemmWorkspace
    from cuteaot.runtime.kernels.w4a16.gemm_spec import Routes

    bundle = load_bundle(bundle_path)
    hbm = hbm_copy_bandwidth()
    sms = bundle.profile.sm_count
    specs = variant_specs()
    rows = []
    for shape, (n, k, top_k, experts, per_route) in SHAPES.items():
        packed = random_packed(experts, n, k)
        for m in MS:
            ids, topk_w, a = routed_inputs(m, k, top_k, experts, per_route)
            plan = plan_for(m, n, k, top_k, experts, bundle.profile)
            ws = GemmWorkspace.allocate({"lock_slots": 8 * sms, "c_tmp_floats": 8 * sms * 16 * 256,
                                             "route_slots": plan.max_route_slots, "route_blocks": plan.max_route_blocks},
                                            m * top_k, experts, "cuda")  # room for every variant's grid
            routes = "direct" if plan.direct_topk_routes else "packed"
            if routes == "direct":
                r_idx = b_exp = r_cnt = ids
            else:
                r_idx, b_exp, r_cnt = pack_routes(bundle, ids, experts, 8,
                                                  packed_route_indices=ws.route_indices,
                                                  block_expert_ids=ws.block_experts,
                                                  packed_route_count=ws.route_count, workspace=ws.route_pack)
            hit = int(torch.unique(ids).numel())
            weight_bytes = hit * (n * k // 2 + n * k // 16 + 4)
            reference = None
            for name, (tile_n, tile_k, bps, stages, whole) in VARIANTS.items():
                spec = next(s for s in specs if s.n == n and s.k == k and s.routes is Routes(routes)
                            and (s.tile_n, s.tile_k, s.blocks_per_sm, s.stages, s.whole_tiles_m8)
                            == (tile_n, tile_k, bps, stages, whole))
                operands = dict(a=a, packed=packed, r_idx=r_idx, b_exp=b_exp, r_cnt=r_cnt, topk_w=topk_w, ws=ws,
                                out_shape=(m * top_k, n))
                timed = _time_variant(bundle, spec, sms * bps, operands, m * top_k if per_route else m)
                if timed is None:
                    continue
                us, out = timed
                reference = out if reference is None else reference
                diff = float((out - reference).abs().max())
                row = {"shape": shape, "M": m, "variant": name, "us": us,
                       "pct_hbm": 100 * weight_bytes / hbm / (us * 1e-6), "max_diff_vs_seed": diff}
                rows.append(row)
                print(f"{shape:15s} M={m:3d} {name:18s} {us:8.1f} us {row['pct_hbm']:5.1f}% HBM  diff {diff:.2e}",
                      flush=True)
    if not small_only:
        rows += run_large(bundle, hbm)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"hbm_Bps": hbm, "rows": rows}, f, indent=1)


def run_large(bundle, hbm) -> list[dict]:
    """Large-M variants: the planner's route block size, each variant's tile, grid and depth."""
    from benchmarks.gemm import random_packed, routed_inputs
    from cuteaot.runtime import pack_routes
    from cuteaot.codegen.kernels.w4a16.planning import plan_for
    from cuteaot.runtime.kernels.w4a16.gemm import GemmWorkspace

    sms = bundle.profile.sm_count
    rows = []
    for shape, (n, k, top_k, experts, per_route) in SHAPES.items():
        packed = random_packed(experts, n, k)
        for m in LARGE_MS:
            plan = plan_for(m, n, k, top_k, experts, bundle.profile)
            specs = large_specs(plan.moe_block_size)
            ids, topk_w, a = routed_inputs(m, k, top_k, experts, per_route)
            ws = GemmWorkspace.allocate({"lock_slots": 8 * sms, "c_tmp_floats": 8 * sms * 64 * 256,
                                             "route_slots": plan.max_route_slots, "route_blocks": plan.max_route_blocks},
                                            m * top_k, experts, "cuda")  # room for every variant's grid
            r_idx, b_exp, r_cnt = pack_routes(bundle, ids, experts, plan.moe_block_size,
                                              packed_route_indices=ws.route_indices,
                                              block_expert_ids=ws.block_experts,
                                              packed_route_count=ws.route_count, workspace=ws.route_pack)
            flops = 2 * m * top_k * n * k
            reference = None
            for name, (tile_n, tile_k, bps, stages) in LARGE_VARIANTS.items():
                spec = next(s for s in specs if s.n == n and s.k == k
                            and (s.tile_n, s.tile_k, s.blocks_per_sm, s.stages) == (tile_n, tile_k, bps, stages))
                operands = dict(a=a, packed=packed, r_idx=r_idx, b_exp=b_exp, r_cnt=r_cnt, topk_w=topk_w, ws=ws,
                                out_shape=(m * top_k, n))
                timed = _time_variant(bundle, spec, sms * bps, operands, m * top_k if per_route else m,
                                      iters=5, reps=5)
                if timed is None:
                    continue
                us, out = timed
                reference = out if reference is None else reference
                diff = float((out - reference).abs().max())
                row = {"shape": shape, "M": m, "variant": name, "us": us, "TFLOP/s": flops / us / 1e6,
                       "max_diff_vs_first": diff}
                rows.append(row)
                print(f"{shape:15s} M={m:5d} b{plan.moe_block_size} {name:18s} {us:8.1f} us "
                      f"{row['TFLOP/s']:6.1f} TF/s  diff {diff:.2e}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["build", "run"])
    ap.add_argument("--out", default="generated")
    ap.add_argument("--bundle", default="generated/tune-gemm")
    ap.add_argument("--json")
    ap.add_argument("--small-only", action="store_true", help="only the 8-row-block variants (M <= 64)")
    args = ap.parse_args()
    build(args.out, args.small_only) if args.mode == "build" else run(args.bundle, args.json, args.small_only)


if __name__ == "__main__":
    main()
