"""The e2m1 (FP4) format from its definition, and where the device decode reads a code's bits.

Independent of cuteaot.runtime: the intrinsic probes are checked against this, not against the
packer's own tables.

e2m1 code (4 bits): bit 3 sign, bits 2..1 exponent e (bias 1), bit 0 mantissa m.
    e = 0 (subnormal):  value = m * 2**(1 - bias) / 2          -> 0, 0.5
    e > 0 (normal):     value = 2**(e - bias) * (1 + m / 2)     -> 1, 1.5, 2, 3, 4, 6
"""

from __future__ import annotations

from .nvfp4 import _ROTATIONS as DECODE_ROTATIONS

SIGN_BIT = 3
EXPONENT_SHIFT, EXPONENT_MASK, EXPONENT_BIAS = 1, 0b11, 1
MANTISSA_MASK, MANTISSA_BITS = 0b1, 1


def e2m1_value(code: int) -> float:
    """The value of a 4-bit e2m1 code (code 8 is -0.0)."""
    sign = -1.0 if (code >> SIGN_BIT) & 1 else 1.0
    exponent = (code >> EXPONENT_SHIFT) & EXPONENT_MASK
    mantissa = (code & MANTISSA_MASK) / 2**MANTISSA_BITS
    if exponent == 0:
        return sign * mantissa * 2.0 ** (1 - EXPONENT_BIAS)
    return sign * (1 + mantissa) * 2.0 ** (exponent - EXPONENT_BIAS)


E2M1_VALUES = tuple(e2m1_value(code) for code in range(16))  # code -> value
assert E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), "e2m1 definition"

# The element types' mantissa widths: the decode drops the code's e1 e0 onto the element's two
# lowest exponent bits (bits M + 1, M) and m onto its highest mantissa bit (M - 1).
ELEMENT_MANTISSA_BITS = {"bf16": 7, "fp16": 10}
ELEMENT_SIGN_BIT = 15


def device_code_bits(dtype: str) -> tuple[tuple[int, int, int, int], ...]:
    """For code i = j + 4h of a packed u32 word: the word bits the device decode reads as (sign, e1, e0, m).

    The decode (nvfp4.py, `_e2m1x8`) builds register j from the sign bits of rotr(word, a_j) and
    the magnitude bits of rotr(word, b_j); code j lands in the register's low half, code j + 4 in
    its high half (+16).  Bit x of rotr(word, r) is bit (x + r) % 32 of the word.
    """
    top = ELEMENT_MANTISSA_BITS[dtype] + 1  # where e1 lands in the element
    out = []
    for i in range(8):
        j, half = i % 4, i // 4
        a, b = DECODE_ROTATIONS[dtype][j]
        element_bits = ((ELEMENT_SIGN_BIT, a), (top, b), (top - 1, b), (top - 2, b))
        out.append(tuple((bit + 16 * half + r) % 32 for bit, r in element_bits))
    return tuple(out)
