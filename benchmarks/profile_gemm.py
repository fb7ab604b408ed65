"""Three representative GEMM launches (decode, small batch, large batch) for Nsight Compute.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats -k regex:W4A16 python -m benchmarks.profile_gemm

Qwen3-30B-A3B FC1 (N 1536, K 2048, 128 experts, top 8) at M = 1, 64, 4096, from the
bench-gemm bundle; route packing runs too but is filtered out by the kernel regex.
"""

from __future__ import annotations

import torch

from benchmarks.gemm import random_packed
from cuteaot.runtime import load_bundle, w4a16_moe_gemm


def main() -> None:
    bundle = load_bundle("generated/bench-gemm")
    packed = random_packed(128, 1536, 2048)
    for m in (1, 64, 4096):
        ids = torch.rand(m, 128).topk(8, dim=1).indices.to(torch.int32).cuda()
        a = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        w4a16_moe_gemm(bundle, a, packed, ids)
        torch.cuda.synchronize()
        print(f"M={m} done", flush=True)


if __name__ == "__main__":
    main()
