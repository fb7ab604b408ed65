"""The ModelOpt-layout decodes, instruction by instruction: the PTX text the intrinsics emit runs in
tests/reference/ptx.py and must equal the values the NVFP4 definition gives (tests/reference/nvfp4.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass", reason="the intrinsics' PTX text comes from CuTeDSL (cuteaot[codegen])")

from cuteaot.codegen import intrinsics as I  # noqa: E402
from cuteaot.runtime.types import DType  # noqa: E402
from tests.reference.nvfp4 import E2M1_MAGNITUDES  # noqa: E402
from tests.reference.ptx import run  # noqa: E402

TORCH = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16}
DECODE_EXP = {DType.BF16: -126, DType.FP16: -14}  # the bit trick's fixed offset (intrinsics docstring)


def _bits(values: np.ndarray, dtype: DType) -> np.ndarray:
    t = torch.from_numpy(values.astype(np.float64)).to(torch.float32).to(TORCH[dtype])
    return t.view(torch.int16).numpy().view(np.uint16).astype(np.uint64)


def _e2m1(codes: np.ndarray) -> np.ndarray:
    mag = np.asarray(E2M1_MAGNITUDES)[codes & 7]
    return np.where(codes & 8, -mag, mag)


@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
def test_e2m1_code_decode_pairs_code_j_with_code_j_plus_4(dtype):
    """Pair j = (code j, code j + 4) of the word's 8 codes (code j on bits 4j .. 4j + 3)."""
    rng = np.random.default_rng(0)
    every_byte = np.arange(256, dtype=np.uint64)
    words = np.concatenate([every_byte * 0x01010101, every_byte << 8, every_byte << 24,
                            rng.integers(0, 2**32, 20000, dtype=np.uint64)])
    pairs = run(I.modelopt_word_ptx(dtype), {4: words}, 4)
    for j, pair in enumerate(pairs):
        lo, hi = (_e2m1((words >> np.uint64(4 * c)) & np.uint64(0xF)) * 2.0 ** DECODE_EXP[dtype] for c in (j, j + 4))
        expected = _bits(lo, dtype) | (_bits(hi, dtype) << np.uint64(16))
        bad = np.nonzero(pair != expected)[0]
        assert bad.size == 0, f"pair {j} of {words[bad[0]]:#010x}: got {pair[bad[0]]:#010x}, want {expected[bad[0]]:#010x}"


@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
def test_e2m1_byte_decode_keeps_the_stored_k_order(dtype):
    """The wgmma loop's decode: byte b of the word -> (low code, high code), for every byte value at
    every position, the other bytes random (they must not leak into the pair)."""
    rng = np.random.default_rng(1)
    every_byte = np.arange(256, dtype=np.uint64)
    for b in range(4):
        junk = rng.integers(0, 2**32, 256, dtype=np.uint64) & ~np.uint64(0xFF << (8 * b))
        words = (every_byte << np.uint64(8 * b)) | junk
        (pair,) = run(I.modelopt_byte_ptx(dtype), {1: words, 2: np.uint64(I.e2m1_byte_selector(b))}, 1)
        lo, hi = (_e2m1((every_byte >> np.uint64(s)) & np.uint64(0xF)) * 2.0 ** DECODE_EXP[dtype] for s in (0, 4))
        expected = _bits(lo, dtype) | (_bits(hi, dtype) << np.uint64(16))
        bad = np.nonzero(pair != expected)[0]
        assert bad.size == 0, f"byte {b} of {words[bad[0]]:#010x}: got {pair[bad[0]]:#010x}, want {expected[bad[0]]:#010x}"


def test_lop3_reference_reads_the_table_as_ptx_defines_it():
    """immLut = F(0xF0, 0xCC, 0xAA) for operands a, b, c: 0xE4 selects a where c is set, else b; 0x96 is a ^ b ^ c."""
    a, b, c = (np.array([x], dtype=np.uint64) for x in (0x12345678, 0x9ABCDEF0, 0x0F0F00FF))
    for lut, want in ((0xE4, (0x12345678 & 0x0F0F00FF) | (0x9ABCDEF0 & ~0x0F0F00FF & 0xFFFFFFFF)),
                      (0x96, 0x12345678 ^ 0x9ABCDEF0 ^ 0x0F0F00FF), (0x80, 0x12345678 & 0x9ABCDEF0 & 0x0F0F00FF)):
        ptx = "{\n lop3.b32 $0, $1, $2, $3, " + f"{lut:#04x}" + ";\n}"
        assert int(run(ptx, {1: a, 2: b, 3: c}, 1)[0][0]) == want


def test_pair_halves_is_the_activation_relabelling():
    """prmt 0x5410 / 0x7632 pair two registers' low / high halves (the activations' (k, k + 4) pairs)."""
    a, b = np.uint64(0x22221111), np.uint64(0x44443333)
    for high, want in ((0, 0x33331111), (1, 0x44442222)):
        ptx = "{\n prmt.b32 $0, $1, $2, " + f"{I.PAIR_HALVES_SELECTOR[high]:#06x}" + ";\n}"
        assert int(run(ptx, {1: np.array([a]), 2: np.array([b])}, 1)[0][0]) == want


@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP16])
def test_e4m3_scale_pairs_are_exact_for_every_scale_byte(dtype):
    """Every non-NaN e4m3 byte (zero, -0 and the subnormals included) in each word, at each byte
    position, the two words' bytes different, the other bytes junk."""
    # bf16 reads the magnitude (the weights' checks refuse negative scales; -0 reads as 0), fp16 the value
    every = np.array([b for b in range(0x81 if dtype is DType.BF16 else 256) if b & 0x7F != 0x7F], dtype=np.uint64)
    other = every[::-1].copy()

    def want(byte: np.ndarray) -> np.ndarray:
        value = torch.from_numpy(byte.astype(np.uint8)).view(torch.float8_e4m3fn).double().numpy()
        offset = 2.0 ** I.MODELOPT_SCALE_EXP_BF16 if dtype is DType.BF16 else 1.0
        bits = _bits(np.abs(value) * offset if dtype is DType.BF16 else value * offset, dtype)
        return bits | (bits << np.uint64(16))

    for pos in range(4):
        keep = ~np.uint64(0xFF << (8 * pos))
        p = (every << np.uint64(8 * pos)) | (np.uint64(0xA5C3F00F) & keep)
        q = (other << np.uint64(8 * pos)) | (np.uint64(0xFF99305A) & keep)
        pair_p, pair_q = run(I.e4m3_pairs_ptx(dtype), {2: p, 3: q, 4: np.uint64(I.e4m3_pairs_selector(pos))}, 2)
        for got, byte in ((pair_p, every), (pair_q, other)):
            bad = np.nonzero(got != want(byte))[0]
            assert bad.size == 0, f"byte {int(byte[bad[0]]):#04x} at {pos}: got {got[bad[0]]:#010x}, want {want(byte)[bad[0]]:#010x}"


def test_bf16_products_of_codes_and_scales_stay_exact():
    """The smallest nonzero product (code 0.5 * the smallest subnormal scale) is still a normal bf16
    once both offsets are applied, so the paired multiply rounds nothing."""
    smallest = 0.5 * 2.0 ** DECODE_EXP[DType.BF16] * 2.0**-9 * 2.0 ** I.MODELOPT_SCALE_EXP_BF16
    assert smallest >= 2.0**-126
    largest = 6.0 * 2.0 ** DECODE_EXP[DType.BF16] * 448.0 * 2.0 ** I.MODELOPT_SCALE_EXP_BF16
    assert largest < 2.0**127
