"""MXFP4 (OCP microscaling, gpt-oss checkpoints) reference, independent of cuteaot.runtime.weights.

    blocks (E, N, K/32, 16) u8: two e2m1 codes a byte, the low nibble first along K
    scales (E, N, K/32) u8:     e8m0, the block's scale is 2**(byte - 127)
    W[e, n, 32 b + i] = e2m1(code i of blocks[e, n, b]) * 2**(scales[e, n, b] - 127)
"""

from __future__ import annotations

import torch

from tests.reference.nvfp4 import E2M1_MAGNITUDES

BLOCK = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(E, N, K/32, 16) u8 + (E, N, K/32) u8 -> float32 (E, N, K), written from the definition."""
    lut = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES), device=blocks.device)
    low, high = lut[(blocks & 0xF).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # (E, N, K/32, 32)
    exponent = scales.long() - 127
    return torch.ldexp(values, exponent.unsqueeze(-1)).flatten(-2)


def random_mxfp4(experts: int, n: int, k: int, generator: torch.Generator, *, spread: int = 6,
                 center: int = 120) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 tensors: uniform codes, scale exponents center +- spread (e8m0 bytes)."""
    device = generator.device
    blocks = torch.randint(0, 256, (experts, n, k // BLOCK, BLOCK // 2), generator=generator, device=device,
                           dtype=torch.uint8)
    scales = torch.randint(center - spread, center + spread + 1, (experts, n, k // BLOCK), generator=generator,
                           device=device, dtype=torch.uint8)
    return blocks, scales
