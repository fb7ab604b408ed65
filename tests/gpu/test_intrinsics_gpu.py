"""Bit-exact GPU tests of the inline-PTX intrinsics (codegen/intrinsics.py) against torch.

Each test runs one probe kernel of specs/probes.yaml (family `intrinsic_probe`, word
layouts in runtime/kernels/probe.py) and compares the raw result words with a reference
computed in torch from the helper's documented semantics -- never from the helper's bit
tricks.  Outputs are poisoned before each launch.  Every test prints one line:
`probe <name>: <cases> cases checked, <n> mismatches`.

Exactness: the references are exact by construction (integer-valued MMA inputs, decodes
of exactly representable values, products / sums exact in float32 before one rounding,
order-independent reductions); the one random-valued MMA case uses a tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

from cuteaot.runtime import load_bundle
from cuteaot.runtime.kernels.probe import ATOMIC_SLOTS, Probe, probe_words, run_probe
from cuteaot.runtime.nf3 import NF3_CODEBOOK
from cuteaot.runtime.types import DType
from tests.reference.e2m1 import E2M1_VALUES, device_code_bits

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

POISON = 0x7FADBEEF
SHOWN = 5  # mismatches printed per failing probe


@pytest.fixture(scope="module")
def bundle(probe_bundle_dir):
    return load_bundle(probe_bundle_dir)


# ----------------------------------------------------------------------------- words and bits


def _i32(x: torch.Tensor) -> torch.Tensor:
    """int64 tensor of u32 values -> int32 words with the same bits."""
    return (((x & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000).to(torch.int32)


def _u32(words: torch.Tensor) -> torch.Tensor:
    """int32 words -> int64 tensor of their u32 values."""
    return words.to(torch.int64) & 0xFFFFFFFF


def _bits16(t: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 tensor -> int64 tensor of its 16-bit patterns."""
    return t.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def _bits32(t: torch.Tensor) -> torch.Tensor:
    return _u32(t.to(torch.float32).contiguous().view(torch.int32))


