"""NVFP4 references, independent of cuteaot.runtime.weights.

* `quantize_nvfp4` / `dequantize_modelopt`: the ModelOpt checkpoint format, written from
  its definition (value = e2m1 * e4m3 block scale * per-expert float32 scale).
* `decode_packed_like_device`: what the W4A16 GEMM computes from the packed layout, written
  from the kernel's dataflow (u32 loads, bit-trick decodes into bf16x2 / fp16x2 pairs, the
  paired multiply by a scale lane, the m16n8k16 B-fragment coordinates) in integer torch ops.
  It knows nothing about how the packer arranges its tensors.
"""

from __future__ import annotations

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; bit 3 is the sign
E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK_K = 16
U32 = 0xFFFFFFFF
ELEMENT_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ---- ModelOpt format -----------------------------------------------------------------------------


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E, N, K) float -> (weight u8 (E, N, K/2), weight_scale e4m3 (E, N, K/16), weight_scale_2 f32 (E,))."""
    w = w.float()
    experts, n, k = w.shape
    scale_2 = w.abs().amax(dim=(1, 2)) / (E2M1_MAX * E4M3_MAX)  # (E,)
    blocks = w.reshape(experts, n, k // BLOCK_K, BLOCK_K)
    block_amax = blocks.abs().amax(dim=-1)
    denom_2 = scale_2.view(-1, 1, 1)
    zero = torch.zeros((), device=w.device)
    wanted = torch.where(denom_2 > 0, block_amax / E2M1_MAX / denom_2.clamp_min(1e-38), zero)
    weight_scale = wanted.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = (weight_scale.float() * denom_2).unsqueeze(-1)
    x = torch.where(step > 0, blocks / step.clamp_min(1e-38), zero)
    grid = torch.tensor(E2M1_MAGNITUDES, device=w.device)
    distance = (x.abs().clamp(max=E2M1_MAX).unsqueeze(-1) - grid).abs()
    magnitude_code = distance.argmin(dim=-1)  # ties go to the smaller magnitude
    codes = (magnitude_code | ((x < 0).long() << 3)).reshape(experts, n, k)
    weight = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return weight, weight_scale, scale_2.float()


def random_nvfp4(experts: int, n: int, k: int, generator: torch.Generator, std: float = 0.05):
    """ModelOpt tensors of random (E, N, K) weights (normal, `std`), drawn and quantised on the
    generator's device a few experts at a time (the quantiser's temporaries are 8x the weights)."""
    parts, step = [], max(1, (1 << 27) // (n * k))
    for start in range(0, experts, step):
        w = torch.randn(min(step, experts - start), n, k, generator=generator, device=generator.device) * std
        parts.append(quantize_nvfp4(w))
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))


def dequantize_modelopt(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """ModelOpt tensors -> float32 (E, N, K): (e2m1 * block scale) * weight_scale_2, in float32.
    A few experts at a time: the temporaries of a whole layer (int64 codes, 16 bytes per weight)
    would not fit beside a large model's layer on an 80 GB GPU."""
    experts, n, half_k = weight.shape
    out = torch.empty(experts, n, 2 * half_k, dtype=torch.float32, device=weight.device)
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=weight.device)
    step = max(1, (1 << 26) // max(1, n * half_k))
    for start in range(0, experts, step):
        part = slice(start, min(experts, start + step))
        w = weight[part]
        codes = torch.stack((w & 0xF, w >> 4), dim=-1).reshape(w.shape[0], n, 2 * half_k).long()
        magnitude = magnitudes[codes & 7]
        e2m1 = torch.where((codes & 8) != 0, -magnitude, magnitude)
        block = weight_scale[part].float().repeat_interleave(BLOCK_K, dim=-1)
        out[part] = (e2m1 * block) * weight_scale_2[part].float().reshape(-1, 1, 1)
    return out


# ---- device decode emulation ---------------------------------------------------------------------


def _halves(pattern: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A u32 (int64 tensor) seen as a bf16x2 / fp16x2 register -> (low, high) as float32."""
    out = []
    for shift in (0, 16):
        bits16 = (pattern >> shift) & 0xFFFF
        signed = ((bits16 + 0x8000) & 0xFFFF) - 0x8000
        out.append(signed.to(torch.int16).view(ELEMENT_TYPES[dtype]).float())
    return out[0], out[1]


# The kernel's word decode (dequant_e2m1x8_*): register j = (sign bits of rotr(x, a_j)) |
# (magnitude bits of rotr(x, b_j)); sign bits 15/31, magnitude e1 e0 m on 8..6 / 24..22 (bf16,
# w * 2**-126) or 11..9 / 27..25 (fp16, w * 2**-14).
_ROTATIONS = {"bf16": ((0, 0), (26, 26), (27, 29), (28, 6)), "fp16": ((0, 0), (29, 29), (30, 23), (31, 26))}
_MAG_MASK = {"bf16": 0x01C001C0, "fp16": 0x0E000E00}


def _rotr(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x >> r) | (x << (32 - r))) & U32 if r else x


def _e2m1x8(x: torch.Tensor, dtype: str):
    """One u32 -> the four element pairs R0..R3 (each as (low, high) float32)."""
    return [_halves((_rotr(x, a) & 0x80008000) | (_rotr(x, b) & _MAG_MASK[dtype]), dtype)
            for a, b in _ROTATIONS[dtype]]


def _scale_byte(q: torch.Tensor, byte: int, dtype: str) -> torch.Tensor:
    """The kernel's scale decode (scale_halves_s0e5m3_*) of byte `byte` of q, as float32: the byte
    on bits 11..4 with bit 14 set (bf16, s * 2**23) or on bits 14..7 (fp16, s * 2**7)."""
    code = (q >> (8 * byte)) & 0xFF
    bits = (code << 4) | 0x4000 if dtype == "bf16" else code << 7
    return _halves(bits, dtype)[0]


def _mul(a: torch.Tensor, b: torch.Tensor, dtype: str) -> torch.Tensor:
    """bf16x2 / fp16x2 multiply, round to nearest (the float32 product of two such values is exact)."""
    return (a * b).to(ELEMENT_TYPES[dtype]).float()


def decode_packed_like_device(
    qweight: torch.Tensor,  # (E, K/16, 2N) i32
    scales: torch.Tensor,  # (E, K/16, N) u8
    global_scale: torch.Tensor,  # (E,) f32
    dtype: str,  # "bf16" | "fp16"
) -> torch.Tensor:
    """The float32 (E, N, K) weight the GEMM effectively multiplies with (global scale applied per element).

    Per (expert, k-group), lane (g, t) of the warp for 64-column slab `slab` loads 4 words
    (jj = 0..3) at word offset slab * 128 + lane * 4 and 8 scale bytes at byte offset
    (8 * slab + g) * 8.  For word jj it forms
        b0_0, b0_1, b1_0, b1_1 = decode(word)     (the four registers R0..R3)
        frag[0] = (b0_0, b0_1) * scale_jj.low ;  frag[1] = (b1_0, b1_1) * scale_jj.high
    and feeds frag[h] as (b0, b1) of an m16n8k16 MMA over columns 64 * slab + 16 * jj + 8 * h + [0, 8):
    b0 holds k = 2t, 2t+1 and b1 holds k = 2t+8, 2t+9 of column g (low half first).
    """
    experts, groups, two_n = qweight.shape
    n, k = two_n // 2, groups * BLOCK_K
    slabs = n // 64
    words = (qweight.to(torch.int64) & U32).view(experts, groups, slabs, 8, 4, 4)  # lane = 4g + t, jj
    unit = scales.to(torch.int64).view(experts, groups, slabs, 8, 2, 4)  # (slab, g): two u32 of 4 bytes
    packs = unit[..., 0] | (unit[..., 1] << 8) | (unit[..., 2] << 16) | (unit[..., 3] << 24)
    # word jj's two 8-column blocks scale with bytes jj % 2 and jj % 2 + 2 of u32 jj // 2
    scale_regs = [(_scale_byte(packs[..., jj // 2], jj % 2, dtype), _scale_byte(packs[..., jj // 2], jj % 2 + 2, dtype))
                  for jj in range(4)]

    e = torch.arange(experts).view(-1, 1, 1, 1, 1)
    grp = torch.arange(groups).view(1, -1, 1, 1, 1)
    slab = torch.arange(slabs).view(1, 1, -1, 1, 1)
    g = torch.arange(8).view(1, 1, 1, -1, 1)
    t = torch.arange(4).view(1, 1, 1, 1, -1)
    gs = global_scale.float().view(-1, 1, 1, 1, 1)
    out = torch.full((experts, n, k), float("nan"))
    for jj in range(4):
        q = words[..., jj]  # (E, G, slab, g, t)
        b0_0, b0_1, b1_0, b1_1 = _e2m1x8(q, dtype)
        s_low, s_high = (s.unsqueeze(-1) for s in scale_regs[jj])
        for h, (reg_b0, reg_b1), s_lane in ((0, (b0_0, b0_1), s_low), (1, (b1_0, b1_1), s_high)):
            column = 64 * slab + 16 * jj + 8 * h + g
            for reg, k_base in ((reg_b0, 0), (reg_b1, 8)):
                for element, k_off in zip(reg, (0, 1)):
                    row_k = BLOCK_K * grp + 2 * t + k_base + k_off
                    out[e, column, row_k] = _mul(element, s_lane, dtype) * gs
    return out
