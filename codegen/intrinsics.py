"""Inline-PTX device helpers for the W4A16 kernels: one `@dsl_user_op` per instruction.

Conventions used by every helper here:

* A "pair" (bf16x2 / half2) is one u32 register: element 0 in the low 16 bits,
  element 1 in the high 16 bits -- the order mma.sync fragments use.
* Shared-memory addresses are u32 offsets in the shared window (`Int32`, from
  `shared_ptr_to_u32`); global addresses are 64-bit generic addresses (`Int64`,
  from `gmem_address`).
* Every helper that touches memory or synchronises is emitted with side effects,
  so the compiler never hoists, merges or reorders it across barriers; pure
  arithmetic helpers are emitted without, so they schedule freely.

The weight/scale decodes are bit tricks with fixed power-of-two offsets (no
exponent-bias correction, which would cost an extra instruction per pair):

====================================  ===========================  ==============
decode                                result                       compensation
====================================  ===========================  ==============
e2m1 -> bf16 (`dequant_e2m1x8_bf16`)  w * 2**-126                  global scale
e2m1 -> fp16 (`dequant_e2m1x8_f16`)   w * 2**-14                   global scale
S0E5M3 scale -> bf16 pair             s * 2**23 (exact)            global scale
S0E5M3 scale -> fp16 pair             s * 2**7 (exact)             global scale
e8m0 scale -> bf16 / fp16             2**(e - 127) * 2**7          global scale
====================================  ===========================  ==============

so a product weight * scale carries 2**-103 (bf16) or 2**-7 (fp16); weight
preparation multiplies the per-expert global scale by 2**103 / 2**7 to undo it
(see docs/layouts.md, `runtime/weights.py`).
"""

from __future__ import annotations

import functools

from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import Float32, Int32, Int64, T, Uint32, dsl_user_op

import cutlass.cute as cute

from cuteaot.runtime.types import DType
from cuteaot.runtime.weights import E2M1_DECODE_ROTATIONS, MODELOPT_SCALE_EXPONENT

# Fixed power-of-two offsets of the bit-trick decodes (see the module docstring).
E2M1_BF16_DECODE_EXP = -126
E2M1_F16_DECODE_EXP = -14
SCALE_DECODE_EXP = 7
# the ModelOpt-layout bf16 scale pair holds s * 2**15 (fp16: s), the runtime's convention
MODELOPT_SCALE_EXP_BF16 = MODELOPT_SCALE_EXPONENT[DType.BF16]


def _ir(values, loc, ip):
    return [v.ir_value(loc=loc, ip=ip) for v in values]


def _asm(n_out: int, out_type, args, ptx: str, constraints: str, *, effects: bool, loc, ip):
    """Emit one inline-asm block; returns a list of `n_out` raw ir values."""
    if n_out == 0:
        ret = None
    elif n_out == 1:
        ret = out_type()
    else:
        ret = llvm.StructType.get_literal([out_type()] * n_out)
    res = llvm.inline_asm(
        ret, args, ptx, constraints, has_side_effects=effects, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )
    if n_out == 0:
        return []
    if n_out == 1:
        return [res]
    return [llvm.extractvalue(out_type(), res, [i], loc=loc, ip=ip) for i in range(n_out)]


def _u32(vals):
    return tuple(Uint32(v) for v in vals) if len(vals) > 1 else Uint32(vals[0])


def _f32(vals):
    return tuple(Float32(v) for v in vals) if len(vals) > 1 else Float32(vals[0])


# ----------------------------------------------------------------------------- addresses


def shared_ptr_to_u32(ptr: cute.Pointer) -> Int32:
    """Shared-window address of a shared-memory pointer."""
    return ptr.toint()


def gmem_address(ptr: cute.Pointer) -> Int64:
    """64-bit address of a global-memory pointer (add byte offsets as Int64)."""
    return ptr.toint()


# ----------------------------------------------------------------------------- decodes


_SIGN_BITS = 0x80008000
_E2M1_MAG_MASK = {DType.BF16: 0x01C001C0, DType.FP16: 0x0E000E00}  # e1 e0 m on 8..6 / 11..9 (+16)


def _shifted(lines: list, reg: str, r: int, bits: list) -> str:
    """PTX bringing word bits p + r (mod 32) to p for every p in `bits`; returns the operand name.

    If all of them wrap around it is a left shift (ptxas issues IMAD.SHL, off the integer ALU
    pipe), if none does a right shift, otherwise a rotate."""
    if r == 0:
        return "$4"
    if all(p + r >= 32 for p in bits):
        lines.append(f"shl.b32 {reg}, $4, {32 - r};")
    elif all(p + r < 32 for p in bits):
        lines.append(f"shr.b32 {reg}, $4, {r};")
    else:
        lines.append(f"shf.r.wrap.b32 {reg}, $4, $4, {r};")
    return reg


def _bit_positions(mask: int) -> list:
    return [p for p in range(32) if mask >> p & 1]


def _e2m1_word_ptx(dtype: DType) -> str:
    """PTX of the word decode: register j = sign bits of rotr(x, a_j) | magnitude bits of rotr(x, b_j)."""
    mag = _E2M1_MAG_MASK[dtype]
    lines = []
    for j, (a, b) in enumerate(E2M1_DECODE_ROTATIONS[dtype]):
        if a == b:  # one shift (none for 0) and one AND
            src = _shifted(lines, "t", a, _bit_positions(_SIGN_BITS | mag))
            lines.append(f"and.b32 ${j}, {src}, {_SIGN_BITS | mag:#010x};")
        else:  # sign bits and magnitude bits from two shifts; the second AND folds into the OR (LOP3)
            src = _shifted(lines, "s", a, _bit_positions(_SIGN_BITS))
            lines.append(f"and.b32 s, {src}, {_SIGN_BITS:#010x};")
            src = _shifted(lines, "t", b, _bit_positions(mag))
            lines += [f"and.b32 t, {src}, {mag:#010x};", f"or.b32 ${j}, s, t;"]
    return "{\n .reg .b32 s, t;\n " + "\n ".join(lines) + "\n}"


def _dequant_e2m1x8(dtype: DType, x: Uint32, loc, ip):
    out = _asm(4, T.i32, _ir([Uint32(x)], loc, ip), _e2m1_word_ptx(dtype), "=r,=r,=r,=r,r", effects=False,
               loc=loc, ip=ip)
    return _u32(out)


@dsl_user_op
def dequant_e2m1x8_bf16(x: Uint32, *, loc=None, ip=None):
    """One packed word (8 split-nibble e2m1 codes) -> four bf16x2 R0..R3 holding w * 2**-126.

    Register j's low / high element is code j / j + 4 of the word, whose bits sit where
    `runtime.weights.e2m1_code_bits` says: the sign lands on bit 15 / 31 and e1 e0 m on
    bits 8..6 / 24..22 (the two low exponent bits and the top mantissa bit), so with the
    bf16 bias of 127 instead of 1 the value is w * 2**-126, zero and subnormal codes included.
    7 integer-ALU instructions and 4 left shifts (IMAD) for 8 weights (docs/layouts.md, "qweight words").
    """
    return _dequant_e2m1x8(DType.BF16, x, loc, ip)


@dsl_user_op
def dequant_e2m1x8_f16(x: Uint32, *, loc=None, ip=None):
    """As `dequant_e2m1x8_bf16` for half2: e1 e0 m on bits 11..9 / 27..25, w * 2**-14."""
    return _dequant_e2m1x8(DType.FP16, x, loc, ip)


def _s0e5m3_halves_ptx(byte: int, dtype: DType) -> str:
    # prmt selector nibbles (pos 0..3): bytes `byte` and `byte + 2` of $1 into positions 0 and 2,
    # bytes 1 and 3 of the constant c (index 5, 7) into positions 1 and 3; c holds the exponent bit
    # that the shift then carries to bit 14 / 30 (bf16) or nothing (fp16).  The shift is a plain left
    # shift, which ptxas issues as IMAD.SHL, off the integer ALU pipe the weight decode fills.
    shift, high = (4, 0x04000400) if dtype is DType.BF16 else (7, 0)
    return ("{\n .reg .b32 t, c;\n"
            f" mov.b32 c, {high:#010x};\n prmt.b32 t, $1, c, {0x7250 | byte * 0x0101:#06x};\n"
            f" shl.b32 $0, t, {shift};\n}}")


