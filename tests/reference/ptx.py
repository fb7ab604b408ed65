"""A tiny PTX interpreter for the straight-line decode blocks of codegen/intrinsics.py.

It runs the exact text an intrinsic emits (one `{ ... }` block with `.reg` declarations,
`$n` operands) on numpy arrays of 32-bit words, one lane per element, so a CPU test checks
the instructions themselves, not a Python transcription of them.  Only the instructions
the ModelOpt-layout decodes use are implemented; anything else raises.

Semantics follow the PTX ISA: prmt in its default mode (selector nibble bit 3 replicates the
selected byte's sign bit), shr.b32 is a logical shift, cvt.rn.f16x2.e4m3x2 takes the upper
byte of its .b16 source to the upper half of the result, cvt.rn.bf16x2.f32 d, a, b puts a in
the upper half, mul.rn.bf16x2 multiplies the halves apart (rounded to nearest even, as torch rounds).
"""

from __future__ import annotations

import re

import numpy as np
import torch

_M32 = np.uint64(0xFFFFFFFF)


def _bits_f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).view(np.uint32).astype(np.uint64)


def _f32(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint32).view(np.float32)


def _f16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    return h.astype(np.uint16).view(np.float16).astype(np.float32)


def _e4m3_to_f16_bits(b: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(b.astype(np.uint8)).view(torch.float8_e4m3fn).to(torch.float16)
    return t.view(torch.int16).numpy().view(np.uint16).astype(np.uint64)


def _bf16_bits(f: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(f.astype(np.float32)).to(torch.bfloat16)  # round to nearest even
    return t.view(torch.int16).numpy().view(np.uint16).astype(np.uint64)


def _prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    pool = (a & _M32) | ((b & _M32) << np.uint64(32))
    out = np.zeros_like(pool)
    for pos in range(4):
        nib = (c >> np.uint64(4 * pos)) & np.uint64(0xF)
        byte = (pool >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        sign = (byte >> np.uint64(7)) * np.uint64(0xFF)
        byte = np.where(nib & np.uint64(8), sign, byte)
        out |= byte << np.uint64(8 * pos)
    return out


def run(ptx: str, inputs: dict[int, np.ndarray], outputs: int) -> list[np.ndarray]:
    """Run `ptx` with operand $i = inputs[i] (u32 words); return operands $0 .. $outputs-1."""
    env: dict[str, np.ndarray] = {f"${i}": np.asarray(v, dtype=np.uint64) & _M32 for i, v in inputs.items()}
    body = ptx.strip()
    assert body.startswith("{") and body.endswith("}"), "one { ... } block"
    for stmt in body[1:-1].split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        args = [a.strip() for a in re.split(r",(?![^{]*})", rest)]

        def val(a: str) -> np.ndarray:
            if a in env:
                return env[a]
            if a.startswith("0f"):
                return np.uint64(int(a[2:], 16))
            return np.uint64(int(a, 0) & 0xFFFFFFFF)

        d = args[0]
        if op == "mov.b32" and d.startswith("{"):  # unpack a b32 into two b16
            lo, hi = (x.strip() for x in d[1:-1].split(","))
            v = val(args[1])
            env[lo], env[hi] = v & np.uint64(0xFFFF), (v >> np.uint64(16)) & np.uint64(0xFFFF)
        elif op == "mov.b32" and args[1].startswith("{"):  # pack two b16 into a b32
            lo, hi = (x.strip() for x in args[1][1:-1].split(","))
            env[d] = (val(lo) & np.uint64(0xFFFF)) | ((val(hi) & np.uint64(0xFFFF)) << np.uint64(16))
        elif op == "mov.b32":
            env[d] = val(args[1]) + np.zeros(1, dtype=np.uint64)
        elif op == "shl.b32":
            env[d] = (val(args[1]) << np.uint64(int(args[2]))) & _M32
        elif op == "shr.b32":
            env[d] = val(args[1]) >> np.uint64(int(args[2]))
        elif op == "and.b32":
            env[d] = val(args[1]) & val(args[2])
        elif op == "or.b32":
            env[d] = val(args[1]) | val(args[2])
        elif op == "lop3.b32":  # bit i of the result = bit (a_i << 2 | b_i << 1 | c_i) of the table
            a, b, c, lut = val(args[1]), val(args[2]), val(args[3]), int(args[4], 0)
            out = np.zeros_like(a + b + c)
            for i in range(8):
                if lut >> i & 1:
                    sel = [x if i >> (2 - n) & 1 else ~x & _M32 for n, x in enumerate((a, b, c))]
                    out |= sel[0] & sel[1] & sel[2]
            env[d] = out & _M32
        elif op == "prmt.b32":
            env[d] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op == "cvt.rn.f16x2.e4m3x2":
            h = val(args[1])
            lo = _e4m3_to_f16_bits(h & np.uint64(0xFF))
            hi = _e4m3_to_f16_bits((h >> np.uint64(8)) & np.uint64(0xFF))
            env[d] = lo | (hi << np.uint64(16))
        elif op == "cvt.f32.f16":
            env[d] = _bits_f32(_f16_bits_to_f32(val(args[1])))
        elif op == "mul.f32":
            env[d] = _bits_f32(_f32(val(args[1])) * _f32(val(args[2])))
        elif op == "mul.rn.bf16x2":
            a, b = val(args[1]) + np.zeros(1, dtype=np.uint64), val(args[2]) + np.zeros(1, dtype=np.uint64)
            env[d] = _bf16x2_mul(a, b)
        elif op == "cvt.rn.bf16x2.f32":
            env[d] = _bf16_bits(_f32(val(args[2]))) | (_bf16_bits(_f32(val(args[1]))) << np.uint64(16))
        else:
            raise NotImplementedError(f"PTX instruction {op!r} in {stmt!r}")
    return [env[f"${i}"] & _M32 for i in range(outputs)]


def _bf16x2_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    def halves(w):
        bits = np.stack([w & np.uint64(0xFFFF), w >> np.uint64(16)], axis=-1).astype(np.int64)
        return torch.from_numpy((bits - (bits >= 1 << 15) * (1 << 16)).astype(np.int16)).view(torch.bfloat16)

    prod = (halves(a).float() * halves(b).float()).to(torch.bfloat16).view(torch.int16).numpy()
    prod = prod.astype(np.int64) & 0xFFFF
    return (prod[..., 0] | (prod[..., 1] << 16)).astype(np.uint64)
