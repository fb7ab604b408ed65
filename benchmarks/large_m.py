"""Large-M study (issue 13): the fused layer against FC1 / FC2 as separate grouped GEMM launches.

For each model and M, on the same weights and routing, CUDA-graph replay (benchmarks/common.py):

* fused: `MoeLayer` (route packing, one persistent FC1 -> activation -> FC2 kernel, top-k sum);
* split: route packing once, the FC1 grouped GEMM (wgmma main loop on sm_90a at large M), the
  activation kernel, the FC2 grouped GEMM (router weights in its epilogue), the top-k sum; the
  intermediate goes through HBM, there is no grid barrier;
* torch bf16: `torch._grouped_mm` on bf16 weights (benchmarks/moe.py's peer).

Each part of the split path is also timed alone, so the table shows where the time goes.  The
planner's choice between the two paths comes from these numbers (docs/benchmarks.md).
Bundles: specs/bench-large-m.yaml (the split path's kernels) and specs/moe-models.yaml (the
fused layer), both built for the h200.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import device_us, hbm_copy_bandwidth
from benchmarks.gemm import random_packed, tensor_core_rate
from benchmarks.moe import torch_bf16_layer
from cuteaot.runtime import (
    GemmWorkspace, load_bundle, moe_activation, moe_topk_sum, pack_gemm_routes, w4a16_moe_gemm,
)
from cuteaot.runtime.kernels.w4a16.gemm import gemm_entry
from cuteaot.runtime.moe import MoeLayer

MODELS = {  # name: (hidden, intermediate, experts, top_k, activation)
    "qwen3-30b-a3b": (2048, 768, 128, 8, "silu"),
    "gpt-oss-120b": (2880, 2880, 128, 4, "swigluoai"),
    "glm-4.5-air": (4096, 1408, 128, 8, "silu"),
}
MS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class SplitLayer:
    """The MoE layer as five launches of the public ops, every buffer allocated up front."""

    def __init__(self, bundle, w13, w2, top_k: int, activation: str, max_tokens: int):
        self.bundle, self.w13, self.w2, self.top_k, self.activation = bundle, w13, w2, top_k, activation
        routes = max_tokens * top_k
        # routes packed for FC1 (and FC2 when its launch uses the same block), FC2's own, and the GEMMs' scratch
        self.ws1, self.ws2, self.ws3 = (GemmWorkspace.for_tokens(bundle, max_tokens, top_k, w13, w2) for _ in range(3))
        inter = w2.k
        self.fc1 = torch.empty(routes, w13.n, dtype=torch.bfloat16, device="cuda")
        self.act = torch.empty(routes, inter, dtype=torch.bfloat16, device="cuda")
        self.fc2 = torch.empty(routes, w2.n, dtype=torch.bfloat16, device="cuda")

    def parts(self, x, weights, ids, out):
        """The five launches as separately timeable callables (routes shared by FC1 and FC2)."""
        m, routes = x.shape[0], x.shape[0] * self.top_k
        fc1, act, fc2 = self.fc1[:routes], self.act[:routes], self.fc2[:routes]
        box = {}
        same = (gemm_entry(self.bundle, self.w13, self.top_k).launch(m).route_block
                == gemm_entry(self.bundle, self.w2, self.top_k).launch(m).route_block)

        def pack():  # once when both GEMMs' launches use one route block, else once per GEMM
            box["r"] = pack_gemm_routes(self.bundle, ids, self.w13, workspace=self.ws1)
            box["r2"] = box["r"] if same else pack_gemm_routes(self.bundle, ids, self.w2, workspace=self.ws3)

        def gemm1():
            w4a16_moe_gemm(self.bundle, x, self.w13, ids, out=fc1, workspace=self.ws2, routes=box["r"])

        def activation():
            moe_activation(self.bundle, fc1, act, activation=self.activation)

        def gemm2():
            w4a16_moe_gemm(self.bundle, act, self.w2, ids, topk_weights=weights, mul_topk_weights=True,
                           a_per_route=True, out=fc2, workspace=self.ws2, routes=box["r2"])

        def combine():
            moe_topk_sum(self.bundle, fc2.view(m, self.top_k, -1), out)

        return {"pack": pack, "fc1": gemm1, "activation": activation, "fc2": gemm2, "combine": combine}


def inputs(m: int, hidden: int, experts: int, top_k: int):
    g = torch.Generator().manual_seed(m)
    ids = torch.rand(m, experts, generator=g).topk(top_k, dim=1).indices.to(torch.int32).cuda()
    weights = torch.softmax(torch.randn(m, top_k, generator=g), 1).cuda()
    x = torch.randn(m, hidden, generator=g).to(torch.bfloat16).cuda()
    return x, weights, ids


def run_model(bundle, fused_bundle, model: str, ms: list[int], hbm: float, tc: float) -> list[dict]:
    hidden, inter, experts, top_k, activation = MODELS[model]
    w13, w2 = random_packed(experts, 2 * inter, hidden), random_packed(experts, hidden, inter)
    fused = MoeLayer(fused_bundle, w13, w2, top_k=top_k, activation=activation, max_tokens=max(ms))
    split = SplitLayer(bundle, w13, w2, top_k, activation, max(ms))
    peer = torch_bf16_layer(hidden, inter, experts, top_k, activation)
    rows = []
    for m in ms:
        x, weights, ids = inputs(m, hidden, experts, top_k)
        out_f, out_s, out_t = (torch.empty(m, hidden, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        parts = split.parts(x, weights, ids, out_s)
        parts["pack"]()
        torch.cuda.synchronize()
        fused_us = device_us(lambda: fused(x, weights, ids, out=out_f))
        split_us = device_us(lambda: [p() for p in parts.values()])
        part_us = {name: device_us(p) for name, p in parts.items() if name != "pack"}
        torch_us = device_us(lambda: peer(x, weights, ids, out_t))
        torch.cuda.synchronize()
        diff = float((out_s.float() - out_f.float()).norm() / out_f.float().norm())
        flops = 2 * m * top_k * (2 * inter * hidden + hidden * inter)
        row = {"model": model, "M": m, "fused_us": fused_us, "split_us": split_us, "torch_bf16_us": torch_us,
               **{f"{k}_us": v for k, v in part_us.items()}, "split_vs_fused_rel_diff": diff,
               "fused_tflops": flops / fused_us / 1e6, "split_tflops": flops / split_us / 1e6,
               "roofline_us": flops / tc * 1e6}
        rows.append(row)
        print(f"{model:14s} M={m:6d} fused {fused_us:8.1f} | split {split_us:8.1f} (fc1 {part_us['fc1']:7.1f} "
              f"act {part_us['activation']:6.1f} fc2 {part_us['fc2']:7.1f} sum {part_us['combine']:6.1f}) | torch "
              f"{torch_us:8.1f} us | split/fused {split_us / fused_us:5.2f} | {row['split_tflops']:5.0f} TF/s "
              f"| diff {diff:.1e}", flush=True)
    del fused, split, peer, w13, w2
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="generated/bench-large-m")
    ap.add_argument("--fused-bundle", default="generated/moe-models")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--m", nargs="*", type=int, default=MS)
    ap.add_argument("--json")
    args = ap.parse_args()
    bundle, fused_bundle = load_bundle(args.bundle), load_bundle(args.fused_bundle)
    hbm, tc = hbm_copy_bandwidth(), tensor_core_rate()
    print(f"HBM copy {hbm / 1e12:.2f} TB/s, bf16 mm {tc / 1e12:.0f} TFLOP/s")
    rows = [r for model in args.models for r in run_model(bundle, fused_bundle, model, args.m, hbm, tc)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hbm_Bps": hbm, "tc_flops": tc, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
