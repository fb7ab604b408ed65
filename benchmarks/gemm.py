"""Grouped W4A16 GEMM (FC1, FC2) of real MoE layers vs torch._grouped_mm on bf16 weights.

For each model and M: our GEMM through the runtime on routes packed beforehand
(`pack_gemm_routes`, as a layer packs once for FC1 and FC2), the route packing on
its own, the two in one call, and torch._grouped_mm on bf16 weights of the same
shapes for the same routing (rows pre-sorted by expert, so its number excludes
the sorting and the gather/scatter).  % HBM is of the GEMM alone.
Effective bandwidth = bytes of the weights of the experts actually hit / time;
TFLOP/s = 2 * routes * N * K / time.  Rooflines: weight bytes / measured HBM copy
bandwidth and FLOPs / measured bf16 tensor-core rate (a large torch.matmul).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.common import device_us, hbm_copy_bandwidth
from cuteaot.runtime import GemmWorkspace, load_bundle, pack_gemm_routes, pack_nvfp4, w4a16_moe_gemm
from cuteaot.runtime.kernels.w4a16.gemm import gemm_entry
from tests.reference.nvfp4 import quantize_nvfp4

MODELS = {  # name: (hidden, intermediate, experts, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "gpt-oss-120b": (2880, 2880, 128, 4),  # NVFP4 weights (MXFP4 is a later layout), zero-padded storage
}
MS = [1, 8, 64, 512, 4096]


def tensor_core_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = device_us(lambda: torch.mm(a, b), iters=10, reps=5)
    return 2 * 8192**3 / (us * 1e-6)


def random_packed(experts: int, n: int, k: int):
    # Quantize one expert's random weights and repeat (quantizing 128 large experts on the host is slow).
    # Packing runs on the GPU: 128 experts of gpt-oss FC1 are 1 GB of packed words.
    q = quantize_nvfp4(torch.randn(1, n, k) * 0.05)
    w, s, s2 = (t.cuda().expand(experts, *t.shape[1:]).contiguous() for t in q)
    return pack_nvfp4(w, s, s2, "bf16")


def routed_inputs(m: int, k: int, top_k: int, experts: int, per_route: bool):
    """Random routing seeded by M (uniform over experts), router weights and bf16 input rows:
    (topk_ids int32, topk_weights, a) with M token rows, or M * top_k route rows for FC2."""
    g = torch.Generator().manual_seed(m)
    ids = torch.rand(m, experts, generator=g).topk(top_k, dim=1).indices.to(torch.int32).cuda()
    topk_w = torch.rand(m, top_k, device="cuda")
    a = torch.randn(m * top_k if per_route else m, k, device="cuda", dtype=torch.bfloat16)
    return ids, topk_w, a


class Problem:
    """One GEMM of a model's MoE layer at M tokens, on random data: FC1 reads token rows, FC2 one
    row per route and multiplies the router weight."""

    def __init__(self, model: str, which: str, m: int):
        hidden, inter, self.experts, self.top_k = MODELS[model]
        self.n, self.k = (2 * inter, hidden) if which == "fc1" else (hidden, inter)
        self.per_route = which == "fc2"
        self.packed = random_packed(self.experts, self.n, self.k)
        self.ids, self.topk_w, self.a = routed_inputs(m, self.k, self.top_k, self.experts, self.per_route)
        self.m = m

    @property
    def weight_bytes(self) -> int:
        """Bytes of packed weights, scales and global scale of the experts the routing hits."""
        hit = int(torch.unique(self.ids).numel())
        return hit * (self.n * self.k // 2 + self.n * self.k // 16 + 4)

    def gemm(self, bundle) -> "GemmRun":
        """Our GEMM on these operands: the bundle's launch for this M, a workspace and an output."""
        launch = gemm_entry(bundle, self.packed, self.top_k).launch(self.m)
        workspace = GemmWorkspace.allocate(launch.sizes, self.m * self.top_k, self.experts, "cuda")
        return GemmRun(self, bundle, launch, workspace,
                       torch.empty(self.m * self.top_k, self.n, device="cuda", dtype=torch.bfloat16))


