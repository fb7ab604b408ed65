"""NF3 weights: 3-bit codebook codes with one e4m3 scale per 32 k (the seed's `nf3_2p1` format).

    NF3 (input, per weight matrix of logical shape [E, N, K]; `quantize_nf3` makes them):
        codes    (E, N, K)    u8       0..7, an index into NF3_CODEBOOK
        scales   (E, N, K/32) e4m3fn   one block scale per 32 consecutive k, > 0
        scale_2  (E,) f32              per-expert global scale ((E, 1) accepted too)
        W[e, n, k] = NF3_CODEBOOK[codes] * scales[e, n, k // 32] * scale_2[e]

    packed "nf3" (output; docs/layouts.md, "NF3"):
        qweight       (E, K/32, 3N) i32   one row of 3N words (12 bytes a column) per (expert, 32-k group)
        scales        (E, K/32, N)  u8    S0E5M3 bytes of s * 2**7, the NVFP4 layout's 8-byte units
        global_scale  (E,) f32            scale_2 * 2**-23

The kernels decode a code with one `prmt` byte lookup per pair of weights: the low byte of the
bf16 code point comes from pool A (indexed by the magnitude m), the high byte from pool B
(indexed by the sign and the exponent bit, which is m's high bit).  The code points are the
seed's, used as their bf16 roundings (NF3_CODEBOOK_BF16), as the seed's kernels do.  bf16 only.
NF3 moves 3 bits + 8/32 of scale per weight against NVFP4's 4 + 8/16 (0.72x the bytes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from .errors import BadInputError
from .types import DType, WeightFormat
from .weights import (
    SCALE_DECODE_EXPONENT, SLAB_N, VECTOR_ELEMENTS, PackedNvfp4, W13Order, _check_bias, _check_global_2,
    LANE_GROUPS, LANE_THREADS, _check_scale_values, _check_tensor, _decode_scale_values, _encode_scale_bytes,
    _expert_slices, _gate_up_rows, _order_scale_bytes, _padded, _unorder_scale_bytes, _w13_order, stored_dims,
)

NF3_CODEBOOK = (-1.0, -0.6047, -0.3563, -0.1275, 0.1275, 0.3563, 0.6047, 1.0)  # the seed's code points
NF3_BLOCK_K = 32  # k per e4m3 scale: two 16-k MMA rows share one
NF3_STORED_N_MULTIPLE = 128  # N is zero-padded to whole 128-wide tiles (no masked N tiles in the NF3 loop)
NF3_CODES = len(NF3_CODEBOOK)
# bf16 roundings of the code points: what the kernels multiply (and quantize_nf3 picks among)
NF3_CODEBOOK_BF16 = torch.tensor(NF3_CODEBOOK, dtype=torch.float32).to(torch.bfloat16)

# A code c is a sign (c < 4) and a magnitude index m: |NF3_CODEBOOK[c]| = magnitude m, ascending.
HALF = NF3_CODES // 2


def _bf16_bits(value: float) -> int:
    return int(torch.tensor([value]).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


_MAGNITUDE_BITS = [_bf16_bits(NF3_CODEBOOK[HALF + m]) for m in range(HALF)]
# The high byte of each magnitude is 0x3E or 0x3F and equals 0x3E + (m >> 1): the exponent bit is
# m's high bit, which is what lets pool B be indexed by (sign, m >> 1).
assert [b >> 8 for b in _MAGNITUDE_BITS] == [0x3E + (m >> 1) for m in range(HALF)], _MAGNITUDE_BITS
POOL_A = sum((b & 0xFF) << (8 * m) for m, b in enumerate(_MAGNITUDE_BITS))  # low bytes by m
POOL_B = 0x3E | 0x3F << 8 | 0xBE << 16 | 0xBF << 24  # high bytes by (m >> 1) + 2 * sign

# ---- the packed words --------------------------------------------------------------------------
#
# Per lane (g, t) and 16-k row kk of a 32-k group the kernel reads three words x0, x1, x2 and
# forms a fourth, y3 = gather(x0, x1, x2); word y_jj holds the 8 codes of the 4 MMA registers
# R0..R3 of word jj of the NVFP4 layout (same columns, same k).  In a decode word, register Rj's
# two codes (low half, high half) are the units u = 2 * (j % 2) + half of bit group r = 2 * (j // 2):
# unit u of group r puts m's bits at 8u + r + (0, 1) and the sign at 8u + r + 5.  Group 0 uses bits
# {0, 1, 5} of every byte, group 2 bits {2, 3, 7}; the bits left over, {4, 6} of every byte of
# x0, x1, x2, hold y3 (GATHER_SOURCES).
UNIT_FIELD_BITS = (0, 1, 5)  # m bit 0, m bit 1, sign, within a unit of group 0
GROUP_SHIFTS = (0, 2)
# The decode (codegen/intrinsics.dequant_nf3_word_bf16), per byte of a word shifted by its group:
# t = (y & INFO) | POOL_B_INDEX keeps m and the sign and sets the high nibble's pool-B bit;
# sel = t + (y & M1) * M1_COPY copies m's high bit to bit 4, giving the nibbles (m, 4 + (m >> 1) + 2 * sign).
_EVERY_BYTE = 0x01010101
DECODE_INFO_MASK = sum(1 << b for b in UNIT_FIELD_BITS) * _EVERY_BYTE  # 0x23232323
DECODE_POOL_B_INDEX = 0x40 * _EVERY_BYTE  # bit 2 of the high nibble: index 4..7 = pool B
DECODE_M1_MASK = (1 << UNIT_FIELD_BITS[1]) * _EVERY_BYTE  # 0x02020202
DECODE_M1_COPY = 1 << (4 - UNIT_FIELD_BITS[1])  # bit 1 -> bit 4 (the high nibble's index bit 0)
WORDS_PER_ROW = 3  # stored words per lane per 16-k row
NF3_COLUMN_BYTES = NF3_BLOCK_K * 3 // 8  # 12: one column of one 32-k row, 3 bits a code
# y3 bit p comes from x0 bit p + 4 (p % 8 in {0, 2}), x1 bit p + 3 ({1, 3}) or x2 bit p - 1 ({5, 7})
GATHER_SOURCES = {0: (0, 4), 2: (0, 4), 1: (1, 3), 3: (1, 3), 5: (2, -1), 7: (2, -1)}
GATHER_MASKS = (0x05050505, 0x0A0A0A0A, 0xA0A0A0A0)  # y3 = (x0 >> 4 & M0) | (x1 >> 3 & M1) | (x2 << 1 & M2)
LANES = 32
SLAB_ROW_WORDS = LANES * 2 * WORDS_PER_ROW  # 192: one slab (64 columns) of one 32-k group
# Where a lane's words sit in a slab row (32-bit word offsets): its (x0, x1) of row kk as one 8-byte
# vector in plane kk, its x2 in plane 2 + kk; every load of a warp is contiguous, conflict-free.
X01_PLANE = LANES * 2
X2_BASE, X2_PLANE = 2 * X01_PLANE, LANES


def _word_offset(kk: int, lane: int, x: int) -> int:
    if x < 2:
        return kk * X01_PLANE + 2 * lane + x
    return X2_BASE + kk * X2_PLANE + lane


@functools.cache
def _bit_destinations() -> tuple[int, ...]:
    """For each (column in slab, k in group, field m0 / m1 / sign): its bit in the slab row
    (word * 32 + bit), in that index order; a bijection onto the 192 * 32 bits."""
    out = []
    for col in range(SLAB_N):
        jj, block, g = col // 16, (col % 16) // 8, col % 8
        for k in range(NF3_BLOCK_K):
            kk, kl = k // 16, k % 16
            t, half, high = (kl % 8) // 2, kl % 2, kl // 8
            lane, j = 4 * g + t, 2 * block + high
            unit, group = 2 * (j % 2) + half, GROUP_SHIFTS[j // 2]
            for field in UNIT_FIELD_BITS:
                pos = 8 * unit + group + field
                x = jj
                if jj == WORDS_PER_ROW:  # the gathered word: its bit lives in a leftover bit of x0..x2
                    x, delta = GATHER_SOURCES[pos % 8]
                    pos += delta
                out.append(32 * _word_offset(kk, lane, x) + pos)
    assert sorted(out) == list(range(SLAB_ROW_WORDS * 32))
    return tuple(out)


def _destinations(device: torch.device) -> torch.Tensor:
    return torch.tensor(_bit_destinations(), dtype=torch.int64, device=device)


def _unit_fields(codes: torch.Tensor) -> torch.Tensor:
    """u8 codes -> their fields on a group-0 unit's bits (UNIT_FIELD_BITS: m bit 0, m bit 1, sign), as u8."""
    sign = (codes < HALF).to(torch.uint8)
    m = (codes & (HALF - 1)) ^ (sign * (HALF - 1))  # the negative half counts down: HALF - 1 - c, else c - HALF
    m0, m1, s = UNIT_FIELD_BITS
    return ((m & 1) << m0) | ((m >> 1) << m1) | (sign << s)


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """(E, N, K) u8 codes -> (E, K/32, 3N) i32 packed words, byte by byte: byte u = 2 * high + half of
    decode word jj of lane (g, t) holds the codes of columns 16 jj + g (group 0's bits) and 16 jj + 8 + g
    (group 2's) at k = 16 kk + 8 high + 2t + half; y3's bits then move into the leftover bits of x0..x2
    (GATHER_SOURCES, read backwards) and the words go to their slab-row offsets (_word_offset).  Callers
    pass a slice of experts; `_unpack_codes` inverts it through `_bit_destinations`, independently."""
    e, n, k = codes.shape
    slabs, groups = n // SLAB_N, k // NF3_BLOCK_K
    # n = 64 slab + 16 jj + 8 block + g ;  k = 32 group + 16 kk + 8 high + 2 t + half
    fields = _unit_fields(codes.reshape(e, slabs, WORDS_PER_ROW + 1, 2, LANE_GROUPS, groups, 2, 2, LANE_THREADS, 2))
    units = (fields[:, :, :, 0] << GROUP_SHIFTS[0]) | (fields[:, :, :, 1] << GROUP_SHIFTS[1])
    # (E, slab, jj, g, group, kk, high, t, half) -> (E, group, slab, kk, g, t, jj, [high, half] = byte u)
    y = units.permute(0, 4, 1, 5, 3, 7, 2, 6, 8).reshape(e, groups, slabs, 2, LANES, WORDS_PER_ROW + 1, 4)
    y3 = y[..., WORDS_PER_ROW, :]
    m0, m1, m2 = (mask & 0xFF for mask in GATHER_MASKS)  # the same in every byte
    x = (y[..., 0, :] | (y3 & m0) << 4, y[..., 1, :] | (y3 & m1) << 3, y[..., 2, :] | (y3 & m2) >> 1)
    words = [w.contiguous().view(torch.int32).squeeze(-1) for w in x]  # (E, group, slab, kk, lane)
    # slab row: (x0, x1) of row kk as lane pairs in plane kk, then x2 of row kk in plane 2 + kk
    x01 = torch.stack(words[:2], dim=-1).reshape(e, groups, slabs, X2_BASE)
    row = torch.cat((x01, words[2].reshape(e, groups, slabs, SLAB_ROW_WORDS - X2_BASE)), dim=-1)
    return row.reshape(e, groups, WORDS_PER_ROW * n)