@dsl_user_op
def scale_halves_s0e5m3_bf16(q: Uint32, byte: int, *, loc=None, ip=None) -> Uint32:
    """S0E5M3 scale bytes `byte` and `byte + 2` (byte 0 or 1) of q -> (s_byte, s_byte+2) as bf16x2, each
    holding s * 2**23, exact for every byte a prepared e4m3 scale produces (exponent field >= 1).

    A prepared byte is v = s * 2**7 with 5 exponent bits e (bias 15) and 3 mantissa bits and no
    sign.  Putting it on bf16 bits 11..4 and setting bit 14 gives bf16 exponent e + 128, mantissa
    m: 2**(e + 1) * (1 + m / 8) = v * 2**16.  Two scales for one prmt and one left shift:
        t = prmt(q, 0x04000400, 0x7250 | byte * 0x0101)  # 0x04bb04aa
        halves = t << 4
    A weight word's two column blocks take one half each (`bf16x2_mul_half`: ptxas reads the half
    through the multiply's operand selector, .H0_H0 / .H1_H1, so the broadcast costs nothing).
    An exponent-0 byte (v < 2**-14, never produced: e4m3 scales are >= 2**-9) reads as the normal
    2**1 * (1 + m / 8) instead of its subnormal value.
    """
    return _u32(_asm(1, T.i32, _ir([Uint32(q)], loc, ip), _s0e5m3_halves_ptx(int(byte), DType.BF16), "=r,r",
                     effects=False, loc=loc, ip=ip))


@dsl_user_op
def scale_halves_s0e5m3_f16(q: Uint32, byte: int, *, loc=None, ip=None) -> Uint32:
    """As `scale_halves_s0e5m3_bf16` for half2: each half holds s * 2**7 (exact for every byte: S0E5M3 is
    fp16 without the sign and the low 7 mantissa bits): prmt with zeros, then t << 7."""
    return _u32(_asm(1, T.i32, _ir([Uint32(q)], loc, ip), _s0e5m3_halves_ptx(int(byte), DType.FP16), "=r,r",
                     effects=False, loc=loc, ip=ip))


# ----------------------------------------------------------------------------- NVFP4 as ModelOpt stores it
# A lane's word is 4 bytes of one weight row, as ldmatrix hands them over: 8 consecutive codes,
# code j on bits 4j .. 4j+3 (two a byte, the even k in the low nibble; docs/layouts.md, "NVFP4 read
# as stored").


@functools.cache
def _modelopt_word_plan(dtype: DType) -> tuple:
    """The cheapest merge plan of `modelopt_word_ptx`: two groups of two pairs, each group with the shift t of
    its magnitude fields (its sign fields take t + d, d = where the pair's sign bit sits above its magnitude
    field, less 3), then per pair the shift s_j that brings its fields onto the split-nibble decode's bits.
    Valid where, for both codes j, j + 4 of each pair of a group, no field leaves the word and no sign field
    lands on a magnitude field.  Cost: shifts that are not 0, one select per group, one mask per pair."""
    low = {DType.BF16: 6, DType.FP16: 9}[dtype]  # lowest magnitude bit of the element
    d = 15 - low - 3
    best = None
    for first in ((0, 1), (0, 2), (0, 3)):
        groups = (first, tuple(j for j in range(4) if j not in first))
        plan, cost = [], 0
        for group in groups:
            options = []
            for t in range(-31, 32):
                mags = {4 * c + b + t for j in group for c in (j, j + 4) for b in range(3)}
                signs = {4 * c + 3 + t + d for j in group for c in (j, j + 4)}
                if all(0 <= p < 32 for p in mags | signs) and not mags & signs:
                    shifts = {j: low - 4 * j - t for j in group}
                    options.append(((t != 0) + (t + d != 0) + sum(v != 0 for v in shifts.values()), t, shifts))
            if not options:
                break
            c, t, shifts = min(options, key=lambda o: (o[0], abs(o[1])))
            plan.append((group, t, shifts))
            cost += c
        else:
            if best is None or cost < best[0]:
                best = (cost, tuple(plan))
    return best[1]


@functools.cache
def modelopt_word_ptx(dtype: DType) -> str:
    """PTX of `dequant_e2m1_codes_*`: $4 = the word; $0..$3 = pairs (code j, code j + 4).

    Codes j and j + 4 sit 16 bits apart, on the same bits of the two halves, so one shift moves a pair's
    fields together.  A pair's sign must land 15 - low bits above its magnitude field (bf16: 9, fp16: 6)
    but sits 3 above it in the word, so the word is first merged per group of two pairs
    (`_modelopt_word_plan`): magnitudes from x << t, signs from x << (t + d), one lop3 select; then each pair
    is one shift (none for one pair of a group) and one mask.  11 instructions for 8 weights, the left
    shifts off the integer ALU (IMAD.SHL), as the packed word's decode."""
    mag = _E2M1_MAG_MASK[dtype]
    low = {DType.BF16: 6, DType.FP16: 9}[dtype]
    d = 15 - low - 3

    def shifted(dst: str, src: str, by: int, lines: list) -> str:
        if by == 0:
            return src
        lines.append(f"shl.b32 {dst}, {src}, {by};" if by > 0 else f"shr.b32 {dst}, {src}, {-by};")
        return dst

    lines: list[str] = []
    for g, (group, t, shifts) in enumerate(_modelopt_word_plan(dtype)):
        mag_bits = sum(1 << (4 * c + b + t) for j in group for c in (j, j + 4) for b in range(3))
        a = shifted("a", "$4", t, lines)
        b = shifted("b", "$4", t + d, lines)
        lines.append(f"lop3.b32 c{g}, {a}, {b}, {mag_bits:#010x}, 0xe4;")  # (a & m) | (b & ~m)
        for j in group:
            src = shifted("a", f"c{g}", shifts[j], lines)
            lines.append(f"and.b32 ${j}, {src}, {_SIGN_BITS | mag:#010x};")
    return "{\n .reg .b32 a, b, c0, c1;\n " + "\n ".join(lines) + "\n}"


@dsl_user_op
def dequant_e2m1_codes_bf16(x: Uint32, *, loc=None, ip=None):
    """Four bytes of a ModelOpt weight row (8 e2m1 codes) -> four bf16x2, pair j = (code j, code j + 4)
    holding w * 2**-126, as `dequant_e2m1x8_bf16` (the GEMM pairs the activations the same way)."""
    return _u32(_asm(4, T.i32, _ir([Uint32(x)], loc, ip), modelopt_word_ptx(DType.BF16), "=r,=r,=r,=r,r",
                     effects=False, loc=loc, ip=ip))


@dsl_user_op
def dequant_e2m1_codes_f16(x: Uint32, *, loc=None, ip=None):
    """As `dequant_e2m1_codes_bf16` for half2, w * 2**-14."""
    return _u32(_asm(4, T.i32, _ir([Uint32(x)], loc, ip), modelopt_word_ptx(DType.FP16), "=r,=r,=r,=r,r",
                     effects=False, loc=loc, ip=ip))


def e2m1_byte_selector(byte):
    """The prmt selector `dequant_e2m1_byte_*` takes for byte `byte` (0..3, an Int32 or an int) of its
    word: byte `byte` of (word << 4) onto positions 0 and 1, byte `byte` of the word onto 2 and 3."""
    return byte * 0x11 + (byte + 4) * 0x1100


def modelopt_byte_ptx(dtype: DType) -> str:
    """PTX of `dequant_e2m1_byte_*`: $1 = the word, $2 = the selector (e2m1_byte_selector); $0 = the pair
    (low code, high code) of the selected byte.

    One prmt puts that byte of (word << 4) on bits 8..15 and the byte itself on bits 24..31: its low
    code then sits on bits 12..15 and its high code on bits 28..31, both signs on the pair's sign bits
    (15, 31); one right shift brings both magnitudes onto the split-nibble decode's bits (bf16 8..6 /
    24..22, fp16 11..9 / 27..25), and two masks keep the fields."""
    mag = _E2M1_MAG_MASK[dtype]
    shift = {DType.BF16: 6, DType.FP16: 3}[dtype]
    return ("{\n .reg .b32 u, y, z;\n shl.b32 u, $1, 4;\n prmt.b32 y, u, $1, $2;\n"
            f" shr.b32 z, y, {shift};\n and.b32 z, z, {mag:#010x};\n and.b32 y, y, {_SIGN_BITS:#010x};\n"
            " or.b32 $0, y, z;\n}")


