"""NVFP4 weight preparation: ModelOpt checkpoint tensors -> the "packed" layout the W4A16 GEMM reads.

    ModelOpt (input, per weight matrix of logical shape [E, N, K]):
        weight          (E, N, K/2)  u8       two e2m1 codes a byte, low nibble = even k
        weight_scale    (E, N, K/16) e4m3fn   one block scale per 16 consecutive k
        weight_scale_2  (E,) f32              per-expert global scale ((E, 1) accepted too)
        W[e, n, k] = e2m1(nibble) * weight_scale[e, n, k // 16] * weight_scale_2[e]

    packed (output; docs/layouts.md derives every permutation below):
        qweight       (E, K/16, 2N) i32   one row of 2N words per (expert, 16-k group)
        scales        (E, K/16, N)  u8    S0E5M3 bytes of s * 2**7, 8-byte units
        global_scale  (E,) f32            weight_scale_2 * 2**103 (bf16) or * 2**7 (fp16)

The GEMM dequantises in registers with bit tricks that leave power-of-two offsets
in the weight (2**-126 bf16 / 2**-14 fp16) and in the scale (2**7); the global scale
carries the compensation, which is why a packed object belongs to one activation
dtype.  Everything here is vectorised torch and runs on CPU or CUDA tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

import torch

from .errors import BadInputError
from .types import DType, WeightFormat

# ---- geometry of mma.sync.m16n8k16 and of the packed words -------------------------------------
SCALE_GROUP_K = 16  # k per e4m3 block scale == k of one m16n8k16 MMA: a packed row is one k-group
MMA_N = 8  # columns of one MMA B fragment; lane (g, t) owns column g of it
LANE_GROUPS = 8  # g = lane // 4: the column inside an 8-column block
LANE_THREADS = 4  # t = lane % 4: owns k = 2t, 2t+1 (register b0) and 2t+8, 2t+9 (b1)
LANES = LANE_GROUPS * LANE_THREADS
WORDS_PER_LANE = 4  # jj = 0..3: one 16-byte shared-memory load per lane per k-group
COLUMN_BLOCKS_PER_WORD = 2  # a word holds column c0 and c1 = c0 + 8
SLAB_N = MMA_N * COLUMN_BLOCKS_PER_WORD * WORDS_PER_LANE  # 64 columns per warp-wide load
WORDS_PER_SLAB = LANES * WORDS_PER_LANE  # 128 = 64 columns * 16 k / 8 nibbles
FP4_PER_WORD = 8
FP4_BITS = 4
# Stored dimensions are padded with zero weights to multiples of these: N to whole 64-column slabs,
# K to whole 64-deep k-tiles.  Where N = 64 (mod 128) no tile divides it: the GEMM's last N tile is
# masked past N (its copies there read nothing, its outputs there are not stored); a 128-deep tile's
# last k-tile likewise past K = 64 (mod 128).  The GEMM reads the logical N x K only.  (NF3 pads N to
# 128: its kernels have no masked N tiles.)
STORED_N_MULTIPLE = 64
STORED_K_MULTIPLE = 64
VECTOR_ELEMENTS = 8  # activations and outputs move in 16-byte vectors: logical N and K are multiples


def stored_dims(n: int, k: int, n_multiple: int = STORED_N_MULTIPLE) -> tuple[int, int]:
    """(N, K) as stored in the packed layout (NF3's: `n_multiple` 128): the logical sizes rounded up to the
    padding multiples."""
    return -(-n // n_multiple) * n_multiple, -(-k // STORED_K_MULTIPLE) * STORED_K_MULTIPLE

# A packed word holds 8 e2m1 codes; code i = (register j = i % 4, half h = i // 4) holds
# (k = 2t + dk, column c0 + 8 * half) for NIBBLE_SOURCES[i] = (dk, half).  The device decodes the
# word into four bf16x2/fp16x2 registers R0..R3 (low half = code j, high half = code j + 4): R0, R1
# are registers b0, b1 of column c0, R2, R3 those of column c1.
NIBBLE_SOURCES = ((0, 0), (8, 0), (0, 1), (8, 1), (1, 0), (9, 0), (1, 1), (9, 1))

# Where the bits of each code sit in the word ("split nibbles"; docs/layouts.md).  The decode puts a
# code's sign on the element's sign bit (15 / 31) and its 3 magnitude bits e1 e0 m on E2M1_MAG_TOP,
# -1, -2 (+16 for the high half): bits 8..6 in bf16, 11..9 in fp16.  Register j takes its sign bits
# from the word rotated right by a_j and its magnitude bits from the word rotated right by b_j, for
# (a_j, b_j) = E2M1_DECODE_ROTATIONS[dtype][j].  The four (a, b) cover the 32 bits exactly and were
# searched for the fewest integer-ALU instructions (the GEMM's bottleneck pipe): a rotation whose
# masked bits all wrap around is a left shift, which ptxas issues as IMAD.SHL on the FMA pipe.
# bf16: 7 ALU + 4 IMAD a word, fp16: 6 + 5 (the first split-nibble rotations needed 11 ALU).
E2M1_MAG_TOP = {DType.BF16: 8, DType.FP16: 11}
E2M1_DECODE_ROTATIONS = {
    DType.BF16: ((0, 0), (26, 26), (27, 29), (28, 6)),
    DType.FP16: ((0, 0), (29, 29), (30, 23), (31, 26)),
}


def e2m1_code_bits(dtype: DType) -> tuple[tuple[int, int, int, int], ...]:
    """For code i = j + 4h of a word: the word bit positions of (sign, e1, e0, m)."""
    top = E2M1_MAG_TOP[dtype]
    out = []
    for i in range(8):
        j, h = i % 4, i // 4
        a, b = E2M1_DECODE_ROTATIONS[dtype][j]
        out.append(((15 + 16 * h + a) % 32, *((top - d + 16 * h + b) % 32 for d in range(3))))
    return tuple(out)

# ---- block scales ------------------------------------------------------------------------------
SCALE_UNIT_BYTES = 8  # one unit: the 8 column blocks (b = 0..7) a lane group g meets in a slab
# Byte position p of a unit holds the scale of column block SCALE_BYTE_ORDER[p]: the 16-column
# fragment of column blocks (B0, B1) reads bytes 0 and 2 of the unit's first u32, (B2, B3) bytes 1
# and 3, (B4, B5) and (B6, B7) the same bytes of the second u32.
SCALE_BYTE_ORDER = (0, 2, 1, 3, 4, 6, 5, 7)
SCALE_STORE_EXPONENT = 7  # a byte stores v = s * 2**7: every e4m3 value then is a normal fp16
FP16_TO_S0E5M3_SHIFT = 7  # fp16 bits >> 7 keep 5 exponent + 3 mantissa bits (the sign is 0)
S0E5M3_MASK = 0xFF

# ---- power-of-two offsets of the device decode and their compensation ---------------------------
# The e2m1 bit trick drops the nibble's exponent into the element type's exponent field, so the
# decoded weight is w * 2**(e2m1 bias - element bias): 2**(1 - 127) in bf16, 2**(1 - 15) in fp16.
FP4_DECODE_EXPONENT = {DType.BF16: -126, DType.FP16: -14}
# The scale decode yields s * 2**SCALE_DECODE_EXPONENT: the fp16 one is the stored byte itself
# (s * 2**7); the bf16 one adds 128 to the byte's exponent to keep the product w * s in the normal
# range (s * 2**23, exact for every e4m3 scale).
SCALE_DECODE_EXPONENT = {DType.BF16: 23, DType.FP16: SCALE_STORE_EXPONENT}
GLOBAL_SCALE_COMPENSATION = {
    dt: 2.0 ** -(exponent + SCALE_DECODE_EXPONENT[dt]) for dt, exponent in FP4_DECODE_EXPONENT.items()
}  # bf16: 2**103, fp16: 2**7
# The same for e4m3 scales read as ModelOpt stores them (runtime/modelopt.py; codegen/intrinsics.py
# `scale_pairs_e4m3_*`): bf16 keeps the products w * s normal with s * 2**15, fp16 takes e4m3 exactly
# as it is.  A kernel records its exponent as the key fact `scale_exponent`, so a bundle built with
# another convention is refused instead of scaling by the wrong power of two.
MODELOPT_SCALE_EXPONENT = {DType.BF16: 15, DType.FP16: 0}


class W13Order(str, Enum):
    """Row order of a fused gate/up checkpoint tensor (gate = w1, up = w3)."""

    GATE_UP = "gate_up"  # ModelOpt's usual w13: gate rows [0, I), up rows [I, 2I)
    UP_GATE = "up_gate"  # w31: up rows first
    INTERLEAVED = "interleaved"  # gpt-oss: gate rows at even indices, up rows at odd ones


@dataclass(frozen=True, repr=False)  # __repr__: shapes, not tensor dumps
class PackedNvfp4:
    """NVFP4 weights of E experts in the packed layout, ready for the GEMM of one activation dtype.

    `layout` and `scale_format` are the values the GEMM's specialization key carries for this
    object.
    """

    layout: ClassVar[str] = "packed"
    scale_format: ClassVar[str] = "e4m3_k16"
    weights: ClassVar[WeightFormat] = WeightFormat.NVFP4

    qweight: torch.Tensor  # (E, Ks/16, 2Ns) i32, (Ns, Ks) = stored_dims(n, k)
    scales: torch.Tensor  # (E, Ks/16, Ns) u8, S0E5M3
    global_scale: torch.Tensor  # (E,) f32, compensation included
    num_experts: int
    n: int  # logical output features
    k: int  # logical input features
    dtype: DType
    bias: torch.Tensor | None = None  # (E, N) dtype per-expert bias added to the GEMM output, or None
    # layers run_w4a16_moe built on these weights, by options: they live and die with the weights
    functional_layers: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    # N is zero-padded to a multiple of this (stored_dims)
    stored_n_multiple: ClassVar[int] = STORED_N_MULTIPLE

    @property
    def n_stored(self) -> int:
        return stored_dims(self.n, self.k, self.stored_n_multiple)[0]

    @property
    def k_stored(self) -> int:
        return stored_dims(self.n, self.k, self.stored_n_multiple)[1]

    # one scale (and, in this layout, one packed row) per this many k
    scale_group_k: ClassVar[int] = SCALE_GROUP_K

    def __repr__(self) -> str:
        bias = ", bias" if self.bias is not None else ""
        return (f"{type(self).__name__}({self.weights.value}, experts={self.num_experts}, n={self.n}, k={self.k}, "
                f"{self.dtype.value}{bias}, {self.qweight.device}, {self.nbytes / 2**20:.1f} MiB)")

    @property
    def nbytes(self) -> int:
        """Device bytes of the weights: codes, scales, global scales and bias."""
        tensors = (self.qweight, self.scales, self.global_scale, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _qweight_shape(self) -> tuple[int, int, int]:
        return (self.num_experts, self.k_stored // SCALE_GROUP_K, 2 * self.n_stored)

    def _expected_tensors(self) -> dict[str, tuple[object, torch.dtype, tuple[int, ...]]]:
        """name -> (tensor, dtype, shape) this layout holds (a subclass's layout states its own)."""
        e = self.num_experts
        return {
            "qweight": (self.qweight, torch.int32, self._qweight_shape()),
            "scales": (self.scales, torch.uint8, (e, self.k_stored // self.scale_group_k, self.n_stored)),
            "global_scale": (self.global_scale, torch.float32, (e,)),
        }

    def __post_init__(self):
        e, n, cls = self.num_experts, self.n_stored, type(self).__name__
        expected = self._expected_tensors()
        for name, (tensor, dtype, shape) in expected.items():
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != shape:
                given = (tensor.dtype, tuple(tensor.shape)) if isinstance(tensor, torch.Tensor) else type(tensor)
                raise BadInputError(
                    f"{cls}.{name} must be a {dtype} tensor of shape {shape} "
                    f"(E={e}, N={n}, K={self.k}), got {given}"
                )
        if not isinstance(self.dtype, DType):
            raise BadInputError(f"{cls}.dtype must be a DType, got {self.dtype!r}")
        if self.n % VECTOR_ELEMENTS or self.k % self.scale_group_k:
            raise BadInputError(
                f"{cls} needs N % {VECTOR_ELEMENTS} == 0 and K % {self.scale_group_k} == 0, got N={self.n}, K={self.k}"
            )
        devices = {self.qweight.device, self.scales.device, self.global_scale.device}
        if self.bias is not None:
            b = self.bias
            if not isinstance(b, torch.Tensor) or b.dtype != self.dtype.torch or tuple(b.shape) != (e, self.n):
                given = (b.dtype, tuple(b.shape)) if isinstance(b, torch.Tensor) else type(b)
                raise BadInputError(f"{cls}.bias must be a {self.dtype.torch} tensor of shape {(e, self.n)} "
                                    f"(E, logical N) or None, got {given}")
            devices.add(b.device)
        # the kernels read every tensor densely from its start (16-byte chunks; global scales as floats): an
        # expanded (stride 0) or strided view would be read past its memory, or as other experts' values
        for name, align in (("qweight", 16), ("scales", 16), ("global_scale", 4), ("bias", 16)):
            t = getattr(self, name)
            if t is not None and (not t.is_contiguous() or t.data_ptr() % align):
                raise BadInputError(f"{cls}.{name} must be contiguous and start {align}-byte aligned (the kernels "
                                    f"read it densely), got strides {t.stride()}, address {t.data_ptr():#x}")
        if len(devices) != 1:
            raise BadInputError(f"{cls} tensors must share one device, got {sorted(map(str, devices))}")

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def to(self, device: torch.device | str) -> PackedNvfp4:
        """The same weights on another device (tensors copied; facts unchanged)."""
        return dataclasses.replace(
            self,
            qweight=self.qweight.to(device),
            scales=self.scales.to(device),
            global_scale=self.global_scale.to(device),
            bias=None if self.bias is None else self.bias.to(device),
        )


# ---- public API ----------------------------------------------------------------------------------


def pack_nvfp4(
    weight: torch.Tensor,  # (E, N, K/2) u8
    weight_scale: torch.Tensor,  # (E, N, K/16) e4m3fn
    weight_scale_2: torch.Tensor,  # (E,) or (E, 1) f32
    dtype: DType | str | torch.dtype,
) -> PackedNvfp4:
    """Pack one ModelOpt NVFP4 weight [E, N, K] for the GEMM with `dtype` activations."""
    return _pack_checked(weight, weight_scale, weight_scale_2, dtype, prefix="")


def unpack_nvfp4(packed: PackedNvfp4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ModelOpt tensors (weight, weight_scale, weight_scale_2 (E,)) a packed object holds.

    The exact inverse of `pack_nvfp4`, except that a block whose scale is zero comes back with zero
    codes (the packed form stores them so; the dequantized weights are the same zeros).
    """
    if not isinstance(packed, PackedNvfp4) or packed.weights is not WeightFormat.NVFP4:
        hint = {"nf3": " (use unpack_nf3)", "modelopt": " (its qweight and scales are the checkpoint's own "
                "weight and weight_scale; global_scale carries the decode compensation)"}
        raise BadInputError(f"packed must be a PackedNvfp4 of NVFP4 weights, got {type(packed).__name__}"
                            f"{hint.get(getattr(packed, 'layout', None), '')}")
    n, k = packed.n, packed.k
    scales = _decode_scale_values(_unorder_scale_bytes(packed.scales))[:, :n, : k // SCALE_GROUP_K]
    weight_scale = scales.to(torch.float8_e4m3fn)
    if not torch.equal(weight_scale.float(), scales):
        raise BadInputError(
            "packed holds block scales that e4m3 cannot express (weights packed from MXFP4 span more octaves "
            "than e4m3's); unpack_nvfp4 returns ModelOpt NVFP4 tensors, which cannot hold them")
    weight = _unpack_codes(packed.qweight, packed.n_stored, packed.k_stored, packed.dtype)[:, :n, : k // 2].contiguous()
    weight_scale = weight_scale.contiguous()
    weight_scale_2 = packed.global_scale / GLOBAL_SCALE_COMPENSATION[packed.dtype]
    return weight, weight_scale, weight_scale_2


def prepare_w13(
    weight: torch.Tensor,  # (E, 2I, H/2) u8
    weight_scale: torch.Tensor,  # (E, 2I, H/16) e4m3fn
    weight_scale_2: torch.Tensor,  # (E,), (E, 1) or (E, 2) = (gate, up) f32
    dtype: DType | str | torch.dtype,
    *,
    order: W13Order | str = W13Order.GATE_UP,
    bias: torch.Tensor | None = None,  # (E, 2I) in the checkpoint's row order
) -> PackedNvfp4:
    """Pack the fused gate/up projection as N = 2I columns [gate | up] (the activation's order).

    `order` says which half the checkpoint stores first; `bias` rows are reordered with the
    weight rows (gpt-oss's gate_up_proj_bias is interleaved like its weights).  A (E, 2) `weight_scale_2` is indexed
    by projection (column 0 = gate / w1, column 1 = up / w3) whatever `order` is.  When the two
    differ, the larger becomes the expert's global scale and the other half's block scales are
    multiplied by smaller / larger and re-rounded to e4m3 (lossy: up to half an e4m3 step, and
    re-rounding below e4m3's range gives zero); equal values are packed exactly.
    """
    row_order = _w13_order(order)
    elem = _check_dtype(dtype)
    if isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.shape[1] % 2:
        raise BadInputError(f"w13_weight has {weight.shape[1]} rows; [gate | up] needs an even count (2 * I)")
    num_experts, rows, k = _check_modelopt(weight, weight_scale, "w13_")
    weight_scale = _gate_up_rows(weight_scale, row_order)  # the codes are reordered slice by slice
    global_2, weight_scale = _merge_w13_global_scales(weight_scale_2, weight_scale, num_experts, rows // 2)
    bias = _check_bias(bias, "w13_bias", num_experts, rows, elem, weight.device, row_order)
    return _pack(weight, weight_scale, global_2, elem, num_experts, rows, k, "w13_", bias, row_order)


def prepare_w2(
    weight: torch.Tensor,  # (E, H, I/2) u8
    weight_scale: torch.Tensor,  # (E, H, I/16) e4m3fn
    weight_scale_2: torch.Tensor,  # (E,) or (E, 1) f32
    dtype: DType | str | torch.dtype,
    *,
    bias: torch.Tensor | None = None,  # (E, H)
) -> PackedNvfp4:
    """Pack the down projection: N = H output columns, K = I.

    Under tensor parallelism the partial outputs of the ranks are summed: give `bias` on one rank only.
    """
    return _pack_checked(weight, weight_scale, weight_scale_2, dtype, prefix="w2_", bias=bias)


# ---- MXFP4 (gpt-oss) -----------------------------------------------------------------------------
#
# An MXFP4 checkpoint stores the same e2m1 codes as NVFP4 (two a byte, low nibble = even k) with
# one power-of-two e8m0 scale 2**(e - 127) per 32 k.  Packing keeps the codes as stored and writes
# each e8m0 scale as the S0E5M3 byte of 2**(e - 127 - g) for both of its 16-k groups, with 2**g the
# expert's global scale: the kernels then compute exactly the checkpoint's values (no re-quantization).
# Exactness needs every block scale of an expert inside a window below its largest one:
MXFP4_BLOCK_K = 32
MXFP4_BLOCK_BYTES = MXFP4_BLOCK_K // 2
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# log2 of the scale relative to the global one: S0E5M3 bytes hold 2**-21 .. 2**8 as normal numbers
# (fp16 exponent field 1..30 of s * 2**7); in fp16 the product e2m1 * s * 2**-7 must keep its lowest
# bit (>= 2**-24), so fp16 takes 2**-16 .. 2**8.
MXFP4_EXPONENT_WINDOW = {DType.BF16: (-21, 8), DType.FP16: (-16, 8)}
_FP16_EXPONENT_BIAS = 15
_S0E5M3_MANTISSA_BITS = 3


def prepare_w13_mxfp4(
    blocks: torch.Tensor,  # (E, 2I, H/32, 16) u8, gpt-oss gate_up_proj_blocks
    scales: torch.Tensor,  # (E, 2I, H/32) u8 e8m0, gate_up_proj_scales
    dtype: DType | str | torch.dtype,
    *,
    order: W13Order | str = W13Order.INTERLEAVED,
    bias: torch.Tensor | None = None,  # (E, 2I), gate_up_proj_bias
) -> PackedNvfp4:
    """Pack an MXFP4 fused gate/up projection (gpt-oss: rows interleaved gate, up, gate, ...) as [gate | up].

    Exact: the packed weights decode to the checkpoint's e2m1 * 2**(e - 127) values.  An expert whose
    block scales span more than the window of MXFP4_EXPONENT_WINDOW (30 octaves in bf16, 25 in
    fp16) is refused rather than rounded.
    """
    row_order = _w13_order(order)
    elem = _check_dtype(dtype)
    num_experts, rows, k = _check_mxfp4(blocks, scales, "w13_")  # rows % 8 == 0: [gate | up] halves exist
    bias = _check_bias(bias, "w13_bias", num_experts, rows, elem, blocks.device, row_order)
    return _pack_mxfp4(blocks, scales, elem, num_experts, rows, k, "w13_", bias, row_order)


def prepare_w2_mxfp4(
    blocks: torch.Tensor,  # (E, H, I/32, 16) u8, gpt-oss down_proj_blocks
    scales: torch.Tensor,  # (E, H, I/32) u8 e8m0, down_proj_scales
    dtype: DType | str | torch.dtype,
    *,
    bias: torch.Tensor | None = None,  # (E, H), down_proj_bias
) -> PackedNvfp4:
    """Pack an MXFP4 down projection (N = H, K = I) exactly; see `prepare_w13_mxfp4`."""
    elem = _check_dtype(dtype)
    num_experts, n, k = _check_mxfp4(blocks, scales, "w2_")
    bias = _check_bias(bias, "w2_bias", num_experts, n, elem, blocks.device)
    return _pack_mxfp4(blocks, scales, elem, num_experts, n, k, "w2_", bias)


def _check_mxfp4(blocks: object, scales: object, prefix: str) -> tuple[int, int, int]:
    """Check MXFP4 blocks + e8m0 scales; returns (E, N, K)."""
    b_name, s_name = f"{prefix}blocks", f"{prefix}scales"
    _check_tensor(blocks, b_name, torch.uint8, "two e2m1 codes a byte, [E, N, K/32, 16]")
    _check_tensor(scales, s_name, torch.uint8, "one e8m0 scale per 32 k, [E, N, K/32]")
    if blocks.dim() != 4 or blocks.shape[-1] != MXFP4_BLOCK_BYTES or 0 in blocks.shape:
        raise BadInputError(f"{b_name} must be a non-empty [E, N, K/32, {MXFP4_BLOCK_BYTES}] tensor, "
                            f"got shape {tuple(blocks.shape)}")
    num_experts, n, groups = blocks.shape[:3]
    if n % VECTOR_ELEMENTS:
        raise BadInputError(f"N = {b_name}.shape[1] = {n} must be a multiple of {VECTOR_ELEMENTS}: the GEMM "
                            f"stores outputs in 16-byte vectors of {VECTOR_ELEMENTS} elements")
    if tuple(scales.shape) != (num_experts, n, groups):
        raise BadInputError(f"{s_name} must have shape [E, N, K/32] = {(num_experts, n, groups)} to match "
                            f"{b_name} {tuple(blocks.shape)}, got {tuple(scales.shape)}")
    if scales.device != blocks.device:
        raise BadInputError(f"{s_name} is on {scales.device} but {b_name} on {blocks.device}; use one device")
    nan = scales == E8M0_NAN
    if bool(nan.any()):
        first = [int(i) for i in nan.nonzero()[0]]
        raise BadInputError(f"{s_name} holds {int(nan.sum())} NaN scale(s) (e8m0 byte 0xFF), first at index {first}")
    return num_experts, n, groups * MXFP4_BLOCK_K


def _pack_mxfp4(blocks, scales, dtype: DType, num_experts: int, n: int, k: int, prefix: str,
                bias: torch.Tensor | None, row_order: W13Order = W13Order.GATE_UP) -> PackedNvfp4:
    """`blocks` and `scales` in the checkpoint's row order (`row_order`); packed as [gate | up]."""
    lo, hi = MXFP4_EXPONENT_WINDOW[dtype]
    scales = _gate_up_rows(scales, row_order)  # the blocks are reordered slice by slice
    exponent = scales.to(torch.int32) - E8M0_BIAS
    # a block of +-0 codes only has no value to keep: its scale is free (stored as zero)
    live = _gate_up_rows(torch.cat([(blocks[part] & 0x77).amax(dim=-1) != 0
                                    for part in _expert_slices(num_experts, n * k // 2)]), row_order)
    top = torch.where(live, exponent, torch.iinfo(torch.int32).min).amax(dim=(1, 2))
    bottom = torch.where(live, exponent, torch.iinfo(torch.int32).max).amin(dim=(1, 2))
    any_live = live.flatten(1).any(dim=1)
    global_exp = torch.where(any_live, top - hi, torch.zeros_like(top))  # the largest scale lands on 2**hi
    too_wide = any_live & (bottom - global_exp < lo)
    if bool(too_wide.any()):
        e = int(too_wide.nonzero()[0])
        raise BadInputError(
            f"{prefix}scales of expert {e} span 2**{int(bottom[e])} .. 2**{int(top[e])} ({int(top[e] - bottom[e]) + 1} "
            f"octaves); packing MXFP4 exactly for {dtype.value} allows {hi - lo + 1} octaves per expert "
            f"({int(too_wide.sum())} expert(s) exceed it). Its smallest blocks would lose precision; "
            "quantize such a layer to NVFP4 instead"
        )
    relative = exponent - global_exp.view(-1, 1, 1)
    field = relative + SCALE_STORE_EXPONENT + _FP16_EXPONENT_BIAS  # fp16 exponent field of s * 2**7
    scale_bytes = torch.where(live, field << _S0E5M3_MANTISSA_BITS, 0).to(torch.uint8)
    scale_bytes = scale_bytes.repeat_interleave(MXFP4_BLOCK_K // SCALE_GROUP_K, dim=-1)  # (E, N, K/16)
    weight = blocks.reshape(num_experts, n, k // 2)
    limit = torch.finfo(torch.float32).max / GLOBAL_SCALE_COMPENSATION[dtype]
    largest = hi + math.floor(math.log2(limit))  # the largest block exponent whose global scale fits
    if bool((any_live & (top > largest)).any()):
        e = int((any_live & (top > largest)).nonzero()[0])
        raise BadInputError(f"{prefix}scales of expert {e} reach 2**{int(top[e])}; {dtype.value} layers take e8m0 "
                            f"block scales up to 2**{largest} (the decode's compensation must fit float32)")
    global_scale = _global_scale(torch.exp2(global_exp.double()).float(), dtype, prefix)
    return _pack_encoded(weight, scale_bytes, global_scale, dtype, num_experts, n, k, bias, row_order)


# ---- validation ----------------------------------------------------------------------------------


def _check_dtype(dtype: object) -> DType:
    found = DType.parse(dtype)
    if found is None:
        raise BadInputError(
            f"dtype (the activations' dtype) must be one of {[d.value for d in DType]} (or \"bfloat16\" / "
            f"\"float16\", torch.bfloat16 / torch.float16), got {dtype!r}"
        )
    return found


def _check_tensor(t: object, name: str, dtype: torch.dtype, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise BadInputError(f"{name} must be a torch.Tensor ({what}), got {type(t).__name__}")
    if t.dtype != dtype:
        raise BadInputError(f"{name} must have dtype {dtype} ({what}), got {t.dtype}")
    if not t.is_contiguous():
        raise BadInputError(f"{name} must be contiguous, got strides {t.stride()}; call .contiguous()")
    return t


def _check_modelopt(weight: object, weight_scale: object, prefix: str) -> tuple[int, int, int]:
    """Check the ModelOpt weight + block scales; returns (E, N, K)."""
    w_name, s_name = f"{prefix}weight", f"{prefix}weight_scale"
    _check_tensor(weight, w_name, torch.uint8, "two e2m1 codes a byte, [E, N, K/2]")
    _check_tensor(weight_scale, s_name, torch.float8_e4m3fn, "one e4m3 scale per 16 k, [E, N, K/16]")
    if weight.dim() != 3:
        raise BadInputError(f"{w_name} must be 3-D [E, N, K/2], got shape {tuple(weight.shape)}")
    num_experts, n, k = weight.shape[0], weight.shape[1], 2 * weight.shape[2]
    if num_experts == 0 or n == 0 or k == 0:
        raise BadInputError(f"{w_name} must not be empty, got shape {tuple(weight.shape)}")
    if k % SCALE_GROUP_K:
        raise BadInputError(
            f"K = 2 * {w_name}.shape[2] = {k} must be a multiple of {SCALE_GROUP_K} "
            "(one e4m3 block scale and one packed row per 16 k)"
        )
    if n % VECTOR_ELEMENTS:
        raise BadInputError(
            f"N = {w_name}.shape[1] = {n} must be a multiple of {VECTOR_ELEMENTS}: the GEMM stores "
            f"outputs in 16-byte vectors of {VECTOR_ELEMENTS} elements"
        )
    expected = (num_experts, n, k // SCALE_GROUP_K)
    if tuple(weight_scale.shape) != expected:
        raise BadInputError(
            f"{s_name} must have shape [E, N, K/16] = {expected} to match {w_name} "
            f"{tuple(weight.shape)}, got {tuple(weight_scale.shape)}"
        )
    if weight_scale.device != weight.device:
        raise BadInputError(f"{s_name} is on {weight_scale.device} but {w_name} on {weight.device}; use one device")
    _check_scale_values(weight_scale, s_name)
    return num_experts, n, k


def _check_scale_values(weight_scale: torch.Tensor, name: str) -> None:
    """NaN (e4m3fn bytes 0x7F, 0xFF) or negative (sign bit on a nonzero magnitude) block scales are refused;
    read from the bytes (a float copy of a large layer's scales costs seconds)."""
    raw = weight_scale.view(torch.uint8)
    if not bool(((raw & 0x7F) == 0x7F).any() | (raw > 0x80).any()):
        return
    nan = (raw & 0x7F) == 0x7F
    for bad, what in ((nan, "NaN"), ((raw > 0x80) & ~nan, "negative")):
        count = int(bad.sum())
        if count:
            first = [int(i) for i in bad.nonzero()[0]]
            raise BadInputError(
                f"{name} holds {count} {what} block scale(s) (first at index {first}); "
                "NVFP4 block scales must be finite and >= 0"
            )


def _check_global_2(
    weight_scale_2: object, num_experts: int, device: torch.device, name: str, *, pair: bool,
    pair_hint: str = "(E, 2) gate/up pairs belong to prepare_w13",
) -> torch.Tensor:
    """Check weight_scale_2; returns it as (E,) or, when `pair` allows and it is (E, 2), as (E, 2)."""
    shapes = [(num_experts,), (num_experts, 1)] + ([(num_experts, 2)] if pair else [])
    _check_tensor(weight_scale_2, name, torch.float32, "per-expert global scale")
    if tuple(weight_scale_2.shape) not in shapes:
        hint = "" if pair else f" ({pair_hint})"
        raise BadInputError(
            f"{name} must have shape {' or '.join(str(s) for s in shapes)}{hint}, got {tuple(weight_scale_2.shape)}"
        )
    if weight_scale_2.device != device:
        raise BadInputError(f"{name} is on {weight_scale_2.device}, the weight on {device}; use one device")
    bad = ~torch.isfinite(weight_scale_2) | (weight_scale_2 < 0)
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise BadInputError(
            f"{name} must be finite and >= 0 (ModelOpt: expert amax / (6 * 448)), got {int(bad.sum())} bad "
            f"value(s), first {float(weight_scale_2[tuple(first)])} at index {first}"
        )
    return weight_scale_2 if tuple(weight_scale_2.shape) == (num_experts, 2) else weight_scale_2.reshape(-1)


def _pack_checked(weight, weight_scale, weight_scale_2, dtype, *, prefix: str, bias=None) -> PackedNvfp4:
    elem = _check_dtype(dtype)
    num_experts, n, k = _check_modelopt(weight, weight_scale, prefix)
    global_2 = _check_global_2(weight_scale_2, num_experts, weight.device, f"{prefix}weight_scale_2", pair=False)
    bias = _check_bias(bias, f"{prefix}bias", num_experts, n, elem, weight.device)
    return _pack(weight, weight_scale, global_2, elem, num_experts, n, k, prefix, bias)


def _w13_order(order: W13Order | str) -> W13Order:
    try:
        return W13Order(order)
    except ValueError:
        raise BadInputError(f"order must be one of {[o.value for o in W13Order]}, got {order!r}") from None


def _gate_up_rows(t: torch.Tensor, order: W13Order) -> torch.Tensor:
    """W13 rows (dim 1) stored in `order` -> [gate | up], the order the kernels read."""
    half = t.shape[1] // 2
    if order is W13Order.UP_GATE:
        return torch.cat((t[:, half:], t[:, :half]), dim=1)
    if order is W13Order.INTERLEAVED:  # gpt-oss: gate rows at even indices
        return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)
    return t


def _check_bias(bias: object, name: str, num_experts: int, n: int, dtype: DType, device: torch.device,
                order: W13Order = W13Order.GATE_UP) -> torch.Tensor | None:
    """A checkpoint bias (E, N) of any float dtype -> (E, N) `dtype`, rows in the kernels' order."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise BadInputError(f"{name} must be a floating-point torch.Tensor (E, N) or None, got "
                            f"{getattr(bias, 'dtype', type(bias).__name__)}")
    if tuple(bias.shape) != (num_experts, n):
        raise BadInputError(f"{name} must have shape (E, N) = {(num_experts, n)} to match the weight, "
                            f"got {tuple(bias.shape)}")
    if bias.device != device:
        raise BadInputError(f"{name} is on {bias.device}, the weight on {device}; use one device")
    out = _gate_up_rows(bias, order).to(dtype.torch).contiguous()
    if not bool(torch.isfinite(out).all()):
        raise BadInputError(f"{name} must be finite in {dtype.value}, got {int((~torch.isfinite(out)).sum())} "
                            f"non-finite value(s) (max |bias| {float(bias.abs().max()):g})")
    return out


def _merge_w13_global_scales(
    weight_scale_2: object, weight_scale: torch.Tensor, num_experts: int, half: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One global scale per expert; a (gate, up) pair is folded into the smaller half's block scales."""
    global_2 = _check_global_2(weight_scale_2, num_experts, weight_scale.device, "w13_weight_scale_2", pair=True)
    if global_2.dim() == 1:
        return global_2, weight_scale
    larger = global_2.max(dim=1).values  # (E,)
    raw = weight_scale.view(torch.uint8)  # indexed as bytes: float8 indexing is not on every device
    merged = raw.clone()
    for h in range(2):  # the half whose own scale is the larger one keeps its block scales (s * 1 == s)
        own = global_2[:, h]
        experts = (own != larger).nonzero().flatten()  # there larger > own >= 0
        rows = slice(h * half, (h + 1) * half)
        for part in _expert_slices(len(experts), half * weight_scale.shape[2] * 8):
            e = experts[part]
            # s * own / larger is computed in float64 (s * own is exact there), then rounded once to e4m3
            s = raw[e, rows].view(torch.float8_e4m3fn).double()
            scaled = s * own[e].double().view(-1, 1, 1) / larger[e].double().view(-1, 1, 1)
            merged[e, rows] = _e4m3_rounded_once(scaled).view(torch.uint8)
    return larger.contiguous(), merged.view(torch.float8_e4m3fn)


def _e4m3_rounded_once(x: torch.Tensor) -> torch.Tensor:
    """Finite float64 values >= 0 -> e4m3fn, rounded once to nearest (ties to even).

    torch converts float64 to float8 through float32, rounding twice: a value just above an e4m3
    midpoint may land on it in float32 and then tie to the lower neighbour.  Rounding to float32 by
    round-to-odd (truncate, then set the last bit where inexact) keeps every such value off the
    midpoints, so the second rounding is the only one that counts."""
    f = x.float()
    f = torch.where(f.double() > x, torch.nextafter(f, torch.zeros_like(f)), f)  # toward zero
    odd = (f.double() != x).to(torch.int32)
    return (f.view(torch.int32) | odd).view(torch.float32).to(torch.float8_e4m3fn)


# ---- packing -------------------------------------------------------------------------------------


def _pack(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,  # (E,) f32, checked
    dtype: DType,
    num_experts: int,
    n: int,
    k: int,
    prefix: str,
    bias: torch.Tensor | None = None,  # checked
    row_order: W13Order = W13Order.GATE_UP,  # of `weight` (W13); the scales are already [gate | up]
) -> PackedNvfp4:
    global_scale = _global_scale(weight_scale_2, dtype, prefix)
    return _pack_encoded(weight, _encode_scale_bytes(weight_scale), global_scale, dtype, num_experts, n, k, bias,
                         row_order)


def _global_scale(weight_scale_2: torch.Tensor, dtype: DType, prefix: str,
                  compensation: dict[DType, float] = GLOBAL_SCALE_COMPENSATION) -> torch.Tensor:
    """The per-expert global scale with the dtype's decode compensation (the layout's) folded in."""
    global_scale = weight_scale_2.float() * compensation[dtype]
    if not bool(torch.isfinite(global_scale).all()):
        limit = torch.finfo(torch.float32).max / compensation[dtype]
        raise BadInputError(
            f"{prefix}weight_scale_2 * {compensation[dtype]:g} (the {dtype.value} decode "
            f"compensation) overflows float32; {dtype.value} needs weight_scale_2 < {limit:g}, got max "
            f"{float(weight_scale_2.max()):g}"
        )
    return global_scale


def _pack_encoded(weight: torch.Tensor, scale_bytes: torch.Tensor, global_scale: torch.Tensor, dtype: DType,
                  num_experts: int, n: int, k: int, bias: torch.Tensor | None,
                  row_order: W13Order = W13Order.GATE_UP) -> PackedNvfp4:
    """(E, N, K/2) code bytes in `row_order` + (E, N, K/16) S0E5M3 scale bytes, [gate | up] -> the packed
    layout, a few experts at a time (a slice's codes are reordered on their own: no copy of the layer)."""
    n_stored, k_stored = stored_dims(n, k)
    qweight = torch.empty((num_experts, k_stored // SCALE_GROUP_K, 2 * n_stored), dtype=torch.int32,
                          device=weight.device)
    for part in _expert_slices(num_experts, n_stored * k_stored // 2):
        codes = _gate_up_rows(weight[part], row_order)
        qweight[part] = _pack_codes(_masked_codes(codes, scale_bytes[part], n_stored, k_stored), dtype)
    return PackedNvfp4(
        qweight=qweight,
        scales=_order_scale_bytes(_padded(scale_bytes, n_stored, k_stored // SCALE_GROUP_K)),
        global_scale=global_scale.contiguous(),
        num_experts=num_experts,
        n=n,
        k=k,
        dtype=dtype,
        bias=bias,
    )


def _padded(t: torch.Tensor, rows: int, columns: int, value: int = 0) -> torch.Tensor:
    """(E, r, c) -> (E, rows, columns) with `value` past r and c (NVFP4's padding: zero weights and zero
    scales, which contribute exactly 0)."""
    if tuple(t.shape[1:]) == (rows, columns):
        return t
    return torch.nn.functional.pad(t, (0, columns - t.shape[2], 0, rows - t.shape[1]), value=value)


def _masked_codes(weight: torch.Tensor, scale_bytes: torch.Tensor, n_stored: int, k_stored: int) -> torch.Tensor:
    """The code bytes as the packed layout stores them: padded, and zero where the block's scale is zero
    (the bf16 scale decode has no zero: it sets an exponent bit; zero codes give the same exact 0)."""
    weight = _padded(weight, n_stored, k_stored // 2)
    zero_block = _padded(scale_bytes, n_stored, k_stored // SCALE_GROUP_K) == 0
    return weight.masked_fill(zero_block.repeat_interleave(SCALE_GROUP_K // 2, dim=-1), 0)


# Packing by table lookup.  The two codes of one checkpoint byte (k = 2t + dk and 2t + dk + 1, the
# same column) are codes i and i + 4 of one word (NIBBLE_SOURCES), so a word is the OR of what its
# four source bytes (column half h, byte 4q + t of the row's 8-byte k-group) put in it; two source
# bytes side by side read as one 16-bit index, so a word is two lookups in tables of 65536 words.
# Unpacking reads a word's two 16-bit halves the same way, through tables of the four source bytes'
# bits each half holds.  Both work one slice of experts at a time, so the temporaries stay small (a
# layer of gpt-oss-120b is ~1 GB of codes).  (The bit-by-bit form took ~18 s a Qwen3-30B W13 on
# two CPU cores; this ~1 s.)
SOURCE_BYTES = 4  # per word: s = 2 * half + q
_CHUNK_BYTES = 1 << 24  # code bytes per slice of experts


def _source_byte(dk: int, half: int) -> tuple[int, int]:
    """(source byte s = 2 * half + q, nibble) of the code at k = 2t + dk of column half `half`."""
    return 2 * half + dk // 8, dk % 2


def _word_bit_owners(dtype: DType) -> dict[int, tuple[int, int]]:
    """word bit -> (source byte, bit inside it)."""
    owner = {}
    for (dk, half), positions in zip(NIBBLE_SOURCES, e2m1_code_bits(dtype)):
        s, nibble = _source_byte(dk, half)
        for code_bit, pos in zip((3, 2, 1, 0), positions):
            owner[pos] = (s, FP4_BITS * nibble + code_bit)
    assert sorted(owner) == list(range(32))
    return owner


def _bit_table(moves: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """(65536,) int32: for each 16-bit value, the bits `moves` (source bit, destination bit) set."""
    values = torch.arange(1 << 16, dtype=torch.int64, device=device)
    out = torch.zeros_like(values)
    for src, dst in moves:
        out |= (values >> src & 1) << dst
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


@functools.cache
def _pack_tables(dtype: DType, device: torch.device) -> torch.Tensor:
    """(2 * 65536,) int32: entry 65536 p + v = the word bits that source bytes 2p (v's low byte) and
    2p + 1 (its high byte) set."""
    owner = _word_bit_owners(dtype)
    return torch.cat([_bit_table([(8 * (s - 2 * p) + bit, pos) for pos, (s, bit) in owner.items() if s // 2 == p],
                                 device) for p in range(2)])


@functools.cache
def _unpack_tables(dtype: DType, device: torch.device) -> torch.Tensor:
    """(2 * 65536,) int32: entry 65536 h + v = the bits of the four source bytes (byte s of the int32)
    that word half h holding v carries."""
    owner = _word_bit_owners(dtype)
    return torch.cat([_bit_table([(pos - 16 * h, 8 * s + bit) for pos, (s, bit) in owner.items() if pos // 16 == h],
                                 device) for h in range(2)])


def _expert_slices(num_experts: int, per_expert: int) -> list[slice]:
    step = max(1, _CHUNK_BYTES // max(per_expert, 1))
    return [slice(e, min(e + step, num_experts)) for e in range(0, num_experts, step)]


def _lookup_pairs(table: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """(..., 4) u8 -> (...,) int32: the OR of table[v0] and table[65536 + v1], v0 / v1 its two
    little-endian 16-bit halves."""
    index = pairs.view(torch.int16).to(torch.int64) & 0xFFFF
    index[..., 1] += 1 << 16
    found = table[index]
    return found[..., 0] | found[..., 1]


def _pack_codes(weight: torch.Tensor, dtype: DType) -> torch.Tensor:
    """(E, N, K/2) u8 code bytes -> (E, K/16, 2N) i32 packed words (code bits at e2m1_code_bits(dtype));
    callers pass a slice of experts (`_expert_slices`)."""
    e, n, half_k = weight.shape
    slabs, groups = n // SLAB_N, 2 * half_k // SCALE_GROUP_K
    # n = 64 slab + 16 jj + 8 half + g ;  byte = 8 group + 4 q + t
    grid = weight.reshape(e, slabs, WORDS_PER_LANE, COLUMN_BLOCKS_PER_WORD, LANE_GROUPS, groups, 2, LANE_THREADS)
    # -> (E, group, slab, g, t, jj, s = 2 half + q): word index slab * 128 + (4g + t) * 4 + jj
    sources = grid.permute(0, 5, 1, 4, 7, 2, 3, 6).reshape(e, groups, 2 * n, SOURCE_BYTES)
    return _lookup_pairs(_pack_tables(dtype, weight.device), sources)


def _unpack_codes(qweight: torch.Tensor, n: int, k: int, dtype: DType) -> torch.Tensor:
    """(E, K/16, 2N) i32 packed words -> (E, N, K/2) u8 code bytes (inverse of _pack_codes)."""
    num_experts, groups = qweight.shape[0], qweight.shape[1]
    slabs = n // SLAB_N
    table = _unpack_tables(dtype, qweight.device)
    out = torch.empty((num_experts, n, k // 2), dtype=torch.uint8, device=qweight.device)
    for part in _expert_slices(num_experts, n * k // 2):
        e = part.stop - part.start
        words = qweight[part].contiguous().view(torch.uint8).view(e, groups, 2 * n, 4)  # little-endian bytes
        sources = _lookup_pairs(table, words).view(torch.uint8)  # (E, group, word, s)
        # (E, group, slab, g, t, jj, half, q) -> (E, slab, jj, half, g, group, q, t)
        sources = sources.view(e, groups, slabs, LANE_GROUPS, LANE_THREADS, WORDS_PER_LANE, COLUMN_BLOCKS_PER_WORD, 2)
        out[part] = sources.permute(0, 2, 5, 6, 3, 1, 7, 4).reshape(e, n, k // 2)
    return out


# ---- scales --------------------------------------------------------------------------------------


def _encode_scale_value(values: torch.Tensor) -> torch.Tensor:
    """e4m3 values -> S0E5M3 bytes of s * 2**7 (exact for every e4m3 value: each is a normal fp16 then)."""
    as_fp16 = (values.float() * 2.0**SCALE_STORE_EXPONENT).to(torch.float16)
    return ((as_fp16.view(torch.int16).to(torch.int32) >> FP16_TO_S0E5M3_SHIFT) & S0E5M3_MASK).to(torch.uint8)


E4M3_SMALLEST_NORMAL_BYTE = 0x08  # exponent field 1
E4M3_LARGEST_BYTE = 0x7E  # 448; 0x7F is NaN, bytes above carry the sign (refused by _check_scale_values)


@functools.cache
def _scale_byte_encoding() -> tuple[int, tuple[int, ...]]:
    """(offset, small): a normal e4m3 byte b encodes to b + offset (the exponent field gains the fp16
    bias, the mantissa stays), bytes 0..7 (zero, subnormals) to small[b]."""
    codes = _encode_scale_value(torch.arange(E4M3_LARGEST_BYTE + 1, dtype=torch.uint8).view(torch.float8_e4m3fn))
    offset = int(codes[E4M3_SMALLEST_NORMAL_BYTE]) - E4M3_SMALLEST_NORMAL_BYTE
    normal = torch.arange(E4M3_SMALLEST_NORMAL_BYTE, E4M3_LARGEST_BYTE + 1)
    assert torch.equal(codes[E4M3_SMALLEST_NORMAL_BYTE:].long(), normal + offset)
    return offset, tuple(int(c) for c in codes[:E4M3_SMALLEST_NORMAL_BYTE])


def _encode_scale_bytes(weight_scale: torch.Tensor) -> torch.Tensor:
    """(E, N, K/16) e4m3 (finite, >= 0: checked) -> (E, N, K/16) S0E5M3 bytes of s * 2**7, from the bytes:
    one add, and a lookup for the rare zero and subnormal ones."""
    offset, small = _scale_byte_encoding()
    raw = weight_scale.view(torch.uint8) & 0x7F  # -0 (0x80, the one signed byte the checks let in) is 0
    codes = raw + offset
    below = raw < E4M3_SMALLEST_NORMAL_BYTE
    if bool(below.any()):
        codes[below] = torch.tensor(small, dtype=torch.uint8, device=raw.device)[raw[below].long()]
    return codes


def _decode_scale_values(codes: torch.Tensor) -> torch.Tensor:
    """S0E5M3 bytes -> float32 block scales (the byte is fp16 bits 14..7 of s * 2**7)."""
    as_fp16 = (codes.to(torch.int16) << FP16_TO_S0E5M3_SHIFT).view(torch.float16)
    return as_fp16.float() * 2.0**-SCALE_STORE_EXPONENT


def _order_scale_bytes(codes: torch.Tensor) -> torch.Tensor:
    """(E, N, K/16) bytes -> (E, K/16, N): unit 8 * slab + g holds columns 64 * slab + 8b + g."""
    num_experts, n, groups = codes.shape
    order = torch.tensor(SCALE_BYTE_ORDER, device=codes.device)
    blocks = codes.view(num_experts, n // SLAB_N, MMA_N, LANE_GROUPS, groups)  # (E, slab, b, g, group)
    units = blocks.index_select(2, order)  # axis 2 is now the byte position inside a unit
    return units.permute(0, 4, 1, 3, 2).reshape(num_experts, groups, n)


def _unorder_scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    """(E, K/16, N) packed scale bytes -> (E, N, K/16) (inverse of _order_scale_bytes)."""
    num_experts, groups, n = scales.shape
    inverse = torch.argsort(torch.tensor(SCALE_BYTE_ORDER, device=scales.device))
    units = scales.view(num_experts, groups, n // SLAB_N, LANE_GROUPS, SCALE_UNIT_BYTES)
    blocks = units.permute(0, 2, 4, 3, 1).index_select(2, inverse)  # (E, slab, b, g, group)
    return blocks.reshape(num_experts, n, groups)