def _unpack_codes(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """(E, K/32, 3N) i32 -> (E, N, K) u8 codes (inverse of _pack_codes)."""
    return torch.cat([_unpack_expert_codes(qweight[i : i + 1], n, k) for i in range(qweight.shape[0])])


def _unpack_expert_codes(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    e = qweight.shape[0]
    words = qweight.contiguous().view(torch.uint8).view(e, k // NF3_BLOCK_K, n // SLAB_N, SLAB_ROW_WORDS * 4, 1)
    bits = ((words >> torch.arange(8, dtype=torch.uint8, device=qweight.device)) & 1).flatten(-2)
    fields = bits[..., _destinations(qweight.device)].view(e, k // NF3_BLOCK_K, n // SLAB_N, SLAB_N, NF3_BLOCK_K, 3)
    fields = fields.permute(0, 2, 3, 1, 4, 5).reshape(e, n, k, 3)
    m, sign = fields[..., 0] | fields[..., 1] << 1, fields[..., 2]
    return torch.where(sign.bool(), HALF - 1 - m, m + HALF).to(torch.uint8)


# ---- the packed object ---------------------------------------------------------------------------

# the bf16 scale decode yields s * 2**23 and the code points come as themselves
NF3_GLOBAL_SCALE_COMPENSATION = 2.0 ** -SCALE_DECODE_EXPONENT[DType.BF16]


@dataclass(frozen=True, repr=False)  # __repr__: shapes, not tensor dumps
class PackedNf3(PackedNvfp4):
    """NF3 weights of E experts in the "nf3" layout, for the GEMM with bf16 activations."""

    layout: ClassVar[str] = "nf3"
    scale_format: ClassVar[str] = "e4m3_k32"
    weights: ClassVar[WeightFormat] = WeightFormat.NF3
    scale_group_k: ClassVar[int] = NF3_BLOCK_K
    stored_n_multiple: ClassVar[int] = NF3_STORED_N_MULTIPLE

    def _qweight_shape(self) -> tuple[int, int, int]:
        return (self.num_experts, self.k_stored // NF3_BLOCK_K, WORDS_PER_ROW * self.n_stored)

    def __post_init__(self):
        super().__post_init__()
        if self.dtype is not DType.BF16:
            raise BadInputError(f"NF3 weights serve bf16 activations only (the seed's format), got {self.dtype.value}")


def _check_nf3(codes: object, scales: object, prefix: str) -> tuple[int, int, int]:
    c_name, s_name = f"{prefix}codes", f"{prefix}scales"
    _check_tensor(codes, c_name, torch.uint8, "NF3 code indices 0..7, [E, N, K]")
    _check_tensor(scales, s_name, torch.float8_e4m3fn, "one e4m3 scale per 32 k, [E, N, K/32]")
    if codes.dim() != 3 or 0 in codes.shape:
        raise BadInputError(f"{c_name} must be a non-empty 3-D [E, N, K] tensor, got shape {tuple(codes.shape)}")
    e, n, k = codes.shape
    if k % NF3_BLOCK_K or n % VECTOR_ELEMENTS:
        raise BadInputError(f"NF3 needs K % {NF3_BLOCK_K} == 0 (one scale per 32 k) and N % {VECTOR_ELEMENTS} == 0, "
                            f"got {c_name} of shape {tuple(codes.shape)}")
    if tuple(scales.shape) != (e, n, k // NF3_BLOCK_K):
        raise BadInputError(f"{s_name} must have shape [E, N, K/32] = {(e, n, k // NF3_BLOCK_K)} to match {c_name}, "
                            f"got {tuple(scales.shape)}")
    if scales.device != codes.device:
        raise BadInputError(f"{s_name} is on {scales.device} but {c_name} on {codes.device}; use one device")
    if int(codes.max()) >= NF3_CODES:
        raise BadInputError(f"{c_name} must hold indices 0..{NF3_CODES - 1}, got max {int(codes.max())}")
    _check_scale_values(scales, s_name)
    zero = (scales.view(torch.uint8) & 0x7F) == 0  # +-0 (the sign was checked above)
    if bool(zero.any()):
        raise BadInputError(f"{s_name} holds {int(zero.sum())} zero block scale(s): NF3 has no zero code point, so "
                            "a zero block is not representable (quantize_nf3 gives such blocks the smallest scale)")
    return e, n, k


def _pack(codes, scales, scale_2, num_experts, n, k, prefix, bias,
          row_order: W13Order = W13Order.GATE_UP) -> PackedNf3:
    """`codes` in `row_order` (W13; reordered a slice of experts at a time), `scales` already [gate | up]."""
    global_scale = scale_2.float() * NF3_GLOBAL_SCALE_COMPENSATION
    if not bool(torch.isfinite(global_scale).all()):
        raise BadInputError(f"{prefix}scale_2 must be finite, got max {float(scale_2.max()):g}")
    n_stored, k_stored = stored_dims(n, k, NF3_STORED_N_MULTIPLE)
    # padding: finite weights the kernels never use (activations past K are read as zeros, outputs past N
    # are not stored); code HALF and scale byte 0 decode to finite values
    qweight = torch.empty((num_experts, k_stored // NF3_BLOCK_K, WORDS_PER_ROW * n_stored), dtype=torch.int32,
                          device=codes.device)
    for part in _expert_slices(num_experts, n_stored * k_stored):
        qweight[part] = _pack_codes(_padded(_gate_up_rows(codes[part], row_order), n_stored, k_stored, value=HALF))
    scale_bytes = _padded(_encode_scale_bytes(scales), n_stored, k_stored // NF3_BLOCK_K)
    return PackedNf3(qweight=qweight, scales=_order_scale_bytes(scale_bytes), global_scale=global_scale.contiguous(),
                     num_experts=num_experts, n=n, k=k, dtype=DType.BF16, bias=bias)


def pack_nf3(codes: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor) -> PackedNf3:
    """Pack one NF3 weight [E, N, K] for the GEMM (bf16 activations)."""
    e, n, k = _check_nf3(codes, scales, "")
    scale_2 = _check_global_2(scale_2, e, codes.device, "scale_2", pair=False,
                              pair_hint="NF3 takes one global scale per expert")
    return _pack(codes, scales, scale_2, e, n, k, "", None)


def unpack_nf3(packed: PackedNf3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The NF3 tensors (codes, scales, scale_2 (E,)) a packed object holds: the exact inverse of pack_nf3."""
    if not isinstance(packed, PackedNf3):
        raise BadInputError(f"packed must be a PackedNf3, got {type(packed).__name__}")
    n, k = packed.n, packed.k
    codes = _unpack_codes(packed.qweight, packed.n_stored, packed.k_stored)[:, :n, :k].contiguous()
    scales = _decode_scale_values(_unorder_scale_bytes(packed.scales))[:, :n, : k // NF3_BLOCK_K].to(
        torch.float8_e4m3fn).contiguous()
    return codes, scales, packed.global_scale / NF3_GLOBAL_SCALE_COMPENSATION


def prepare_w13_nf3(codes: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor, *,
                    order: W13Order | str = W13Order.GATE_UP, bias: torch.Tensor | None = None) -> PackedNf3:
    """NF3 fused gate/up projection (E, 2I, H) as N = 2I columns [gate | up]; `order` and `bias` as in
    prepare_w13.  One global scale per expert ((E,) or (E, 1)): quantize_nf3 gives the stacked tensor one."""
    row_order = _w13_order(order)
    e, rows, k = _check_nf3(codes, scales, "w13_")
    if rows % 2:
        raise BadInputError(f"w13_codes has {rows} rows; [gate | up] needs an even count (2 * I)")
    scales = _gate_up_rows(scales, row_order)  # the codes are reordered slice by slice
    scale_2 = _check_global_2(scale_2, e, codes.device, "w13_scale_2", pair=False,
                              pair_hint="NF3 takes one global scale per expert")
    bias = _check_bias(bias, "w13_bias", e, rows, DType.BF16, codes.device, row_order)
    return _pack(codes, scales, scale_2, e, rows, k, "w13_", bias, row_order)


def prepare_w2_nf3(codes: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor, *,
                   bias: torch.Tensor | None = None) -> PackedNf3:
    """NF3 down projection: N = H output columns, K = I."""
    e, n, k = _check_nf3(codes, scales, "w2_")
    scale_2 = _check_global_2(scale_2, e, codes.device, "w2_scale_2", pair=False,
                              pair_hint="NF3 takes one global scale per expert")
    bias = _check_bias(bias, "w2_bias", e, n, DType.BF16, codes.device)
    return _pack(codes, scales, scale_2, e, n, k, "w2_", bias)


# ---- quantization --------------------------------------------------------------------------------

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9


def quantize_nf3(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize float weights (E, N, K) to NF3: (codes u8, scales e4m3 (E, N, K/32), scale_2 (E,) f32).

    Per expert, scale_2 = amax / 448 so that the largest block scale is e4m3's largest (0 for an
    all-zero expert); each block scale is its block's amax / scale_2 rounded to e4m3 (at least the
    smallest e4m3 value: NF3 has no zero); each code is the nearest bf16 code point to
    w / (scale * scale_2), exact zeros alternating between the two nearest along k.  Offline: users have
    no NF3 checkpoints otherwise.  Runs on the tensor's device.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or not weight.dtype.is_floating_point:
        raise BadInputError(f"weight must be a floating-point [E, N, K] tensor, got {getattr(weight, 'shape', weight)!r}")
    e, n, k = weight.shape
    if k % NF3_BLOCK_K:
        raise BadInputError(f"K = {k} must be a multiple of {NF3_BLOCK_K}")
    if not bool(torch.isfinite(weight).all()):
        raise BadInputError("weight must be finite")
    points = NF3_CODEBOOK_BF16.float().to(weight.device)  # ascending
    bounds = (points[1:] + points[:-1]) / 2
    parts = [_quantize_expert(weight[i].float(), bounds) for i in range(e)]  # one expert's temporaries at a time
    return tuple(torch.stack(p) for p in zip(*parts))


def _quantize_expert(w: torch.Tensor, bounds: torch.Tensor):
    amax = w.abs().amax()
    # an all-zero expert gets scale_2 = 0: NF3 has no zero code, so only a zero global scale decodes to 0
    scale_2 = amax / E4M3_MAX
    divisor = torch.where(amax > 0, scale_2, torch.ones_like(amax))
    blocks = w.view(w.shape[0], -1, NF3_BLOCK_K)
    scales = (blocks.abs().amax(-1) / divisor).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
    unit = blocks / (scales.float() * divisor).unsqueeze(-1)
    codes = torch.bucketize(unit, bounds).to(torch.uint8)  # the nearest code point
    # an exact 0 sits on the bound between the two smallest code points (+-0.1275): alternate them along
    # k, so that zeros (pruned weights) add no bias to a dot product (bucketize would always take -0.1275)
    lower = len(bounds) // 2
    alternate = (torch.arange(w.shape[1], device=w.device) % 2).to(torch.uint8).view(1, -1, NF3_BLOCK_K)
    codes = torch.where(unit == 0, lower + alternate, codes)
    return codes.view(w.shape), scales, scale_2