@dsl_user_op
def dequant_e2m1_byte_bf16(x: Uint32, selector: Int32, *, loc=None, ip=None) -> Uint32:
    """One byte of a ModelOpt weight row (two consecutive e2m1 codes, the even k in the low nibble),
    picked by `selector` (e2m1_byte_selector) -> bf16x2 (low code, high code) holding w * 2**-126, as
    `dequant_e2m1x8_bf16`: k order as stored, for the wgmma loop whose activations stay in shared
    memory (shift, prmt, shift, two logic ops)."""
    return _u32(_asm(1, T.i32, _ir([Uint32(x), Int32(selector)], loc, ip), modelopt_byte_ptx(DType.BF16), "=r,r,r",
                     effects=False, loc=loc, ip=ip))


@dsl_user_op
def dequant_e2m1_byte_f16(x: Uint32, selector: Int32, *, loc=None, ip=None) -> Uint32:
    """As `dequant_e2m1_byte_bf16` for half2, w * 2**-14."""
    return _u32(_asm(1, T.i32, _ir([Uint32(x), Int32(selector)], loc, ip), modelopt_byte_ptx(DType.FP16), "=r,r,r",
                     effects=False, loc=loc, ip=ip))


PAIR_HALVES_SELECTOR = {0: 0x5410, 1: 0x7632}  # prmt: (a.lo, b.lo) / (a.hi, b.hi)


@dsl_user_op
def pair_halves(a: Uint32, b: Uint32, high: int, *, loc=None, ip=None) -> Uint32:
    """(a.lo, b.lo) for high = 0, (a.hi, b.hi) for high = 1: one prmt."""
    return _u32(_asm(1, T.i32, _ir([Uint32(a), Uint32(b)], loc, ip),
                     f"prmt.b32 $0, $1, $2, {PAIR_HALVES_SELECTOR[int(high)]:#06x};", "=r,r,r",
                     effects=False, loc=loc, ip=ip))


def e4m3_pairs_selector(byte):
    """The prmt selector `scale_pairs_e4m3_*` takes for scale byte `byte` (0..3, an Int32 or an int):
    that byte of the first word onto position 0, of the second onto position 1 (2 and 3 unused)."""
    return byte + (byte + 4) * 0x10


# fp16 bits >> 3 read as bf16 are s * 2**-112; this bf16x2 multiplier (2**127 each) makes them
# s * 2**MODELOPT_SCALE_EXP_BF16
_BF16_SCALE_MULTIPLIER = ((MODELOPT_SCALE_EXP_BF16 + 112 + 127) << 7) * 0x10001
assert 0 < MODELOPT_SCALE_EXP_BF16 + 112 + 127 < 255, MODELOPT_SCALE_EXP_BF16


def e4m3_pairs_ptx(dtype: DType) -> str:
    """PTX of `scale_pairs_e4m3_*`: $2, $3 = two scale words, $4 = the selector; $0 = the pair of $2's
    byte, $1 = the pair of $3's, each (s, s).

    One prmt puts both bytes side by side and one cvt.rn.f16x2.e4m3x2 converts them exactly (zero and
    subnormals included: every e4m3 value is a normal f16).  bf16 goes on without leaving the register:
    an f16 shifted right by 3 is the bf16 of the same significand with the exponent bias 15 read as
    127, i.e. s * 2**-112 (e4m3 leaves the f16's low 7 mantissa bits zero, so nothing crosses from the
    upper half), and one multiply by 2**127 makes it s * 2**15 (MODELOPT_SCALE_EXP_BF16).  The sign
    bits are cleared first so that -0 reads as 0 (negative scales are refused when weights are
    prepared)."""
    head = " .reg .b32 t, c, k;\n .reg .b16 h, hh, lo, hi;\n prmt.b32 t, $2, $3, $4;\n"
    if dtype is DType.FP16:
        body = " mov.b32 {h, hh}, t;\n cvt.rn.f16x2.e4m3x2 c, h;\n"
    else:
        body = (" and.b32 t, t, 0x7F7F;\n mov.b32 {h, hh}, t;\n cvt.rn.f16x2.e4m3x2 c, h;\n"
                f" shr.b32 c, c, 3;\n mov.b32 k, {_BF16_SCALE_MULTIPLIER:#010x};\n mul.rn.bf16x2 c, c, k;\n")
    tail = " mov.b32 {lo, hi}, c;\n mov.b32 $0, {lo, lo};\n mov.b32 $1, {hi, hi};\n"
    return "{\n" + head + body + tail + "}"


@dsl_user_op
def scale_pairs_e4m3_bf16(p: Uint32, q: Uint32, selector: Int32, *, loc=None, ip=None):
    """The e4m3 scale bytes `selector` picks (e4m3_pairs_selector) of p and of q -> ((sp, sp), (sq, sq))
    as bf16x2 holding s * 2**15, exact for every e4m3 value (zero and subnormals included): prmt, and,
    e4m3x2 -> f16x2, shift, multiply for both scales."""
    return _u32(_asm(2, T.i32, _ir([Uint32(p), Uint32(q), Int32(selector)], loc, ip), e4m3_pairs_ptx(DType.BF16),
                     "=r,=r,r,r,r", effects=False, loc=loc, ip=ip))


@dsl_user_op
def scale_pairs_e4m3_f16(p: Uint32, q: Uint32, selector: Int32, *, loc=None, ip=None):
    """As `scale_pairs_e4m3_bf16` for half2 holding s itself: prmt, then one e4m3x2 -> f16x2 conversion."""
    return _u32(_asm(2, T.i32, _ir([Uint32(p), Uint32(q), Int32(selector)], loc, ip), e4m3_pairs_ptx(DType.FP16),
                     "=r,=r,r,r,r", effects=False, loc=loc, ip=ip))


@dsl_user_op
def dequant_e8m0x4_bf16(q: Uint32, *, loc=None, ip=None):
    """Four e8m0 (MX) scale bytes -> (bytes 0,2), (bytes 1,3) as bf16x2 holding 2**(e-127) * 2**7.

    The bf16 exponent field is e + 7, saturated at 255 (inf); e = 0xFF (NaN) decodes to inf.
    """
    out = _asm(
        2, T.i32, _ir([Uint32(q)], loc, ip),
        "{\n .reg .b32 t, top;\n mov.b32 top, 0x00FF00FF;\n"
        " and.b32 t, $2, 0x00FF00FF;\n add.u32 t, t, 0x00070007;\n min.u16x2 t, t, top;\n"
        " shl.b32 $0, t, 7;\n"
        " shr.b32 t, $2, 8;\n and.b32 t, t, 0x00FF00FF;\n add.u32 t, t, 0x00070007;\n"
        " min.u16x2 t, t, top;\n shl.b32 $1, t, 7;\n}",
        "=r,=r,r", effects=False, loc=loc, ip=ip,
    )
    return _u32(out)


@dsl_user_op
def dequant_e8m0x4_f16(q: Uint32, *, loc=None, ip=None):
    """Four e8m0 scale bytes -> (bytes 0,2), (bytes 1,3) as half2 holding 2**(e-127) * 2**7.

    The fp16 exponent field is e - 105, clamped to [0, 31]: exact for
    106 <= e <= 135, zero below (scale < 2**-21), inf above (scale >= 2**9).
    """
    out = _asm(
        2, T.i32, _ir([Uint32(q)], loc, ip),
        "{\n .reg .b32 t, lo, top;\n mov.b32 lo, 0x00690069;\n mov.b32 top, 0x001F001F;\n"
        " and.b32 t, $2, 0x00FF00FF;\n max.u16x2 t, t, lo;\n sub.u32 t, t, lo;\n"
        " min.u16x2 t, t, top;\n shl.b32 $0, t, 10;\n"
        " shr.b32 t, $2, 8;\n and.b32 t, t, 0x00FF00FF;\n max.u16x2 t, t, lo;\n"
        " sub.u32 t, t, lo;\n min.u16x2 t, t, top;\n shl.b32 $1, t, 10;\n}",
        "=r,=r,r", effects=False, loc=loc, ip=ip,
    )
    return _u32(out)


@dsl_user_op
def nf3_gather(x0: Uint32, x1: Uint32, x2: Uint32, *, loc=None, ip=None) -> Uint32:
    """The fourth NF3 decode word of a 16-k row, from the leftover bits {4, 6} of each byte of x0..x2."""
    from cuteaot.runtime.nf3 import GATHER_MASKS

    m0, m1, m2 = GATHER_MASKS
    out = _asm(
        1, T.i32, _ir([Uint32(x0), Uint32(x1), Uint32(x2)], loc, ip),
        "{\n .reg .b32 a, b;\n"
        f" shr.b32 a, $1, 4;\n and.b32 a, a, {m0:#010x};\n"
        f" shr.b32 b, $2, 3;\n and.b32 b, b, {m1:#010x};\n or.b32 a, a, b;\n"
        f" shl.b32 b, $3, 1;\n and.b32 b, b, {m2:#010x};\n or.b32 $0, a, b;\n}}",
        "=r,r,r,r", effects=False, loc=loc, ip=ip,
    )
    return _u32(out)