class GemmRun:
    """A Problem bound to a bundle: `run(routes=None)` launches the GEMM into `out`."""

    def __init__(self, p: Problem, bundle, launch, workspace, out):
        self.p, self.bundle, self.launch, self.workspace, self.out = p, bundle, launch, workspace, out

    def describe(self) -> str:
        """The launch the table chose: route handling, main loop, tile and CTAs per SM (kernel facts)."""
        kernel = self.bundle.kernel_by_digest(next(iter(self.launch.kernels.values())))
        f = kernel.record.key.facts
        route = " direct" if self.launch.direct else ""
        wg = " wgmma" if f.get("mainloop") == "wgmma" else ""
        return f"b{f['moe_block_size']}{route}{wg} {f['tile_n']}x{f['tile_k']} {f['blocks_per_sm']}/SM"

    def run(self, routes=None):
        p = self.p
        return w4a16_moe_gemm(self.bundle, p.a, p.packed, p.ids, topk_weights=p.topk_w, mul_topk_weights=p.per_route,
                              a_per_route=p.per_route, out=self.out, workspace=self.workspace, routes=routes)

    def pack_routes(self):
        return pack_gemm_routes(self.bundle, self.p.ids, self.p.packed, workspace=self.workspace)


def bench(bundle, model: str, which: str, m: int, hbm: float, tc: float) -> dict:
    p = Problem(model, which, m)
    experts, top_k, n, k, ids = p.experts, p.top_k, p.n, p.k, p.ids
    g = p.gemm(bundle)
    with_packing = device_us(g.run)
    routes = g.pack_routes()
    ours = device_us(lambda: g.run(routes))
    packing = device_us(g.pack_routes) if routes.block_size else 0.0
    hit = int(torch.unique(ids).numel())
    weight_bytes = p.weight_bytes
    flops = 2 * m * top_k * n * k

    # peer: torch._grouped_mm on bf16 weights, rows sorted by expert
    counts = torch.bincount(ids.view(-1).long(), minlength=experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = torch.randn(m * top_k, k, device="cuda", dtype=torch.bfloat16)
    w_bf16 = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    try:
        peer = device_us(lambda: torch._grouped_mm(rows, w_bf16, offs=offs))
    except Exception as exc:  # noqa: BLE001 - report why the peer could not run
        print(f"torch._grouped_mm failed for {model} {which} M={m}: {exc}", file=sys.stderr)
        peer = float("nan")
    peer_bytes = hit * n * k * 2
    return {
        "model": model, "gemm": which, "M": m, "N": n, "K": k, "experts_hit": hit,
        "plan": g.describe(),
        "us": ours, "route_pack_us": packing, "with_packing_us": with_packing, "GB/s": weight_bytes / ours / 1e3, "TFLOP/s": flops / ours / 1e6,
        "pct_hbm": 100 * weight_bytes / hbm / (ours * 1e-6),
        "roofline_us": max(weight_bytes / hbm, flops / tc) * 1e6,
        "torch_grouped_mm_bf16_us": peer, "torch_GB/s": peer_bytes / peer / 1e3, "torch_TFLOP/s": flops / peer / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="generated/bench-gemm")
    ap.add_argument("--json")
    ap.add_argument("--m", type=int, nargs="*", default=MS, help="token counts to run (default: all)")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args()
    bundle = load_bundle(args.bundle)
    hbm, tc = hbm_copy_bandwidth(), tensor_core_rate()
    print(f"HBM copy {hbm / 1e12:.2f} TB/s, bf16 mm {tc / 1e12:.0f} TFLOP/s")
    rows = []
    for model in args.models:
        for which in ("fc1", "fc2"):
            for m in args.m:
                r = bench(bundle, model, which, m, hbm, tc)
                rows.append(r)
                print(f"{model:16s} {which} M={m:5d} {r['plan']:22s} {r['us']:8.1f} us (pack {r['route_pack_us']:4.1f}, "
                      f"both {r['with_packing_us']:7.1f}) {r['GB/s']:7.0f} GB/s "
                      f"({r['pct_hbm']:5.1f}% HBM) {r['TFLOP/s']:6.1f} TF/s | roofline {r['roofline_us']:7.1f} us | "
                      f"torch bf16 {r['torch_grouped_mm_bf16_us']:8.1f} us {r['torch_TFLOP/s']:6.1f} TF/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hbm_Bps": hbm, "tc_flops": tc, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