def _from_bits16(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _i32(bits & 0xFFFF).to(torch.int16).view(dtype)


def _pair(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (lo & 0xFFFF) | ((hi & 0xFFFF) << 16)


def _random_words(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64)


def _run(bundle, probe: Probe, src: torch.Tensor, items: int, dst: torch.Tensor | None = None) -> torch.Tensor:
    """Run `probe` on int32 words `src` (CPU); dst poisoned unless given; returns dst words as u32 (int64, CPU)."""
    _, dst_words = probe_words(probe, items)
    if dst is None:
        dst_gpu = torch.full((dst_words,), POISON, dtype=torch.int32, device="cuda")
    else:
        dst_gpu = dst.to(torch.int32).cuda()
    run_probe(bundle, probe, src.to(torch.int32).cuda(), dst_gpu, items)
    torch.cuda.synchronize()
    return _u32(dst_gpu.cpu())


def _check(capsys, name: str, got: torch.Tensor, want: torch.Tensor, inputs: torch.Tensor | None = None,
           ok: torch.Tensor | None = None) -> None:
    """Compare u32/f32 bit patterns case by case (rows of `got`), print the summary line, assert."""
    got, want = got.reshape(want.shape[0], -1), want.reshape(want.shape[0], -1)
    good = (got == want).all(dim=1) if ok is None else ok
    bad = (~good).nonzero().flatten()
    with capsys.disabled():
        print(f"\nprobe {name}: {want.shape[0]} cases checked, {bad.numel()} mismatches")
    lines = []
    for r in bad[:SHOWN].tolist():
        shown_in = "" if inputs is None else f"in={[hex(v) for v in inputs.reshape(want.shape[0], -1)[r].tolist()]} "
        lines.append(f"  case {r}: {shown_in}got={[hex(v) for v in got[r].tolist()]} "
                     f"want={[hex(v) for v in want[r].tolist()]}")
    assert bad.numel() == 0, f"{name}: {bad.numel()} of {want.shape[0]} cases differ:\n" + "\n".join(lines)


# ----------------------------------------------------------------------------- weight / scale decodes


def _place(code: torch.Tensor, bits: tuple[int, int, int, int]) -> torch.Tensor:
    """A 4-bit e2m1 code's (sign, e1, e0, m) bits at the given word positions."""
    return sum(((code >> cb) & 1) << pos for cb, pos in zip((3, 2, 1, 0), bits))


def _read(words: torch.Tensor, bits: tuple[int, int, int, int]) -> torch.Tensor:
    return sum(((words >> pos) & 1) << cb for cb, pos in zip((3, 2, 1, 0), bits))


def _e2m1_words(g: torch.Generator, dtype: DType) -> torch.Tensor:
    """Every (low, high) code pair of every register, every code in every slot, random words."""
    slots = device_code_bits(dtype.value)
    mask = lambda bits: sum(1 << p for p in bits)  # noqa: E731
    pair = torch.arange(256, dtype=torch.int64)
    parts = []
    for j in range(4):
        lo, hi = slots[j], slots[j + 4]
        base = _random_words(256, g) & ~(mask(lo) | mask(hi)) & 0xFFFFFFFF
        parts.append(base | _place(pair & 15, lo) | _place(pair >> 4, hi))
    code = torch.arange(16, dtype=torch.int64)
    for bits in slots:
        parts.append((_random_words(16, g) & ~mask(bits) & 0xFFFFFFFF) | _place(code, bits))
    parts.append(_random_words(1 << 14, g))
    return torch.cat(parts)


def _e2m1_expected(words: torch.Tensor, exp: int, dtype: DType, elem: torch.dtype) -> torch.Tensor:
    """R0..R3 = (code j, code j + 4) holding e2m1(code) * 2**exp, codes read where the decode reads them."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64) * 2.0**exp
    slots = device_code_bits(dtype.value)

    def half(i):
        return _bits16(table[_read(words, slots[i])].to(torch.float32).to(elem))

    return torch.stack([_pair(half(j), half(j + 4)) for j in range(4)], dim=1)


@pytest.mark.parametrize("probe,exp,dtype,elem", [(Probe.E2M1_BF16, -126, DType.BF16, torch.bfloat16),
                                                   (Probe.E2M1_F16, -14, DType.FP16, torch.float16)])
def test_e2m1_decode(bundle, capsys, probe, exp, dtype, elem):
    words = _e2m1_words(torch.Generator().manual_seed(1), dtype)
    got = _run(bundle, probe, _i32(words), words.numel())
    _check(capsys, probe.value, got, _e2m1_expected(words, exp, dtype, elem), inputs=words)


def _byte_words(g: torch.Generator) -> torch.Tensor:
    """All 256 byte values in every byte position (four permutations), plus random words."""
    j = torch.arange(256, dtype=torch.int64)
    structured = sum(((j + 67 * k) & 255) << (8 * k) for k in range(4))
    return torch.cat([structured, _random_words(4096, g)])


def _bytes_of(words: torch.Tensor, k: int) -> torch.Tensor:
    return (words >> (8 * k)) & 255


def _by_byte(words: torch.Tensor, decode_byte) -> torch.Tensor:
    """(lo, hi) = ((byte 0, byte 2), (byte 1, byte 3)) with each half `decode_byte(byte)` (16-bit patterns)."""
    b = [decode_byte(_bytes_of(words, k)) for k in range(4)]
    return torch.stack([_pair(b[0], b[2]), _pair(b[1], b[3])], dim=1)


def _e5m3_value(byte: torch.Tensor) -> torch.Tensor:
    """The value s * 2**7 an S0E5M3 byte encodes: 5 exponent bits (bias 15), 3 mantissa bits, no sign,
    subnormal for exponent 0; exponent 31 read as an ordinary binade (no inf / NaN)."""
    e, m = (byte >> 3).to(torch.float64), (byte & 7).to(torch.float64)
    normal = torch.exp2(e - 15) * (1 + m / 8)
    return torch.where(e == 0, 2.0**-14 * (m / 8), normal)


def _s0e5m3_f16(byte: torch.Tensor) -> torch.Tensor:
    # S0E5M3 is fp16 without its sign and low 7 mantissa bits: exactly the value for exponents
    # below 31; exponent 31 lands on fp16's inf / NaN patterns (byte << 7), which scales never use.
    value_bits = _bits16(_e5m3_value(byte).to(torch.float32).to(torch.float16))
    return torch.where((byte >> 3) == 31, byte << 7, value_bits)


def _s0e5m3_bf16(byte: torch.Tensor) -> torch.Tensor:
    # s * 2**23 = the byte's value * 2**16, exact for exponent fields >= 1 (every prepared e4m3
    # scale); an exponent-0 byte reads as the normal 2 * (1 + m / 8) (documented, never produced).
    e, m = (byte >> 3).to(torch.float64), (byte & 7).to(torch.float64)
    value = torch.where(e == 0, 2.0 * (1 + m / 8), _e5m3_value(byte) * 2.0**16)
    return _bits16(value.to(torch.float32).to(torch.bfloat16))


def _e8m0_bf16(byte: torch.Tensor) -> torch.Tensor:
    # 2**(e - 127) * 2**7; e >= 248 overflows bf16 to +inf (0xFF, NaN in e8m0, also gives inf).
    return _bits16(torch.exp2(byte.to(torch.float64) - 120).to(torch.float32).to(torch.bfloat16))


def _e8m0_f16(byte: torch.Tensor) -> torch.Tensor:
    # 2**(e - 127) * 2**7 clamped to fp16's normal binades: +0 for e <= 105, +inf for e >= 136.
    value = torch.exp2(byte.to(torch.float64) - 120)
    value = torch.where(byte <= 105, torch.zeros_like(value), value)
    value = torch.where(byte >= 136, torch.full_like(value, math.inf), value)
    return _bits16(value.to(torch.float32).to(torch.float16))


@pytest.mark.parametrize("probe,decode_byte", [
    (Probe.S0E5M3_BF16, _s0e5m3_bf16), (Probe.S0E5M3_F16, _s0e5m3_f16),
], ids=lambda v: v.value if isinstance(v, Probe) else "")
def test_scale_pair_decode(bundle, capsys, probe, decode_byte):
    """scale_halves_s0e5m3_*(x, 0 | 1), each half broadcast by the main loops' multiply (times 1.0 here):
    (s, s) of one byte, for every byte value in every position.  fp16 bytes >= 0xF9 (exponent field 31,
    never produced by `pack_nvfp4`) are NaN patterns, which the multiply returns as the canonical NaN."""
    words = _byte_words(torch.Generator().manual_seed(2))
    got = _run(bundle, probe, _i32(words), words.numel())
    want = torch.stack([_pair(b, b) for b in (decode_byte(_bytes_of(words, k)) for k in range(4))], dim=1)
    exponent, mantissa = (0x7C00, 0x03FF) if probe is Probe.S0E5M3_F16 else (0x7F80, 0x007F)

    def nan_pairs(w):
        halves = torch.stack([w & 0xFFFF, (w >> 16) & 0xFFFF], dim=-1)
        return (((halves & exponent) == exponent) & ((halves & mantissa) != 0)).all(dim=-1)

    got = got.reshape(want.shape)
    same = (got == want) | (nan_pairs(got) & nan_pairs(want))
    _check(capsys, probe.value, got, want, inputs=words, ok=same.all(dim=1))


@pytest.mark.parametrize("probe,decode_byte", [
    (Probe.E8M0_BF16, _e8m0_bf16), (Probe.E8M0_F16, _e8m0_f16),
], ids=lambda v: v.value if isinstance(v, Probe) else "")
def test_scale_decode(bundle, capsys, probe, decode_byte):
    words = _byte_words(torch.Generator().manual_seed(2))
    got = _run(bundle, probe, _i32(words), words.numel())
    _check(capsys, probe.value, got, _by_byte(words, decode_byte), inputs=words)


def test_s0e5m3_f16_is_the_byte_shifted():
    """The reference above agrees with the docstring's bit statement: fp16 bits = byte << 7."""
    byte = torch.arange(256, dtype=torch.int64)
    assert torch.equal(_s0e5m3_f16(byte), byte << 7)


def test_nf3_decode(bundle, capsys):
    """Every bit pattern of three NF3 words decodes to the code points docs/layouts.md places there."""
    from cuteaot.runtime.nf3 import GATHER_SOURCES, GROUP_SHIFTS, UNIT_FIELD_BITS

    g = torch.Generator().manual_seed(3)
    n = 8192
    words = torch.stack([_random_words(n, g) for _ in range(3)], dim=1)  # (n, 3) u32
    words[:256, 0] = torch.arange(256) * 0x01010101  # every byte value in every byte of x0
    bit = lambda w, p: (w >> p) & 1  # noqa: E731
    y3 = sum(bit(words[:, x], p + d) << p for p in range(32) if p % 8 in GATHER_SOURCES
             for x, d in [GATHER_SOURCES[p % 8]])  # bits {4, 6} of each byte stay 0
    decode = torch.cat([words, y3[:, None]], dim=1)  # the four decode words
    book = _bits16(torch.tensor(NF3_CODEBOOK, dtype=torch.float32).to(torch.bfloat16))
    want = []
    for jj in range(4):
        for j in range(4):
            halves = []
            for half in range(2):
                base = 8 * (2 * (j % 2) + half) + GROUP_SHIFTS[j // 2]
                m0, m1, sign = (bit(decode[:, jj], base + f) for f in UNIT_FIELD_BITS)
                m = m0 | m1 << 1
                halves.append(book[torch.where(sign.bool(), 3 - m, 4 + m)])
            want.append(_pair(*halves))
    got = _run(bundle, Probe.NF3_BF16, _i32(words.flatten()), n)
    _check(capsys, "nf3_bf16", got, torch.stack(want, dim=1), inputs=words)


# ----------------------------------------------------------------------------- tensor cores


def _mma_src(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """(items, 16, 16) A, (items, 16, 8) B, (items, 16, 8) f32 C -> the probe's src words."""
    bt = b.transpose(1, 2).contiguous()  # (items, 8, 16): B^T row-major, k pairs in one word
    words = [a.contiguous().view(torch.int32), bt.view(torch.int32), c.float().contiguous().view(torch.int32)]
    return torch.cat([w.reshape(a.shape[0], -1) for w in words], dim=1).flatten()


def _mma_run(bundle, probe, a, b, c) -> torch.Tensor:
    got = _run(bundle, probe, _mma_src(a, b, c), a.shape[0])
    return _i32(got).view(torch.float32).reshape(a.shape[0], 16, 8)


@pytest.mark.parametrize("probe,dtype", [(Probe.MMA_BF16, torch.bfloat16), (Probe.MMA_F16, torch.float16)])
def test_mma_exact(bundle, capsys, probe, dtype):
    """Integer-valued A, B, C: every product and partial sum is exact in float32, so D must be bit-exact."""
    g = torch.Generator().manual_seed(4)
    n = 64
    a = torch.randint(-8, 9, (n, 16, 16), generator=g).to(dtype)
    b = torch.randint(-8, 9, (n, 16, 8), generator=g).to(dtype)
    c = torch.randint(-64, 65, (n, 16, 8), generator=g).float()
    # fragment-placement cases: A = I picks B's rows; B = the first 8 columns of I picks A's columns
    distinct = (torch.arange(128).reshape(16, 8) - 64).to(dtype)
    a[0], b[0], c[0] = torch.eye(16, dtype=dtype), distinct, 0
    a[1], b[1], c[1] = (torch.arange(256).reshape(16, 16) - 128).to(dtype), torch.eye(16, 8, dtype=dtype), 0.5
    want = (a.double() @ b.double() + c.double()).float()
    got = _mma_run(bundle, probe, a, b, c)
    _check(capsys, f"{probe.value} (integer)", _bits32(got).reshape(n, -1), _bits32(want).reshape(n, -1))


@pytest.mark.parametrize("probe,dtype", [(Probe.MMA_BF16, torch.bfloat16), (Probe.MMA_F16, torch.float16)])
def test_mma_random(bundle, capsys, probe, dtype):
    """Random normal A, B, C: within float32 accumulation error of a float64 reference."""
    g = torch.Generator().manual_seed(5)
    n = 64
    a = torch.randn(n, 16, 16, generator=g).to(dtype)
    b = torch.randn(n, 16, 8, generator=g).to(dtype)
    c = torch.randn(n, 16, 8, generator=g)
    want = a.double() @ b.double() + c.double()
    bound = a.double().abs() @ b.double().abs() + c.double().abs()
    got = _mma_run(bundle, probe, a, b, c).double()
    ok = ((got - want).abs() <= 2.0**-18 * bound).reshape(n, -1).all(dim=1)
    err = float(((got - want).abs() / bound).max())
    with capsys.disabled():
        print(f"\nprobe {probe.value} (random): max |D - ref| / (|A||B| + |C|) = {err:.2e}")
    _check(capsys, f"{probe.value} (random)", _bits32(got).reshape(n, -1), _bits32(want.float()).reshape(n, -1),
           ok=ok)


# ----------------------------------------------------------------------------- ldmatrix


@pytest.mark.parametrize("probe", [Probe.LDMATRIX_X4, Probe.LDMATRIX_X2], ids=lambda p: p.value)
def test_ldmatrix(bundle, capsys, probe):
    """Distinct 16-bit values per tile element; registers must follow the mma fragment layout."""
    g = torch.Generator().manual_seed(6)
    n = 16
    tiles = (torch.randint(0, 2**16 - 256, (n, 1, 1), generator=g) + torch.arange(256).reshape(16, 16))
    words = tiles.reshape(n, 16, 8, 2)
    words = (words[..., 0] | (words[..., 1] << 16))  # (n, 16, 8): word (r, c // 2)
    lane = torch.arange(32)
    gid, tig = lane // 4, lane % 4
    regs = 4 if probe is Probe.LDMATRIX_X4 else 2
    want = []
    for j in range(regs):
        # x4: matrices T[0:8, 0:8], T[8:16, 0:8], T[0:8, 8:16], T[8:16, 8:16] = mma A fragments a0..a3;
        # x2: T[0:8, 0:8], T[0:8, 8:16] = mma B fragments b0, b1 of B^T = T[0:8]
        row = gid + (8 * (j % 2) if regs == 4 else 0)
        col_word = tig + 4 * (j // 2 if regs == 4 else j)
        want.append(words[:, row, col_word])  # (n, 32)
    want = torch.stack(want, dim=2).reshape(n, -1)  # dst[regs * lane + j]
    got = _run(bundle, probe, _i32(words.flatten()), n)
    _check(capsys, probe.value, got.reshape(n, -1), want)


# ----------------------------------------------------------------------------- pair arithmetic


def _finite_16(g, n: int, dtype: torch.dtype) -> torch.Tensor:
    """n random finite 16-bit patterns of dtype (every sign, exponent incl. subnormals, mantissa)."""
    bits = torch.randint(0, 2**16, (4 * n,), generator=g, dtype=torch.int64)
    vals = _from_bits16(bits, dtype)
    return bits[torch.isfinite(vals.float())][:n]


def _moderate_bf16(g, n: int) -> torch.Tensor:
    """bf16 patterns with |x| in [2**-60, 2**61): products stay normal and exact in float32."""
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) << 15
    exp = torch.randint(127 - 60, 127 + 61, (n,), generator=g, dtype=torch.int64) << 7
    return sign | exp | torch.randint(0, 128, (n,), generator=g, dtype=torch.int64)


def _special_pairs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    tiny = torch.finfo(dtype).smallest_normal
    big = torch.finfo(dtype).max
    a = [0.0, -0.0, 0.0, 1.0, -1.0, math.inf, -math.inf, math.inf, big, big, tiny, tiny / 4, tiny / 2, -tiny / 8,
         1.5, 3.0, 1 + 2**-7, 7.0, 0.1, -0.3]
    b = [0.0, 0.0, -5.0, -0.0, 2.0, 3.0, 0.5, -2.0, 2.0, -1.5, 0.5, 2.0, 0.25, 1.0, 1.5, 1 / 3, 1 + 2**-7, 1.25, 3.3,
         0.7]
    return _bits16(torch.tensor(a).to(dtype)), _bits16(torch.tensor(b).to(dtype))


@pytest.mark.parametrize("probe,dtype", [(Probe.MUL_BF16X2, torch.bfloat16), (Probe.MUL_F16X2, torch.float16)],
                         ids=["bf16x2", "f16x2"])
def test_pair_mul(bundle, capsys, probe, dtype):
    """Products of two 16-bit floats are exact in float32, so float32 product -> one RNE rounding is the truth."""
    g = torch.Generator().manual_seed(7)
    n = 1 << 15
    if dtype is torch.bfloat16:
        a, b = _moderate_bf16(g, n), _moderate_bf16(g, n)
    else:  # every finite fp16 pair: products (>= 2**-48) are float32-normal
        a, b = _finite_16(g, n, dtype), _finite_16(g, n, dtype)
    sa, sb = _special_pairs(dtype)
    a, b = torch.cat([a, sa]), torch.cat([b, sb])
    m = a.numel() // 2  # one word per item holds two lanes
    a, b = a[: 2 * m], b[: 2 * m]
    prod = _bits16((_from_bits16(a, dtype).float() * _from_bits16(b, dtype).float()).to(dtype))
    wa, wb = _pair(a[0::2], a[1::2]), _pair(b[0::2], b[1::2])
    got = _run(bundle, probe, _i32(torch.stack([wa, wb], dim=1).flatten()), m)
    _check(capsys, probe.value, got, _pair(prod[0::2], prod[1::2]), inputs=torch.stack([wa, wb], dim=1))


def _float_cases(g) -> torch.Tensor:
    """float32 inputs: every binade around bf16 / fp16 range edges, ties, specials (no NaN)."""
    n = 1 << 14
    exp = torch.randint(-150, 140, (n,), generator=g).double()
    mant = torch.randint(0, 2**24, (n,), generator=g).double() / 2**24
    sign = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    wide = (sign * (1 + mant) * torch.exp2(exp)).float()
    rand_bits = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64)
    rand = _i32(rand_bits).view(torch.float32)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, 65504.0, 65519.99, 65520.0, -65520.0, 1 + 2**-8,
                            1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 2.0**-24, 2.0**-25, 2.0**-25 * 1.5, 2.0**-133,
                            2.0**-134, 3.3895313892515355e38, 3.4e38, 1e-40, -1e-45, 2.0**-126, 0.1, 1 / 3],
                           dtype=torch.float32)
    x = torch.cat([wide, rand, special])
    return x[~torch.isnan(x)]


def test_pack_f32(bundle, capsys):
    """cvt.rn to bf16x2 / half2 (packed and broadcast) against torch's round-to-nearest-even conversions."""
    x = _float_cases(torch.Generator().manual_seed(8))
    x = x[: x.numel() // 2 * 2]
    x0, x1 = x[0::2], x[1::2]
    bf = lambda v: _bits16(v.to(torch.bfloat16))  # noqa: E731
    hf = lambda v: _bits16(v.to(torch.float16))  # noqa: E731
    want = torch.stack([_pair(bf(x0), bf(x1)), _pair(hf(x0), hf(x1)), _pair(bf(x0), bf(x0)), _pair(hf(x0), hf(x0))],
                       dim=1)
    src = torch.stack([x0, x1], dim=1).flatten().view(torch.int32)
    got = _run(bundle, Probe.PACK_F32, src, x0.numel())
    _check(capsys, "pack_f32 (pack_f32x2_*, f32_to_*x2_broadcast)", got, want, inputs=_u32(src))


def test_unpack_pairs(bundle, capsys):
    """Every 16-bit pattern in each half: bf16 / fp16 -> f32 exact (NaN stays NaN), lane broadcasts."""
    lo = torch.arange(1 << 16, dtype=torch.int64)
    hi = (lo * 40503 + 12345) & 0xFFFF  # a permutation: every pattern in the high half too
    words = _pair(lo, hi)
    f32 = lambda bits, dt: _bits32(_from_bits16(bits, dt).float())  # noqa: E731
    want = torch.stack([f32(lo, torch.bfloat16), f32(hi, torch.bfloat16), f32(lo, torch.float16),
                        f32(hi, torch.float16), _pair(lo, lo), _pair(hi, hi)], dim=1)
    got = _run(bundle, Probe.UNPACK_PAIRS, _i32(words), words.numel()).reshape(-1, 6)
    # fp16 NaN payloads are not part of the contract: a NaN must stay a NaN
    nan_lo = torch.isnan(_from_bits16(lo, torch.float16).float())
    nan_hi = torch.isnan(_from_bits16(hi, torch.float16).float())
    as_f32 = lambda col: _i32(got[:, col]).view(torch.float32)  # noqa: E731
    ok_f16 = (torch.where(nan_lo, torch.isnan(as_f32(2)), got[:, 2] == want[:, 2])
              & torch.where(nan_hi, torch.isnan(as_f32(3)), got[:, 3] == want[:, 3]))
    ok = (got[:, [0, 1, 4, 5]] == want[:, [0, 1, 4, 5]]).all(dim=1) & ok_f16
    _check(capsys, "unpack_pairs (bf16x2/f16x2_to_f32x2, pair_broadcast_lane)", got, want, inputs=words, ok=ok)


# ----------------------------------------------------------------------------- global reductions


def _slots_src(slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Reduction probe items: each target slot followed by its value word(s), values (n,) or (n, words)."""
    return _i32(torch.cat([slots[:, None], (values & 0xFFFFFFFF).reshape(slots.numel(), -1)], dim=1).flatten())


def _contended_slots(g, per_slot: int, count: int = ATOMIC_SLOTS) -> torch.Tensor:
    """per_slot updates to each of `count` targets, shuffled across threads and CTAs."""
    slots = torch.arange(count, dtype=torch.int64).repeat(per_slot)
    return slots[torch.randperm(slots.numel(), generator=g)]


@pytest.mark.parametrize("probe,dtype", [(Probe.RED_ADD_V4_BF16X2, torch.bfloat16),
                                          (Probe.RED_ADD_V4_F16X2, torch.float16)], ids=["bf16x2", "f16x2"])
def test_red_add_chunks(bundle, capsys, probe, dtype):
    """The 16-byte vector reduction (eight 16-bit floats at once) the top-k sum in FC2 adds with."""
    g = torch.Generator().manual_seed(9)
    chunks = ATOMIC_SLOTS // 4  # items: (chunk, four words)
    # (1) one update per chunk: each element the sum of two 16-bit floats, rounded once (exact in float32 first)
    init, upd = _finite_16(g, 2 * ATOMIC_SLOTS, dtype), _finite_16(g, 2 * ATOMIC_SLOTS, dtype)
    to_f = lambda bits: _from_bits16(bits, dtype).float()  # noqa: E731
    summed = _bits16((to_f(init) + to_f(upd)).to(dtype))
    dst = _i32(_pair(init[0::2], init[1::2]))
    words = _pair(upd[0::2], upd[1::2])
    got = _run(bundle, probe, _slots_src(torch.arange(chunks), words.reshape(chunks, 4)), chunks, dst=dst)
    _check(capsys, f"{probe.value} (rounding)", got, _pair(summed[0::2], summed[1::2]),
           inputs=torch.stack([_u32(dst), words], dim=1))
    # (2) 128 updates per chunk from 2048 threads: small integers, every partial sum exact in any order
    per_chunk = 128
    targets = _contended_slots(g, per_chunk, chunks)
    vals = torch.randint(-1, 3, (targets.numel(), 8), generator=g)  # partial sums within [-128, 256]: exact
    words = _pair(_bits16(vals[:, 0::2].to(dtype)), _bits16(vals[:, 1::2].to(dtype)))
    total = torch.zeros(chunks, 8, dtype=torch.int64).index_add_(0, targets, vals).reshape(-1, 2)
    want = _pair(_bits16(total[:, 0].to(dtype)), _bits16(total[:, 1].to(dtype)))
    zero = torch.zeros(ATOMIC_SLOTS, dtype=torch.int32)
    got = _run(bundle, probe, _slots_src(targets, words), targets.numel(), dst=zero)
    _check(capsys, f"{probe.value} (contended, {per_chunk} per chunk)", got, want)


def test_red_max_f32_nonnegative(bundle, capsys):
    g = torch.Generator().manual_seed(10)
    slots = _contended_slots(g, 128)
    n = slots.numel()
    exp = torch.randint(-149, 128, (n,), generator=g).double()
    vals = (torch.rand(n, generator=g, dtype=torch.float64) * torch.exp2(exp)).float()  # incl. subnormals
    vals[torch.randperm(n, generator=g)[:16]] = 0.0
    vals[n // 2] = math.inf  # one slot's max is +inf
    init = (torch.rand(ATOMIC_SLOTS, generator=g) * 2.0**100).float()
    init[:4] = torch.tensor([0.0, 1e-45, math.inf, 3e38])
    want = init.clone().scatter_reduce_(0, slots, vals, reduce="amax", include_self=True)
    got = _run(bundle, Probe.RED_MAX_F32, _slots_src(slots, _bits32(vals)), n, dst=init.view(torch.int32))
    _check(capsys, "red_max_f32_nonnegative", got, _bits32(want))


def test_atom_add_i32(bundle, capsys):
    """Final counts equal init + sum; per slot, the returned old values chain init -> final."""
    g = torch.Generator().manual_seed(11)
    slots = _contended_slots(g, 128)
    n = slots.numel()
    vals = torch.randint(1, 1000, (n,), generator=g)
    init = torch.randint(-(2**20), 2**20, (ATOMIC_SLOTS,), generator=g)
    dst = torch.cat([init, torch.full((n,), POISON, dtype=torch.int64)])  # slots, then the old values
    got = _i32(_run(bundle, Probe.ATOM_ADD_I32, _slots_src(slots, vals), n, dst=_i32(dst))).to(torch.int64)
    final, old = got[:ATOMIC_SLOTS], got[ATOMIC_SLOTS:]
    want_final = init.clone().index_add_(0, slots, vals)
    ok = final == want_final
    for s in range(ATOMIC_SLOTS):  # values are positive: sorting the old values gives the serial order
        mine = (slots == s).nonzero().flatten()
        o, order = old[mine].sort()
        chain = torch.cat([o, final[s:s + 1]])
        ok[s] &= bool(o[0] == init[s]) and bool(torch.equal(chain[1:] - chain[:-1], vals[mine][order]))
    _check(capsys, "atom_add_i32", torch.stack([final, init], 1), torch.stack([want_final, init], 1), ok=ok)


# ----------------------------------------------------------------------------- cp.async


def test_cp_async_zfill(bundle, capsys):
    """pred != 0 copies 16 bytes, pred == 0 writes 16 zero bytes, -1 selects the plain cp_async_16."""
    g = torch.Generator().manual_seed(12)
    n = 1000  # 8 CTAs, the last one partial
    data = _random_words(4 * n, g).reshape(n, 4)
    flags = torch.tensor([-1, 0, 1, 7, -(2**31), 0], dtype=torch.int64)[torch.randint(0, 6, (n,), generator=g)]
    src = torch.cat([data, flags[:, None] & 0xFFFFFFFF, torch.zeros(n, 3, dtype=torch.int64)], dim=1)
    want = torch.where((flags != 0)[:, None], data, torch.zeros_like(data))
    got = _run(bundle, Probe.CP_ASYNC, _i32(src.flatten()), n)
    _check(capsys, "cp_async_16 / cp_async_16_zfill", got, want, inputs=torch.cat([flags[:, None], data], 1))



# ----------------------------------------------------------------------------- the ModelOpt-layout decodes


def _e2m1_value(code: torch.Tensor) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float64)[code]


@pytest.mark.parametrize("probe,exp,elem", [(Probe.E2M1_CODES_BF16, -126, torch.bfloat16),
                                            (Probe.E2M1_CODES_F16, -14, torch.float16)],
                         ids=lambda v: v.value if isinstance(v, Probe) else "")
def test_e2m1_codes_decode(bundle, capsys, probe, exp, elem):
    """dequant_e2m1_codes_*: pair j = (code j, code j + 4) of the word (code j on bits 4j .. 4j + 3),
    w * 2**exp (NVFP4's definition)."""
    g = torch.Generator().manual_seed(5)
    words = torch.cat([torch.arange(256, dtype=torch.int64) * 0x01010101, _random_words(8192, g)])
    got = _run(bundle, probe, _i32(words), words.numel())

    def bits(c):
        return _bits16((_e2m1_value((words >> (4 * c)) & 0xF) * 2.0**exp).to(torch.float32).to(elem))

    want = torch.stack([_pair(bits(j), bits(j + 4)) for j in range(4)], dim=1)
    _check(capsys, probe.value, got, want, inputs=words)


@pytest.mark.parametrize("probe,offset,elem", [(Probe.E4M3_PAIR_BF16, 2.0**15, torch.bfloat16),
                                               (Probe.E4M3_PAIR_F16, 1.0, torch.float16)],
                         ids=lambda v: v.value if isinstance(v, Probe) else "")
def test_e4m3_pair_decode(bundle, capsys, probe, offset, elem):
    """scale_pairs_e4m3_*: (s, s) * offset of byte k of x and of y (x with its halves swapped: byte
    k + 2), every e4m3 byte in every position, zero and subnormals included; bf16 reads the magnitude
    (negative scales are refused when weights are prepared; -0 reads as 0), fp16 the value.  NaN
    bytes are refused too, so they are left out."""
    words = _byte_words(torch.Generator().manual_seed(6))
    nan = torch.zeros_like(words, dtype=torch.bool)
    for k in range(4):
        nan |= (_bytes_of(words, k) & 0x7F) == 0x7F
    words = words[~nan]
    got = _run(bundle, probe, _i32(words), words.numel())

    def pair(byte):
        value = byte.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
        value = (value.abs() if elem is torch.bfloat16 else value) * offset
        b = _bits16(value.to(torch.float32).to(elem))
        return _pair(b, b)

    want = torch.stack([pair(_bytes_of(words, (k + h) % 4)) for k in range(4) for h in (0, 2)], dim=1)
    _check(capsys, probe.value, got, want, inputs=words)