@dsl_user_op
def dequant_nf3_word_bf16(y: Uint32, *, loc=None, ip=None):
    """One NF3 decode word (8 codes) -> four bf16x2 R0..R3 holding the code points themselves.

    Per bit group r (0, then 2) the word is shifted right by r; then for each unit u (byte) the
    magnitude m sits on bits 0..1 and the sign on bit 5.  t = (y & 0x23..) | 0x40.. and
    t + 8 * (y & 0x02..) make each byte a pair of prmt selector nibbles, (m, 4 + (m >> 1) + 2 * sign):
    the low byte of the bf16 code point from POOL_A, its high byte from POOL_B
    (runtime/nf3.py).  Units 0, 1 give R0 (R2), units 2, 3 give R1 (R3).
    """
    from cuteaot.runtime.nf3 import (
        DECODE_INFO_MASK, DECODE_M1_COPY, DECODE_M1_MASK, DECODE_POOL_B_INDEX, GROUP_SHIFTS, POOL_A, POOL_B,
    )

    def group(w: str, r0: int, r1: int) -> str:  # registers $r0 (units 0, 1) and $r1 (units 2, 3) from word w
        return (f" and.b32 t, {w}, {DECODE_INFO_MASK:#010x};\n or.b32 t, t, {DECODE_POOL_B_INDEX:#010x};\n"
                f" and.b32 u, {w}, {DECODE_M1_MASK:#010x};\n mad.lo.u32 s, u, {DECODE_M1_COPY}, t;\n"
                f" prmt.b32 ${r0}, $5, $6, s;\n shr.b32 s, s, 16;\n prmt.b32 ${r1}, $5, $6, s;\n")

    out = _asm(
        4, T.i32, _ir([Uint32(y), Uint32(POOL_A), Uint32(POOL_B)], loc, ip),
        "{\n .reg .b32 w, t, u, s;\n" + group("$4", 0, 1)
        + f" shr.b32 w, $4, {GROUP_SHIFTS[1]};\n" + group("w", 2, 3) + "}",
        "=r,=r,=r,=r,r,r,r", effects=False, loc=loc, ip=ip,
    )
    return _u32(out)


# ----------------------------------------------------------------------------- pair arithmetic


@dsl_user_op
def bf16x2_mul(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Element-wise bf16x2 product (round to nearest; subnormals kept)."""
    return _u32(_asm(1, T.i32, _ir([Uint32(a), Uint32(b)], loc, ip), "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r",
                     effects=False, loc=loc, ip=ip))


@dsl_user_op
def f16x2_mul(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Element-wise half2 product (round to nearest)."""
    return _u32(_asm(1, T.i32, _ir([Uint32(a), Uint32(b)], loc, ip), "mul.rn.f16x2 $0, $1, $2;", "=r,r,r",
                     effects=False, loc=loc, ip=ip))


def _mul_half_ptx(kind: str, half: int) -> str:
    h = "{l, l}" if half == 0 else "{h, h}"
    return ("{\n .reg .b16 l, h;\n .reg .b32 b;\n mov.b32 {l, h}, $2;\n"
            f" mov.b32 b, {h};\n mul.rn.{kind} $0, $1, b;\n}}")


@dsl_user_op
def bf16x2_mul_half(a: Uint32, s: Uint32, half: int, *, loc=None, ip=None) -> Uint32:
    """a * (s.lo, s.lo) for half 0, a * (s.hi, s.hi) for half 1, bf16x2, round to nearest: one HMUL2
    (ptxas folds the broadcast into the operand selector .H0_H0 / .H1_H1)."""
    return _u32(_asm(1, T.i32, _ir([Uint32(a), Uint32(s)], loc, ip), _mul_half_ptx("bf16x2", int(half)),
                     "=r,r,r", effects=False, loc=loc, ip=ip))


@dsl_user_op
def f16x2_mul_half(a: Uint32, s: Uint32, half: int, *, loc=None, ip=None) -> Uint32:
    """As `bf16x2_mul_half` for half2."""
    return _u32(_asm(1, T.i32, _ir([Uint32(a), Uint32(s)], loc, ip), _mul_half_ptx("f16x2", int(half)),
                     "=r,r,r", effects=False, loc=loc, ip=ip))


@dsl_user_op
def pair_broadcast_lane(x: Uint32, lane: int, *, loc=None, ip=None) -> Uint32:
    """(x.lo, x.lo) for lane 0, (x.hi, x.hi) for lane 1 -- one prmt."""
    selector = {0: "0x1010", 1: "0x3232"}[int(lane)]
    return _u32(_asm(1, T.i32, _ir([Uint32(x)], loc, ip), f"prmt.b32 $0, $1, $1, {selector};", "=r,r",
                     effects=False, loc=loc, ip=ip))


@dsl_user_op
def f32_to_bf16x2_broadcast(x: Float32, *, loc=None, ip=None) -> Uint32:
    """(bf16(x), bf16(x)), round to nearest."""
    return _u32(_asm(1, T.i32, _ir([Float32(x)], loc, ip), "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f",
                     effects=False, loc=loc, ip=ip))


@dsl_user_op
def f32_to_f16x2_broadcast(x: Float32, *, loc=None, ip=None) -> Uint32:
    """(half(x), half(x)), round to nearest."""
    return _u32(_asm(1, T.i32, _ir([Float32(x)], loc, ip), "cvt.rn.f16x2.f32 $0, $1, $1;", "=r,f",
                     effects=False, loc=loc, ip=ip))


@dsl_user_op
def pack_f32x2_bf16x2(x0: Float32, x1: Float32, *, loc=None, ip=None) -> Uint32:
    """(bf16(x0), bf16(x1)) with x0 in the low half (cvt takes the high operand first)."""
    return _u32(_asm(1, T.i32, _ir([Float32(x0), Float32(x1)], loc, ip), "cvt.rn.bf16x2.f32 $0, $2, $1;",
                     "=r,f,f", effects=False, loc=loc, ip=ip))


@dsl_user_op
def pack_f32x2_f16x2(x0: Float32, x1: Float32, *, loc=None, ip=None) -> Uint32:
    """(half(x0), half(x1)) with x0 in the low half."""
    return _u32(_asm(1, T.i32, _ir([Float32(x0), Float32(x1)], loc, ip), "cvt.rn.f16x2.f32 $0, $2, $1;",
                     "=r,f,f", effects=False, loc=loc, ip=ip))


@dsl_user_op
def bf16x2_to_f32x2(x: Uint32, *, loc=None, ip=None):
    """(float(x.lo), float(x.hi)) -- exact."""
    return _f32(_asm(
        2, T.f32, _ir([Uint32(x)], loc, ip),
        "{\n .reg .b32 t;\n shl.b32 t, $2, 16;\n mov.b32 $0, t;\n and.b32 t, $2, 0xFFFF0000;\n mov.b32 $1, t;\n}",
        "=f,=f,r", effects=False, loc=loc, ip=ip,
    ))


@dsl_user_op
def f16x2_to_f32x2(x: Uint32, *, loc=None, ip=None):
    """(float(x.lo), float(x.hi)) -- exact."""
    return _f32(_asm(
        2, T.f32, _ir([Uint32(x)], loc, ip),
        "{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, $2;\n cvt.f32.f16 $0, lo;\n cvt.f32.f16 $1, hi;\n}",
        "=f,=f,r", effects=False, loc=loc, ip=ip,
    ))


# ----------------------------------------------------------------------------- tensor cores


def _mma(kind: str, d, a, b, loc, ip):
    args = _ir([Float32(v) for v in d] + [Uint32(v) for v in a] + [Uint32(v) for v in b], loc, ip)
    return _f32(_asm(
        4, T.f32, args,
        f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
        "{$0, $1, $2, $3}, {$8, $9, $10, $11}, {$12, $13}, {$4, $5, $6, $7};",
        "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r,r", effects=False, loc=loc, ip=ip,
    ))


@dsl_user_op
def mma_bf16_m16n8k16(d0, d1, d2, d3, a0, a1, a2, a3, b0, b1, *, loc=None, ip=None):
    """D += A(16x16, row) * B(16x8, col), bf16 inputs, f32 accumulate.

    Fragments (g = lane // 4, t = lane % 4): a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2],
    a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10]; b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g];
    d0, d1 = D[g, 2t:2t+2], d2, d3 = D[g+8, 2t:2t+2].
    """
    return _mma("bf16", (d0, d1, d2, d3), (a0, a1, a2, a3), (b0, b1), loc, ip)


@dsl_user_op
def mma_f16_m16n8k16(d0, d1, d2, d3, a0, a1, a2, a3, b0, b1, *, loc=None, ip=None):
    """As `mma_bf16_m16n8k16` with fp16 inputs."""
    return _mma("f16", (d0, d1, d2, d3), (a0, a1, a2, a3), (b0, b1), loc, ip)


# The swapped-operand form used by the M <= 8 path is the same instruction with
# the dequantised weight fragments as A (16 output features x 16 k) and the
# activations as B (16 k x 8 tokens): D[n, token] += W[n, k] * X[token, k].


# ----------------------------------------------------------------------------- warpgroup MMA (sm_90a)
#
# The large-M GEMM feeds dequantised weights to `wgmma` from registers (the "RS" form): per warp
# the m64 A fragment is the m16n8k16 A fragment above (warp w of the warpgroup holds rows
# 16w..16w+15), so the packed layout decodes into it unchanged.  Activations are B, read by the
# tensor cores from shared memory through a matrix descriptor.  PTX rules these helpers serve:
# `wgmma_fence` between writing A (or accumulator) registers and the wgmma that reads them;
# accumulators must not be touched until `wgmma_wait_group` covers their wgmma -- `pin_f32`
# after the wait makes every later use of them depend on it (LLVM may otherwise move a pure
# read above the wait); shared memory written by the generic proxy (st.shared, cp.async) must
# be published to the async proxy with `fence_proxy_async_shared` before a wgmma reads it.

WGMMA_NS = (16, 32, 48, 64, 96, 128, 192, 256)  # B columns (tokens) of the shapes used (m64nNk16), N/2 f32 per thread
# Shared-memory matrix descriptor (PTX "matrix descriptor"): start address >> 4 in bits 0..13,
# leading-dimension byte offset >> 4 in 16..29, stride byte offset >> 4 in 32..45, swizzle
# mode in 62..63 (1 = 128-byte swizzle).  For a K-major 128B-swizzled operand whose rows are
# 128 bytes (64 bf16 of K), 8-row core-matrix groups are 1024 bytes apart (SBO); LBO is unused.
WGMMA_SW128_ROW_BYTES = 128
WGMMA_SW128_ATOM_BYTES = 8 * WGMMA_SW128_ROW_BYTES  # the swizzle pattern repeats every 1024 bytes
_DESC_LBO = 1
_DESC_SBO = WGMMA_SW128_ATOM_BYTES >> 4
_DESC_SWIZZLE_128B = 1
WGMMA_DESC_SW128_K_MAJOR = (_DESC_LBO << 16) | (_DESC_SBO << 32) | (_DESC_SWIZZLE_128B << 62)


def wgmma_desc_sw128(smem_addr: Int32) -> Int64:
    """Descriptor of a K-major, 128B-swizzled tile starting at `smem_addr` (1024-aligned atom).

    Advancing K by 16 elements inside the atom adds 32 bytes, i.e. 2 to the descriptor.
    """
    return Int64((smem_addr >> Int32(4)) & Int32(0x3FFF)) | Int64(WGMMA_DESC_SW128_K_MAJOR)


@dsl_user_op
def wgmma_fence(*, loc=None, ip=None) -> None:
    """`wgmma.fence`: order earlier register writes (A fragments, accumulators) before wgmma."""
    _asm(0, None, [], "wgmma.fence.sync.aligned;", "", effects=True, loc=loc, ip=ip)


@dsl_user_op
def wgmma_commit_group(*, loc=None, ip=None) -> None:
    """Close the group of wgmma issued since the last commit."""
    _asm(0, None, [], "wgmma.commit_group.sync.aligned;", "", effects=True, loc=loc, ip=ip)


@dsl_user_op
def wgmma_wait_group(pending: int, *, loc=None, ip=None) -> None:
    """Wait until at most `pending` committed wgmma groups are still running."""
    _asm(0, None, [], f"wgmma.wait_group.sync.aligned {int(pending)};", "", effects=True, loc=loc, ip=ip)


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None) -> None:
    """`fence.proxy.async.shared::cta`: make generic-proxy shared writes visible to wgmma."""
    _asm(0, None, [], "fence.proxy.async.shared::cta;", "", effects=True, loc=loc, ip=ip)


