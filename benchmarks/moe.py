"""Whole MoE layer (routing included) with CUDA-graph replay: cuteaot's MoeLayer vs a bf16 torch layer.

For each model and M, with the same random routing:
* ours: MoeLayer(hidden, topk_weights, topk_ids) -> (M, H): route packing (M > 8), the fused
  FC1 -> activation -> FC2 kernel, and the top-k sum (folded into the kernel for M <= 8);
* torch bf16: sort routes by expert, gather rows, torch._grouped_mm FC1, activation,
  torch._grouped_mm FC2, router weights, index_add into the output;
* humming-kernels W4A16 MoE when `import humming` works on the machine (else reported absent).
Every number is the median of CUDA-event-timed graph replays (benchmarks/common.py).
Roofline: max(bytes / measured HBM copy bandwidth, FLOPs / measured bf16 mm rate), with bytes =
FP4 weights + scales of the experts hit + activations in and out.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.common import device_us, hbm_copy_bandwidth
from benchmarks.gemm import random_packed, tensor_core_rate
from cuteaot.runtime import load_bundle
from cuteaot.runtime.moe import MoeLayer

MODELS = {  # name: (hidden, intermediate, experts, top_k, activation)
    "qwen3-30b-a3b": (2048, 768, 128, 8, "silu"),
    "gpt-oss-120b": (2880, 2880, 128, 4, "swigluoai"),
}
MS = [1, 2, 4, 8, 16, 64, 256, 1024, 4096]


def torch_bf16_layer(hidden, inter, experts, top_k, activation):
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16).mul_(0.05).transpose(1, 2)
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16).mul_(0.05).transpose(1, 2)

    def run(x, weights, ids, out):
        flat = ids.view(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.zeros(experts, dtype=torch.int32, device="cuda").scatter_add_(
            0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        tokens = order // top_k
        h = torch._grouped_mm(x[tokens], w13, offs=offs)
        g, u = h[:, :inter].float(), h[:, inter:].float()
        if activation == "swigluoai":
            g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
            a = g * torch.sigmoid(1.702 * g) * (u + 1.0)
        else:
            a = torch.nn.functional.silu(g) * u
        y = torch._grouped_mm(a.to(torch.bfloat16), w2, offs=offs)
        y = y * weights.view(-1)[order, None].to(torch.bfloat16)
        out.zero_()
        out.index_add_(0, tokens, y)
        return out

    return run


def humming_available() -> str | None:
    try:
        import humming  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - report why the peer is absent
        return f"{type(exc).__name__}: {exc}"
    return None


def bench(bundle, model: str, m: int, layer: MoeLayer, det: MoeLayer, peer, hbm: float, tc: float) -> dict:
    hidden, inter, experts, top_k, activation = MODELS[model]
    g = torch.Generator().manual_seed(m)
    ids = torch.rand(m, experts, generator=g).topk(top_k, dim=1).indices.to(torch.int32).cuda()
    weights = torch.softmax(torch.randn(m, top_k, generator=g), 1).cuda()
    x = torch.randn(m, hidden, generator=g).to(torch.bfloat16).cuda()
    out = torch.empty(m, hidden, device="cuda", dtype=torch.bfloat16)
    ours = device_us(lambda: layer(x, weights, ids, out=out))
    # deterministic=True differs only where the default takes the decode path (bf16 atomics)
    det_us = device_us(lambda: det(x, weights, ids, out=out)) if layer.resolve(m).decode else ours
    out_peer = torch.empty_like(out)
    try:
        theirs = device_us(lambda: peer(x, weights, ids, out_peer))
    except Exception as exc:  # noqa: BLE001
        print(f"torch bf16 layer failed for {model} M={m}: {exc}", file=sys.stderr)
        theirs = float("nan")
    hit = int(torch.unique(ids).numel())
    n1 = 2 * inter
    weight_bytes = hit * ((n1 * hidden + hidden * inter) // 2 + (n1 * hidden + hidden * inter) // 16 + 8)
    act_bytes = 2 * m * hidden * 2
    flops = 2 * m * top_k * (n1 * hidden + hidden * inter)
    roof = max((weight_bytes + act_bytes) / hbm, flops / tc) * 1e6
    return {
        "model": model, "M": m, "experts_hit": hit, "plan": layer.resolve(m).describe(),
        "us": ours, "roofline_us": roof, "pct_roofline": 100 * roof / ours,
        "GB/s": weight_bytes / ours / 1e3, "torch_bf16_us": theirs, "deterministic_us": det_us,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="generated/bench-moe")
    ap.add_argument("--json")
    args = ap.parse_args()
    bundle = load_bundle(args.bundle)
    hbm, tc = hbm_copy_bandwidth(), tensor_core_rate()
    humming = humming_available()
    print(f"HBM copy {hbm / 1e12:.2f} TB/s, bf16 mm {tc / 1e12:.0f} TFLOP/s; humming-kernels: "
          f"{'importable' if humming is None else 'absent (' + humming + ')'}")
    rows = []
    for model, (hidden, inter, experts, top_k, activation) in MODELS.items():
        w13 = random_packed(experts, 2 * inter, hidden)
        w2 = random_packed(experts, hidden, inter)
        layer = MoeLayer(bundle, w13, w2, top_k=top_k, activation=activation, max_tokens=max(MS))
        det = MoeLayer(bundle, w13, w2, top_k=top_k, activation=activation, max_tokens=max(MS), deterministic=True)
        peer = torch_bf16_layer(hidden, inter, experts, top_k, activation)
        for m in MS:
            r = bench(bundle, model, m, layer, det, peer, hbm, tc)
            rows.append(r)
            print(f"{model:14s} M={m:5d} {r['plan']:44s} {r['us']:8.1f} us (roofline {r['roofline_us']:7.1f} us, "
                  f"{r['pct_roofline']:5.1f}%) {r['GB/s']:6.0f} GB/s | deterministic {r['deterministic_us']:8.1f} us "
                  f"| torch bf16 {r['torch_bf16_us']:8.1f} us",
                  flush=True)
        del layer, det, peer, w13, w2
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hbm_Bps": hbm, "tc_flops": tc, "humming": humming, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
