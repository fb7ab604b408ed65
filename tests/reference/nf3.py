"""NF3 reference, independent of cuteaot.runtime.nf3.

    codes (E, N, K) u8 0..7, scales (E, N, K/32) e4m3, scale_2 (E,) f32
    W[e, n, k] = CODEBOOK[codes[e, n, k]] * scales[e, n, k // 32] * scale_2[e]

CODEBOOK is the seed's eight code points, written out here; `dequantize_nf3` uses them as
float32 (the kernels multiply their bf16 roundings: a relative difference of at most 2**-9 per
weight, well inside the layer tests' tolerance).
"""

from __future__ import annotations

import torch

CODEBOOK = (-1.0, -0.6047, -0.3563, -0.1275, 0.1275, 0.3563, 0.6047, 1.0)
BLOCK = 32


def dequantize_nf3(codes: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """(E, N, K) codes + (E, N, K/32) e4m3 + (E,) -> float32 (E, N, K), from the definition."""
    book = torch.tensor(CODEBOOK, dtype=torch.float32, device=codes.device)
    block_scale = scales.float().repeat_interleave(BLOCK, dim=-1)
    return book[codes.long()] * block_scale * scale_2.float().view(-1, 1, 1)


def random_nf3(experts: int, n: int, k: int, generator: torch.Generator, *, scale_2: float = 1e-3):
    """Random NF3 tensors: uniform codes, block scales uniform in [1, 448) rounded to e4m3."""
    device = generator.device
    codes = torch.randint(0, 8, (experts, n, k), generator=generator, device=device, dtype=torch.uint8)
    scales = (torch.rand(experts, n, k // BLOCK, generator=generator, device=device) * 447 + 1).to(torch.float8_e4m3fn)
    return codes, scales, torch.full((experts,), scale_2, device=device)