def _pin(values, out_type, wrap, reg: str, loc, ip):
    n = len(values)
    ties = ",".join(str(i) for i in range(n))
    outs = _asm(n, out_type, _ir([wrap(v) for v in values], loc, ip), "", ",".join([f"={reg}"] * n) + "," + ties,
                effects=True, loc=loc, ip=ip)
    return [wrap(v) for v in outs]


@dsl_user_op
def pin_f32(values: list, *, loc=None, ip=None) -> list:
    """The same floats, through an empty side-effecting asm: later uses cannot move above it."""
    return _pin(list(values), T.f32, Float32, "f", loc, ip)


@dsl_user_op
def pin_u32(values: list, *, loc=None, ip=None) -> list:
    """The same words, materialised before this point (ahead of a `wgmma_fence`)."""
    return _pin(list(values), T.i32, Uint32, "r", loc, ip)


def _wgmma_rs(kind: str, acc, a, desc, loc, ip):
    n = len(acc)  # accumulator floats per thread: N / 2
    if 2 * n not in WGMMA_NS:
        raise ValueError(f"wgmma with {n} accumulators per thread (N = {2 * n}); supported N: {WGMMA_NS}")
    d = ", ".join(f"${i}" for i in range(n))
    a_ops = ", ".join(f"${2 * n + i}" for i in range(4))
    ptx = (f"wgmma.mma_async.sync.aligned.m64n{2 * n}k16.f32.{kind}.{kind} "
           f"{{{d}}}, {{{a_ops}}}, ${2 * n + 4}, 1, 1, 1, 0;")
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)] + ["r"] * 4 + ["l"])
    args = _ir([Float32(v) for v in acc] + [Uint32(v) for v in a] + [Int64(desc)], loc, ip)
    # side effects: it must stay between its wgmma_fence and wgmma_commit_group
    return [Float32(v) for v in _asm(n, T.f32, args, ptx, constraints, effects=True, loc=loc, ip=ip)]


@dsl_user_op
def wgmma_bf16_m64k16_rs(acc: list, a0, a1, a2, a3, desc: Int64, *, loc=None, ip=None) -> list:
    """acc(64xN f32) += A(64x16, registers) * B(16xN, shared, K-major via `desc`), bf16 inputs.

    N = 2 * len(acc), one of WGMMA_NS.  A per warp w: rows 16w.. as the m16n8k16 A fragment
    (a0..a3).  acc[4i + j] (g = lane // 4, t = lane % 4): j = 0, 1 -> D[16w + g, 8i + 2t + j];
    j = 2, 3 -> D[16w + g + 8, 8i + 2t + j - 2].  scale-d is 1 (always accumulate: start from zeros).
    """
    return _wgmma_rs("bf16", acc, (a0, a1, a2, a3), desc, loc, ip)


@dsl_user_op
def wgmma_f16_m64k16_rs(acc: list, a0, a1, a2, a3, desc: Int64, *, loc=None, ip=None) -> list:
    """As `wgmma_bf16_m64k16_rs` with fp16 inputs."""
    return _wgmma_rs("f16", acc, (a0, a1, a2, a3), desc, loc, ip)


# ----------------------------------------------------------------------------- shared memory


@dsl_user_op
def ldmatrix_x4(addr: Int32, *, loc=None, ip=None):
    """ldmatrix .x4 (four 8x8 b16 matrices; lane i supplies the row address of matrix i // 8)."""
    return _u32(_asm(4, T.i32, _ir([Int32(addr)], loc, ip),
                     "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
                     effects=True, loc=loc, ip=ip))


@dsl_user_op
def ldmatrix_x2(addr: Int32, *, loc=None, ip=None):
    """ldmatrix .x2 (two 8x8 b16 matrices; lanes 0-15 supply row addresses)."""
    return _u32(_asm(2, T.i32, _ir([Int32(addr)], loc, ip),
                     "ldmatrix.sync.aligned.m8n8.x2.shared.b16 {$0, $1}, [$2];", "=r,=r,r",
                     effects=True, loc=loc, ip=ip))


