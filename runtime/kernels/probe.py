"""Test-only kernel family `intrinsic_probe`: one tiny kernel per inline-PTX intrinsic.

Each probe applies one helper of `cuteaot.codegen.intrinsics` to 32-bit words read
from a global buffer and writes the raw result words to another, so the GPU tests
(tests/gpu/test_intrinsics_gpu.py) can compare bit patterns with torch.  Nothing
in serving uses these kernels; a bundle contains them only when its spec says
`probes: true` (specs/probes.yaml).

Every probe has the same parameters, (src, dst, items), and a word layout:

    src: (items * src_words,) int32 words (u32 / f32 bit patterns), 16B aligned
    dst: (dst_prefix + items * dst_words,) int32 words, 16B aligned
    item i reads src[i*src_words : (i+1)*src_words]
    and writes dst[dst_prefix + i*dst_words : dst_prefix + (i+1)*dst_words]

A THREAD probe runs one item per thread (THREAD_BLOCK threads a CTA, the tail
guarded); a WARP probe runs one item per 32-thread CTA (grid = items).  What the
words of each probe mean is in the `doc` of its layout below.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..abi import Pointee, Signature, i32, ptr
from ..bundle import Bundle, current_stream_handle
from ..errors import BadInputError, BundleError
from ..keys import SpecKey
from ..tensors import check_apart, check_tensor

THREAD_BLOCK = 128  # threads per CTA of a THREAD probe
WARP = 32
ATOMIC_SLOTS = 64  # dst words the reduction probes may target (the dst prefix)
MAX_WORDS = 1 << 30  # the kernels index src / dst with 32-bit word offsets
MMA_A_WORDS, MMA_BT_WORDS, MMA_C_WORDS = 128, 64, 128  # A 16x16 b16, B^T 8x16 b16, C 16x8 f32
TILE_WORDS = 128  # a 16x16 b16 tile, row-major
# The NF3 codebook of the seed (bf16-rounded on both sides: device pools and torch).


class ProbeUnit(str, Enum):
    THREAD = "thread"  # one item per thread
    WARP = "warp"  # one item per 32-thread CTA


@dataclass(frozen=True)
class ProbeLayout:
    unit: ProbeUnit
    src_words: int  # per item
    dst_words: int  # per item
    doc: str
    dst_prefix: int = 0  # words of dst before the per-item results (reduction targets)
    target_words: int = 1  # reduction probes: dst words one target spans (src word 0 of an item names it)
    smem_bytes: int = 0  # dynamic shared memory per CTA

    @property
    def threads(self) -> int:
        return THREAD_BLOCK if self.unit is ProbeUnit.THREAD else WARP


_DECODE = "src[i] = x (u32); dst = (p, q): the two pairs the helper returns, in order"
_REDUCE = (f"src[i] = (slot < {ATOMIC_SLOTS}, value); the helper reduces value into dst[slot] "
           "(dst[0:ATOMIC_SLOTS] is the prefix, set by the caller)")
_REDUCE_CHUNK = (f"src[i] = (chunk < {ATOMIC_SLOTS // 4}, four words); the helper reduces the words into dst[4 chunk: "
                 "4 chunk + 4] (dst[0:ATOMIC_SLOTS] is the prefix, set by the caller)")


class Probe(str, Enum):
    """The probe kernels; `layout` says what their words mean."""

    E2M1_BF16 = "e2m1_bf16"
    E2M1_F16 = "e2m1_f16"
    S0E5M3_BF16 = "s0e5m3_bf16"
    S0E5M3_F16 = "s0e5m3_f16"
    E8M0_BF16 = "e8m0_bf16"
    E8M0_F16 = "e8m0_f16"
    NF3_BF16 = "nf3_bf16"
    E2M1_CODES_BF16 = "e2m1_codes_bf16"
    E2M1_CODES_F16 = "e2m1_codes_f16"
    E4M3_PAIR_BF16 = "e4m3_pair_bf16"
    E4M3_PAIR_F16 = "e4m3_pair_f16"
    MMA_BF16 = "mma_bf16"
    MMA_F16 = "mma_f16"
    LDMATRIX_X4 = "ldmatrix_x4"
    LDMATRIX_X2 = "ldmatrix_x2"
    MUL_BF16X2 = "mul_bf16x2"
    MUL_F16X2 = "mul_f16x2"
    PACK_F32 = "pack_f32"
    UNPACK_PAIRS = "unpack_pairs"
    RED_ADD_V4_BF16X2 = "red_add_v4_bf16x2"
    RED_ADD_V4_F16X2 = "red_add_v4_f16x2"
    RED_MAX_F32 = "red_max_f32"
    ATOM_ADD_I32 = "atom_add_i32"
    CP_ASYNC = "cp_async"

    @property
    def layout(self) -> ProbeLayout:
        return LAYOUTS[self]


_T, _W = ProbeUnit.THREAD, ProbeUnit.WARP
LAYOUTS: dict[Probe, ProbeLayout] = {
    Probe.E2M1_BF16: ProbeLayout(_T, 1, 4, "src[i] = x (u32); dst = the four pairs R0..R3 of dequant_e2m1x8_bf16"),
    Probe.E2M1_F16: ProbeLayout(_T, 1, 4, "src[i] = x (u32); dst = the four pairs R0..R3 of dequant_e2m1x8_f16"),
    Probe.S0E5M3_BF16: ProbeLayout(_T, 1, 4, (
        "src[i] = x (u32); dst = (s, s) of byte 0..3: bf16x2_mul_half(1.0, scale_halves_s0e5m3_bf16(x, byte % 2), "
        "byte // 2)")),
    Probe.S0E5M3_F16: ProbeLayout(_T, 1, 4, (
        "src[i] = x (u32); dst = (s, s) of byte 0..3: f16x2_mul_half(1.0, scale_halves_s0e5m3_f16(x, byte % 2), "
        "byte // 2)")),
    Probe.E8M0_BF16: ProbeLayout(_T, 1, 2, _DECODE + " (dequant_e8m0x4_bf16)"),
    Probe.E8M0_F16: ProbeLayout(_T, 1, 2, _DECODE + " (dequant_e8m0x4_f16)"),
    Probe.NF3_BF16: ProbeLayout(
        _T, 3, 16, "src[i] = (x0, x1, x2); dst = R0..R3 of dequant_nf3_word_bf16 of x0, x1, x2 and nf3_gather(x0, x1, x2)"
    ),
    Probe.E2M1_CODES_BF16: ProbeLayout(_T, 1, 4, "src[i] = x (u32); dst = the four pairs (code j, code j + 4) of "
                                       "dequant_e2m1_codes_bf16"),
    Probe.E2M1_CODES_F16: ProbeLayout(_T, 1, 4, "src[i] = x (u32); dst = the four pairs (code j, code j + 4) of "
                                      "dequant_e2m1_codes_f16"),
    Probe.E4M3_PAIR_BF16: ProbeLayout(_T, 1, 8, "src[i] = x (u32); dst = scale_pairs_e4m3_bf16(x, y, "
                                      "e4m3_pairs_selector(byte)), byte = 0..3, y = x with its halves swapped"),
    Probe.E4M3_PAIR_F16: ProbeLayout(_T, 1, 8, "src[i] = x (u32); dst = scale_pairs_e4m3_f16(x, y, "
                                     "e4m3_pairs_selector(byte)), byte = 0..3, y = x with its halves swapped"),
    Probe.MMA_BF16: ProbeLayout(
        _W, MMA_A_WORDS + MMA_BT_WORDS + MMA_C_WORDS, 128,
        "src = A (16x16 bf16, row-major) | B^T (8x16 bf16, row-major: B^T[n, k] = B[k, n]) | C (16x8 f32, "
        "row-major); fragments loaded as mma_bf16_m16n8k16 documents; dst = D = A @ B + C (16x8 f32, row-major)",
    ),
    Probe.MMA_F16: ProbeLayout(_W, MMA_A_WORDS + MMA_BT_WORDS + MMA_C_WORDS, 128, "as mma_bf16 with fp16 A, B"),
    Probe.LDMATRIX_X4: ProbeLayout(
        _W, TILE_WORDS, 4 * WARP,
        "src = T (16x16 b16, row-major), staged in shared memory; lane i addresses row i % 8 of matrix i // 8 "
        "(matrices T[0:8, 0:8], T[8:16, 0:8], T[0:8, 8:16], T[8:16, 8:16]); dst[4 * lane + j] = register j",
        smem_bytes=TILE_WORDS * 4,
    ),
    Probe.LDMATRIX_X2: ProbeLayout(
        _W, TILE_WORDS, 2 * WARP,
        "src = T (16x16 b16, row-major) in shared memory; lane i (< 16) addresses row i % 8 of matrix i // 8 "
        "(matrices T[0:8, 0:8], T[0:8, 8:16]); dst[2 * lane + j] = register j",
        smem_bytes=TILE_WORDS * 4,
    ),
    Probe.MUL_BF16X2: ProbeLayout(_T, 2, 1, "src[i] = (a, b) bf16x2; dst[i] = bf16x2_mul(a, b)"),
    Probe.MUL_F16X2: ProbeLayout(_T, 2, 1, "src[i] = (a, b) half2; dst[i] = f16x2_mul(a, b)"),
    Probe.PACK_F32: ProbeLayout(
        _T, 2, 4,
        "src[i] = (x0, x1) f32; dst = (pack_f32x2_bf16x2(x0, x1), pack_f32x2_f16x2(x0, x1), "
        "f32_to_bf16x2_broadcast(x0), f32_to_f16x2_broadcast(x0))",
    ),
    Probe.UNPACK_PAIRS: ProbeLayout(
        _T, 1, 6,
        "src[i] = x (u32); dst = (*bf16x2_to_f32x2(x), *f16x2_to_f32x2(x), "
        "pair_broadcast_lane(x, 0), pair_broadcast_lane(x, 1)), floats as f32 bits",
    ),
    Probe.RED_ADD_V4_BF16X2: ProbeLayout(_T, 5, 0, _REDUCE_CHUNK + " with red_add_v4_bf16x2", dst_prefix=ATOMIC_SLOTS,
                                         target_words=4),
    Probe.RED_ADD_V4_F16X2: ProbeLayout(_T, 5, 0, _REDUCE_CHUNK + " with red_add_v4_f16x2", dst_prefix=ATOMIC_SLOTS,
                                        target_words=4),
    Probe.RED_MAX_F32: ProbeLayout(
        _T, 2, 0, _REDUCE + " with red_max_f32_nonnegative (values and slots >= +0)", dst_prefix=ATOMIC_SLOTS
    ),
    Probe.ATOM_ADD_I32: ProbeLayout(
        _T, 2, 1, _REDUCE + " with atom_add_i32; dst[ATOMIC_SLOTS + i] = the old value it returned",
        dst_prefix=ATOMIC_SLOTS,
    ),
    Probe.CP_ASYNC: ProbeLayout(
        _T, 8, 4,
        "src[i] = (4 data words, pred, 3 unused); a poisoned shared slot gets cp_async_16 (pred == -1) or "
        "cp_async_16_zfill(pred) of the data; dst[i] = the slot read back: the data, or zeros for pred == 0",
        smem_bytes=THREAD_BLOCK * 16,
    ),
}


@dataclass(frozen=True)
class ProbeSpec(SpecKey):
    FAMILY = "intrinsic_probe"
    VERSION = 1
    SIGNATURE = Signature(
        (
            ptr("src", Pointee.U32, "(items * src_words,) u32 words, 16B aligned"),
            ptr("dst", Pointee.U32, "(dst_prefix + items * dst_words,) u32 words, 16B aligned"),
            i32("items", "items to run, 1 <= items; grid from the probe's unit"),
        )
    )

    probe: Probe

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "probe", Probe(self.probe))
        except ValueError:
            raise BadInputError(f"unknown probe {self.probe!r}; known: {[p.value for p in Probe]}") from None

    @property
    def layout(self) -> ProbeLayout:
        return self.probe.layout

    @property
    def dynamic_smem_bytes(self) -> int:
        return self.layout.smem_bytes


def probe_specs() -> list[ProbeSpec]:
    """Every probe kernel (what `probes: true` in a spec builds)."""
    return [ProbeSpec(p) for p in Probe]


def probe_words(probe: Probe, items: int) -> tuple[int, int]:
    """(src words, dst words) a launch of `items` items reads and writes."""
    lay = probe.layout
    return items * lay.src_words, lay.dst_prefix + items * lay.dst_words


def run_probe(bundle: Bundle, probe: Probe | str, src: torch.Tensor, dst: torch.Tensor, items: int) -> None:
    """Launch probe `probe` on `items` items of the int32 word buffers src and dst (current stream).

    src and dst must be 1-D int32, contiguous, 16-byte aligned, on the bundle's
    device, with exactly `probe_words(probe, items)` words; the reduction probes
    also need every item's target (its first src word) to lie in the ATOMIC_SLOTS
    prefix: a slot below ATOMIC_SLOTS, a 16-byte chunk below ATOMIC_SLOTS / 4.
    Launches are asynchronous, as every kernel's.
    """
    spec = ProbeSpec(probe)
    if not isinstance(items, int) or items < 1:
        raise BadInputError(f"items must be a positive int, got {items!r}")
    src_words, dst_words = probe_words(spec.probe, items)
    if max(src_words, dst_words) > MAX_WORDS:
        raise BadInputError(f"{items} items need {max(src_words, dst_words)} words; at most {MAX_WORDS} fit")
    check_tensor(src, "src", dtype=torch.int32, shape=(src_words,), device=bundle.device)
    check_tensor(dst, "dst", dtype=torch.int32, shape=(dst_words,), device=bundle.device)
    check_apart(dst, "dst", src=src)
    lay = spec.layout
    if lay.dst_prefix:
        targets, bound = src[0::lay.src_words], ATOMIC_SLOTS // lay.target_words
        if bool(((targets < 0) | (targets >= bound)).any()):
            raise BadInputError(f"{spec.probe.value}: every target src[0::{lay.src_words}] must be in [0, {bound})")
    kernel = bundle.kernel(spec.key())
    kernel.bind(spec.SIGNATURE)
    if tuple(kernel.block) != (lay.threads, 1, 1):
        raise BundleError(f"{spec.probe.value}: built with block {kernel.block}, this runtime launches "
                          f"{lay.threads} threads; rebuild the bundle")
    grid = items if lay.unit is ProbeUnit.WARP else (items + THREAD_BLOCK - 1) // THREAD_BLOCK
    kernel.launch(grid, current_stream_handle(bundle.device_index), src=src.data_ptr(), dst=dst.data_ptr(), items=items)
