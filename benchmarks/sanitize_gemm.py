"""A few GEMM launches covering every path, for `compute-sanitizer` (memcheck / racecheck) on the GPU.

    compute-sanitizer --tool memcheck python -m benchmarks.sanitize_gemm
    compute-sanitizer --tool racecheck python -m benchmarks.sanitize_gemm

Paths: direct routes (M = 1, whole tiles and split-K), packed 8-row blocks, 16/32/48/64-row
blocks (split-K tails; on sm_90a the warpgroup-MMA loop from 16 rows, M = 33 / 64 / 150 its 16-, 32- and
48-row blocks), zero-padded sizes with masked last N tiles and part k-tiles, fp16.  Uses the tiny-gemm
test bundle (CUTEAOT_GEMM_BUNDLE to override, as the GPU tests do).
"""

from __future__ import annotations

import os

import torch

from cuteaot.runtime import load_bundle, pack_nvfp4, w4a16_moe_gemm
from tests.reference.nvfp4 import quantize_nvfp4

CASES = [  # (N, K, dtype, M list, a_per_route)
    (512, 512, "bf16", (1, 5, 33, 64, 256, 1000, 4096), False),
    (512, 256, "fp16", (1, 8, 150, 300), True),
    (1376, 688, "bf16", (1, 64, 1000), False),
    (688, 688, "bf16", (1, 64, 1000), True),  # the last N tile and 128-deep k-tile masked
]


def main() -> None:
    bundle = load_bundle(os.environ.get("CUTEAOT_GEMM_BUNDLE", "generated/tiny-gemm"))
    for n, k, dtype, ms, per_route in CASES:
        q = quantize_nvfp4(torch.randn(8, n, k) * 0.05)
        w = pack_nvfp4(*q, dtype).to("cuda")
        for m in ms:
            ids = torch.rand(m, 8).topk(2, dim=1).indices.to(torch.int32).cuda()
            a = torch.randn(m * 2 if per_route else m, k, device="cuda").to(w.dtype.torch)
            tw = torch.rand(m, 2, device="cuda")
            out = w4a16_moe_gemm(bundle, a, w, ids, topk_weights=tw, mul_topk_weights=per_route, a_per_route=per_route)
            torch.cuda.synchronize()
            print(f"N={n} K={k} {dtype} M={m}: ok, finite={bool(out.isfinite().all())}", flush=True)


if __name__ == "__main__":
    main()