@dsl_user_op
def stmatrix_x4_trans(addr: Int32, r0: Uint32, r1: Uint32, r2: Uint32, r3: Uint32, *, loc=None, ip=None) -> None:
    """stmatrix .x4 .trans (sm_90): four 8x8 b16 matrices stored transposed.

    Register m holds the mma-fragment pair (row g, columns 2t, 2t+1) of matrix m; lane l
    supplies the shared address of stored row l % 8 of matrix l // 8, which receives
    fragment column l % 8 (8 values, fragment rows 0..7).
    """
    _asm(0, None, _ir([Int32(addr), Uint32(r0), Uint32(r1), Uint32(r2), Uint32(r3)], loc, ip),
         "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {$1, $2, $3, $4};", "r,r,r,r,r",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_shared_u32(addr: Int32, *, loc=None, ip=None) -> Uint32:
    return _u32(_asm(1, T.i32, _ir([Int32(addr)], loc, ip), "ld.shared.b32 $0, [$1];", "=r,r",
                     effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_shared_i32(addr: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(1, T.i32, _ir([Int32(addr)], loc, ip), "ld.shared.b32 $0, [$1];", "=r,r",
                      effects=True, loc=loc, ip=ip)[0])


@dsl_user_op
def ld_shared_f32(addr: Int32, *, loc=None, ip=None) -> Float32:
    return _f32(_asm(1, T.f32, _ir([Int32(addr)], loc, ip), "ld.shared.f32 $0, [$1];", "=f,r",
                     effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_shared_v2_u32(addr: Int32, *, loc=None, ip=None):
    return _u32(_asm(2, T.i32, _ir([Int32(addr)], loc, ip), "ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r",
                     effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_shared_v4_u32(addr: Int32, *, loc=None, ip=None):
    return _u32(_asm(4, T.i32, _ir([Int32(addr)], loc, ip), "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
                     "=r,=r,=r,=r,r", effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_shared_v4_f32(addr: Int32, *, loc=None, ip=None):
    return _f32(_asm(4, T.f32, _ir([Int32(addr)], loc, ip), "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];",
                     "=f,=f,=f,=f,r", effects=True, loc=loc, ip=ip))


@dsl_user_op
def st_shared_u32(addr: Int32, v: Uint32, *, loc=None, ip=None) -> None:
    _asm(0, None, _ir([Int32(addr), Uint32(v)], loc, ip), "st.shared.b32 [$0], $1;", "r,r",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_i32(addr: Int32, v: Int32, *, loc=None, ip=None) -> None:
    _asm(0, None, _ir([Int32(addr), Int32(v)], loc, ip), "st.shared.b32 [$0], $1;", "r,r",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_f32(addr: Int32, v: Float32, *, loc=None, ip=None) -> None:
    _asm(0, None, _ir([Int32(addr), Float32(v)], loc, ip), "st.shared.f32 [$0], $1;", "r,f",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_bf16_from_f32(addr: Int32, v: Float32, *, loc=None, ip=None) -> None:
    """Round v to bf16 and store 2 bytes."""
    _asm(0, None, _ir([Int32(addr), Float32(v)], loc, ip),
         "{\n .reg .b16 h;\n cvt.rn.bf16.f32 h, $1;\n st.shared.b16 [$0], h;\n}", "r,f",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_f16_from_f32(addr: Int32, v: Float32, *, loc=None, ip=None) -> None:
    """Round v to fp16 and store 2 bytes."""
    _asm(0, None, _ir([Int32(addr), Float32(v)], loc, ip),
         "{\n .reg .b16 h;\n cvt.rn.f16.f32 h, $1;\n st.shared.b16 [$0], h;\n}", "r,f",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_v4_u32(addr: Int32, v0: Uint32, v1: Uint32, v2: Uint32, v3: Uint32, *, loc=None, ip=None) -> None:
    _asm(0, None, _ir([Int32(addr), Uint32(v0), Uint32(v1), Uint32(v2), Uint32(v3)], loc, ip),
         "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_v4_f32(addr: Int32, v0: Float32, v1: Float32, v2: Float32, v3: Float32, *, loc=None, ip=None) -> None:
    _asm(0, None, _ir([Int32(addr), Float32(v0), Float32(v1), Float32(v2), Float32(v3)], loc, ip),
         "st.shared.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f", effects=True, loc=loc, ip=ip)


# ----------------------------------------------------------------------------- async copies


def _l2_prefetch(nbytes: int) -> str:
    """The `.L2::<n>B` qualifier of a cp.async that also has L2 fetch `nbytes` around its source (0: none)."""
    assert nbytes in (0, 64, 128, 256), nbytes
    return f".L2::{nbytes}B" if nbytes else ""


@dsl_user_op
def prefetch_l2_bulk(gmem_addr: Int64, nbytes: int, *, loc=None, ip=None) -> None:
    """Bring `nbytes` (a multiple of 16) from a 16-byte aligned global address into L2, nothing waited for
    (`cp.async.bulk.prefetch.L2`, sm_90)."""
    assert nbytes % 16 == 0 and nbytes > 0, nbytes
    _asm(0, None, _ir([Int64(gmem_addr)], loc, ip), f"cp.async.bulk.prefetch.L2.global [$0], {nbytes};", "l",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def cp_async_16(smem_addr: Int32, gmem_addr: Int64, *, l2_prefetch: int = 0, loc=None, ip=None) -> None:
    """16-byte global -> shared copy, bypassing L1 (`cp.async.cg`); `l2_prefetch` bytes (64, 128, 256) of the
    aligned block around the source are brought into L2 with it."""
    _asm(0, None, _ir([Int32(smem_addr), Int64(gmem_addr)], loc, ip),
         f"cp.async.cg.shared.global{_l2_prefetch(l2_prefetch)} [$0], [$1], 16;", "r,l", effects=True, loc=loc, ip=ip)


def _cp_async_zfill(cache: str, nbytes: int, smem_addr, gmem_addr, pred, loc, ip, l2_prefetch: int = 0) -> None:
    """`cp.async.<cache>` of nbytes when pred != 0, else nbytes zero bytes written and nothing read (src-size 0)."""
    _asm(0, None, _ir([Int32(smem_addr), Int64(gmem_addr), Int32(pred)], loc, ip),
         "{\n .reg .pred p;\n .reg .b32 n;\n setp.ne.b32 p, $2, 0;\n"
         f" selp.b32 n, {nbytes}, 0, p;\n"
         f" cp.async.{cache}.shared.global{_l2_prefetch(l2_prefetch)} [$0], [$1], {nbytes}, n;\n}}",
         "r,l,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def cp_async_16_zfill(smem_addr: Int32, gmem_addr: Int64, pred: Int32, *, l2_prefetch: int = 0, loc=None,
                      ip=None) -> None:
    """16-byte copy when pred != 0, else writes 16 zero bytes and reads nothing (src-size 0)."""
    _cp_async_zfill("cg", 16, smem_addr, gmem_addr, pred, loc, ip, l2_prefetch)


@dsl_user_op
def cp_async_ca(smem_addr: Int32, gmem_addr: Int64, nbytes: int, *, l2_prefetch: int = 0, loc=None,
                ip=None) -> None:
    """4-, 8- or 16-byte global -> shared copy through L1 (`cp.async.ca`; .cg takes 16 bytes only)."""
    assert nbytes in (4, 8, 16), nbytes
    _asm(0, None, _ir([Int32(smem_addr), Int64(gmem_addr)], loc, ip),
         f"cp.async.ca.shared.global{_l2_prefetch(l2_prefetch)} [$0], [$1], {nbytes};", "r,l", effects=True,
         loc=loc, ip=ip)


@dsl_user_op
def cp_async_ca_zfill(smem_addr: Int32, gmem_addr: Int64, nbytes: int, pred: Int32, *, l2_prefetch: int = 0,
                      loc=None, ip=None) -> None:
    """`cp_async_ca` when pred != 0, else writes `nbytes` zero bytes and reads nothing (src-size 0)."""
    assert nbytes in (4, 8, 16), nbytes
    _cp_async_zfill("ca", nbytes, smem_addr, gmem_addr, pred, loc, ip, l2_prefetch)


# ----------------------------------------------------------------------------- bulk copies and mbarriers (sm_90+)
# A bulk copy is issued by one thread and moves a whole contiguous range; its completion is
# counted in bytes on an mbarrier (a 64-bit shared-memory object), which threads wait on by
# phase parity.  Used by `benchmarks/stream_probe.py` and the producer-warpgroup wgmma GEMM (wgmma_ws.py).


@dsl_user_op
def mbarrier_init(addr: Int32, count: int, *, loc=None, ip=None) -> None:
    """Initialise the 8-byte-aligned mbarrier at addr to expect `count` arrivals per phase."""
    _asm(0, None, _ir([Int32(addr)], loc, ip), f"mbarrier.init.shared::cta.b64 [$0], {count};", "r",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def fence_mbarrier_init(*, loc=None, ip=None) -> None:
    """Make initialised mbarriers visible to the async proxy (bulk copies) before first use."""
    _asm(0, None, [], "fence.mbarrier_init.release.cluster;", "", effects=True, loc=loc, ip=ip)


@dsl_user_op
def mbarrier_arrive_expect_tx(addr: Int32, nbytes: int, *, loc=None, ip=None) -> None:
    """Arrive once on the mbarrier and add `nbytes` to the bytes its phase waits for."""
    _asm(0, None, _ir([Int32(addr)], loc, ip), f"mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], {nbytes};",
         "r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def mbarrier_wait_parity(addr: Int32, parity: Int32, *, loc=None, ip=None) -> None:
    """Spin (`mbarrier.try_wait.parity`) until the phase with this parity (0/1) has completed."""
    _asm(0, None, _ir([Int32(addr), Int32(parity)], loc, ip),
         "{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1;\n"
         " @!done bra WAIT;\n}", "r,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def cp_async_bulk_g2s(smem_addr: Int32, gmem_addr: Int64, nbytes: int, mbar: Int32, *, loc=None, ip=None) -> None:
    """Copy `nbytes` (a multiple of 16, both addresses 16-byte aligned) global -> shared;
    completion is counted on the mbarrier at `mbar` (`cp.async.bulk ... complete_tx::bytes`)."""
    assert nbytes % 16 == 0 and nbytes > 0, nbytes
    _asm(0, None, _ir([Int32(smem_addr), Int64(gmem_addr), Int32(mbar)], loc, ip),
         f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], {nbytes}, [$2];",
         "r,l,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def cp_async_mbarrier_arrive_noinc(mbar: Int32, *, loc=None, ip=None) -> None:
    """Arrive once on the mbarrier when every cp.async this thread issued so far has landed
    (`cp.async.mbarrier.arrive.noinc`: the arrival counts against the expected count given at init)."""
    _asm(0, None, _ir([Int32(mbar)], loc, ip), "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", "r",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def mbarrier_arrive_if(mbar: Int32, pred: Int32, *, loc=None, ip=None) -> None:
    """Arrive once on the mbarrier (release) if pred != 0; predicated in PTX, so no branch."""
    _asm(0, None, _ir([Int32(mbar), Int32(pred)], loc, ip),
         "{\n .reg .pred p;\n setp.ne.s32 p, $1, 0;\n @p mbarrier.arrive.shared::cta.b64 _, [$0];\n}", "r,r",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def cp_async_wait_all(*, loc=None, ip=None) -> None:
    """Wait until every cp.async this thread issued has landed."""
    _asm(0, None, [], "cp.async.wait_all;", "", effects=True, loc=loc, ip=ip)


# ----------------------------------------------------------------------------- programmatic dependent launch (sm_90+)
# A kernel launched with programmatic stream serialization (runtime/bundle.py) may start while the
# kernel before it on the stream still runs; every production kernel therefore begins with
# `wait_for_prior_grids` before it touches memory, then lets its own dependents launch.


@dsl_user_op
def wait_for_prior_grids(*, loc=None, ip=None) -> None:
    """`griddepcontrol.wait`: block until every grid this one depends on has completed and its memory
    is visible (a no-op for a kernel launched without the programmatic attribute).  The memory clobber
    keeps the compiler from hoisting any load above it."""
    _asm(0, None, [], "griddepcontrol.wait;", "~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def launch_dependents(*, loc=None, ip=None) -> None:
    """`griddepcontrol.launch_dependents`: the next kernel on the stream may launch once every CTA of
    this grid has said so (or exited); it still waits for this grid's completion in its own
    `wait_for_prior_grids`, so where this is called only moves when its CTAs become resident."""
    _asm(0, None, [], "griddepcontrol.launch_dependents;", "~{memory}", effects=True, loc=loc, ip=ip)


# ----------------------------------------------------------------------------- global memory


@dsl_user_op
def ld_global_nc_u32(addr: Int64, *, loc=None, ip=None) -> Uint32:
    """Read-only (non-coherent) 4-byte load: for data no kernel writes during the launch."""
    return _u32(_asm(1, T.i32, _ir([Int64(addr)], loc, ip), "ld.global.nc.b32 $0, [$1];", "=r,l",
                     effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_global_nc_i32(addr: Int64, *, loc=None, ip=None) -> Int32:
    """Read-only (non-coherent) signed 4-byte load."""
    return Int32(_asm(1, T.i32, _ir([Int64(addr)], loc, ip), "ld.global.nc.b32 $0, [$1];", "=r,l",
                      effects=True, loc=loc, ip=ip)[0])


@dsl_user_op
def ld_global_nc_f32(addr: Int64, *, loc=None, ip=None) -> Float32:
    """Read-only (non-coherent) float load."""
    return _f32(_asm(1, T.f32, _ir([Int64(addr)], loc, ip), "ld.global.nc.f32 $0, [$1];", "=f,l",
                     effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_global_nc_v4_u32(addr: Int64, *, loc=None, ip=None):
    """Read-only (non-coherent) 16-byte load (e.g. 8 bias elements)."""
    return _u32(_asm(4, T.i32, _ir([Int64(addr)], loc, ip), "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];",
                     "=r,=r,=r,=r,l", effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_global_nc_v2_u32(addr: Int64, *, loc=None, ip=None):
    """Read-only (non-coherent) 8-byte load (8-byte aligned)."""
    return _u32(_asm(2, T.i32, _ir([Int64(addr)], loc, ip), "ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l",
                     effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_global_u32(addr: Int64, *, loc=None, ip=None) -> Uint32:
    """Plain (coherent) 4-byte load: data this CTA wrote earlier in the launch (after a bar.sync)."""
    return Uint32(_asm(1, T.i32, _ir([Int64(addr)], loc, ip), "ld.global.b32 $0, [$1];", "=r,l",
                       effects=True, loc=loc, ip=ip)[0])


@dsl_user_op
def ld_global_acquire_i32(addr: Int64, *, loc=None, ip=None) -> Int32:
    """GPU-scope acquire load (pairs with `red_add_release_i32` / `st_global_release_i32`)."""
    return Int32(_asm(1, T.i32, _ir([Int64(addr)], loc, ip), "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l",
                      effects=True, loc=loc, ip=ip)[0])


@dsl_user_op
def ld_global_v4_f32(addr: Int64, *, loc=None, ip=None):
    """16-byte load cached in L2 only (data written by other CTAs in this launch)."""
    return _f32(_asm(4, T.f32, _ir([Int64(addr)], loc, ip), "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];",
                     "=f,=f,=f,=f,l", effects=True, loc=loc, ip=ip))


@dsl_user_op
def st_global_v4_u32(addr: Int64, v0: Uint32, v1: Uint32, v2: Uint32, v3: Uint32, *, loc=None, ip=None) -> None:
    _asm(0, None, _ir([Int64(addr), Uint32(v0), Uint32(v1), Uint32(v2), Uint32(v3)], loc, ip),
         "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_v4_f32(addr: Int64, v0: Float32, v1: Float32, v2: Float32, v3: Float32, *, loc=None, ip=None) -> None:
    """16-byte store cached in L2 only (read back by another CTA)."""
    _asm(0, None, _ir([Int64(addr), Float32(v0), Float32(v1), Float32(v2), Float32(v3)], loc, ip),
         "st.global.cg.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f", effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_i32(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    _asm(0, None, _ir([Int64(addr), Int32(v)], loc, ip), "st.global.b32 [$0], $1;", "l,r",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_release_i32(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    """GPU-scope release store: earlier writes of this thread are visible before v."""
    _asm(0, None, _ir([Int64(addr), Int32(v)], loc, ip), "st.release.gpu.global.b32 [$0], $1;", "l,r",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def atom_add_i32(addr: Int64, v: Int32, *, loc=None, ip=None) -> Int32:
    """Relaxed GPU-scope atomic add; returns the old value."""
    return Int32(_asm(1, T.i32, _ir([Int64(addr), Int32(v)], loc, ip), "atom.global.add.s32 $0, [$1], $2;",
                      "=r,l,r", effects=True, loc=loc, ip=ip)[0])


@dsl_user_op
def atom_add_release_i32(addr: Int64, v: Int32, *, loc=None, ip=None) -> Int32:
    """GPU-scope release atomic add (this thread's earlier writes are visible first); returns the old value."""
    return Int32(_asm(1, T.i32, _ir([Int64(addr), Int32(v)], loc, ip), "atom.release.gpu.global.add.u32 $0, [$1], $2;",
                      "=r,l,r", effects=True, loc=loc, ip=ip)[0])


@dsl_user_op
def red_add_release_i32(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    """GPU-scope release reduction (no return): publishes this thread's earlier writes."""
    _asm(0, None, _ir([Int64(addr), Int32(v)], loc, ip), "red.release.gpu.global.add.s32 [$0], $1;", "l,r",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def red_add_f32(addr: Int64, v: Float32, *, loc=None, ip=None) -> None:
    """Atomic float add into global memory (relaxed, GPU scope; no return)."""
    _asm(0, None, _ir([Int64(addr), Float32(v)], loc, ip), "red.global.add.f32 [$0], $1;", "l,f",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def red_add_v4_bf16x2(addr: Int64, v0: Uint32, v1: Uint32, v2: Uint32, v3: Uint32, *, loc=None, ip=None) -> None:
    """Atomic element-wise add of four bf16x2 words to 16 bytes of global memory (16-byte aligned; sm_90+):
    one reduction instead of four of one word (SASS REDG.E.ADD.BF16x8)."""
    _asm(0, None, _ir([Int64(addr), Uint32(v0), Uint32(v1), Uint32(v2), Uint32(v3)], loc, ip),
         "red.global.add.noftz.v4.bf16x2 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def red_add_v4_f16x2(addr: Int64, v0: Uint32, v1: Uint32, v2: Uint32, v3: Uint32, *, loc=None, ip=None) -> None:
    """Atomic element-wise add of four half2 words to 16 bytes of global memory (16-byte aligned; sm_90+)."""
    _asm(0, None, _ir([Int64(addr), Uint32(v0), Uint32(v1), Uint32(v2), Uint32(v3)], loc, ip),
         "red.global.add.noftz.v4.f16x2 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def red_max_f32_nonnegative(addr: Int64, v: Float32, *, loc=None, ip=None) -> None:
    """Atomic max of a float known to be >= +0 (its bits order like a signed int).

    Only valid when both the stored value and v are non-negative (amax buffers
    initialised to 0); a negative v would compare wrongly.
    """
    _asm(0, None, _ir([Int64(addr), Float32(v)], loc, ip),
         "{\n .reg .b32 b;\n mov.b32 b, $1;\n red.global.max.s32 [$0], b;\n}", "l,f",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def sync_threads_count(flag: Int32, *, loc=None, ip=None) -> Int32:
    """`bar.red.popc.u32 d, 0, p`: a __syncthreads (barrier 0, all threads of the CTA) that returns
    how many threads passed a non-zero `flag`."""
    return Int32(_asm(1, T.i32, _ir([Int32(flag)], loc, ip),
                      "{\n .reg .pred p;\n setp.ne.s32 p, $1, 0;\n bar.red.popc.u32 $0, 0, p;\n}", "=r,r",
                      effects=True, loc=loc, ip=ip)[0])


@dsl_user_op
def named_barrier_sync(barrier: int, threads: int, *, loc=None, ip=None) -> None:
    """`bar.sync barrier, threads`: a barrier over a subset of the CTA's warps (barrier 0 is
    __syncthreads; every participating warp passes the same id and count)."""
    assert 0 < barrier < 16 and threads % 32 == 0, (barrier, threads)
    _asm(0, None, [], f"bar.sync {barrier}, {threads};", "", effects=True, loc=loc, ip=ip)


@dsl_user_op
def named_barrier_count(barrier: int, threads: int, flag: Int32, *, loc=None, ip=None) -> Int32:
    """`named_barrier_sync` that returns how many of its threads passed a non-zero `flag`."""
    assert 0 < barrier < 16 and threads % 32 == 0, (barrier, threads)
    return Int32(_asm(1, T.i32, _ir([Int32(flag)], loc, ip),
                      "{\n .reg .pred p;\n setp.ne.s32 p, $1, 0;\n"
                      f" bar.red.popc.u32 $0, {barrier}, {threads}, p;\n}}", "=r,r",
                      effects=True, loc=loc, ip=ip)[0])


@dsl_user_op
def warp_uniform(x: Int32, *, loc=None, ip=None) -> Int32:
    """Lane 0's x for the whole warp (`shfl.sync.idx`): lets ptxas treat x, and branches on it, as uniform."""
    return Int32(_asm(1, T.i32, _ir([Int32(x)], loc, ip), "shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r",
                      effects=False, loc=loc, ip=ip)[0])


@dsl_user_op
def setmaxnreg(registers: int, increase: bool, *, loc=None, ip=None) -> None:
    """`setmaxnreg.{inc,dec}.sync.aligned.u32`: this warpgroup's registers per thread from here on
    (all of its warps execute it; a multiple of 8 in [24, 256])."""
    assert 24 <= registers <= 256 and registers % 8 == 0, registers
    op = "inc" if increase else "dec"
    _asm(0, None, [], f"setmaxnreg.{op}.sync.aligned.u32 {registers};", "", effects=True, loc=loc, ip=ip)


# ----------------------------------------------------------------------------- scalar float


@dsl_user_op
def fabs_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    return _f32(_asm(1, T.f32, _ir([Float32(x)], loc, ip), "abs.f32 $0, $1;", "=f,f", effects=False,
                     loc=loc, ip=ip))


@dsl_user_op
def fmax_f32(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    return _f32(_asm(1, T.f32, _ir([Float32(a), Float32(b)], loc, ip), "max.f32 $0, $1, $2;", "=f,f,f",
                     effects=False, loc=loc, ip=ip))


@dsl_user_op
def div_approx_f32(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a * (1 / b) at most 2 ulp off for |b| in [2^-126, 2^126] and 0 beyond (finite a): one MUFU.RCP and
    a multiply, where `/` (div.rn) costs a dozen instructions and a slow-path branch."""
    return _f32(_asm(1, T.f32, _ir([Float32(a), Float32(b)], loc, ip), "div.approx.f32 $0, $1, $2;", "=f,f,f",
                     effects=False, loc=loc, ip=ip))


def warp_reduce(value, op: str):
    """Butterfly reduction over the 32 lanes ("add" or "max"); every lane gets the result."""
    for shift in (16, 8, 4, 2, 1):
        other = cute.arch.shuffle_sync_bfly(value, offset=shift)
        value = value + other if op == "add" else cute.arch.fmax(value, other)
    return value


# ----------------------------------------------------------------------------- timeline probes


@dsl_user_op
def read_timers(*, loc=None, ip=None) -> tuple[Int64, Int64]:
    """(%globaltimer in ns, %clock64 of this SM): a timeline probe's two clocks."""
    out = _asm(2, T.i64, [], "{\n mov.u64 $0, %globaltimer;\n mov.u64 $1, %clock64;\n}", "=l,=l", effects=True,
               loc=loc, ip=ip)
    return Int64(out[0]), Int64(out[1])


@dsl_user_op
def read_sm_ids(*, loc=None, ip=None) -> tuple[Int64, Int64]:
    """(%smid, %nsmid) of the calling thread's SM, widened to two int64: a timeline probe's placement record."""
    out = _asm(2, T.i64, [], "{\n .reg .u32 s, n;\n mov.u32 s, %smid;\n mov.u32 n, %nsmid;\n"
               " cvt.u64.u32 $0, s;\n cvt.u64.u32 $1, n;\n}", "=l,=l", effects=True, loc=loc, ip=ip)
    return Int64(out[0]), Int64(out[1])


@dsl_user_op
def st_global_v2_i64(addr: Int64, a: Int64, b: Int64, *, loc=None, ip=None) -> None:
    _asm(0, None, _ir([Int64(addr), Int64(a), Int64(b)], loc, ip), "st.global.v2.b64 [$0], {$1, $2};", "l,l,l",
         effects=True, loc=loc, ip=ip)
