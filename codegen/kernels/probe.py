"""CuTeDSL probe kernels: each applies one inline-PTX intrinsic to words of a global buffer.

Test-only (family `intrinsic_probe`, see runtime/kernels/probe.py for every probe's
word layout).  The kernels are deliberately naive -- plain scalar loads and stores
around the one helper under test -- so that a wrong result can only come from
that helper (or, for the MMA / ldmatrix probes, from the fragment layout their
docstrings state, which the probe follows literally).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import Float32, Int32, Int64, Uint32

from cuteaot.runtime.kernels.probe import (
    ATOMIC_SLOTS,
    MAX_WORDS,
    MMA_A_WORDS,
    MMA_BT_WORDS,
    THREAD_BLOCK,
    Probe,
    ProbeSpec,
    ProbeUnit,
)

from .. import intrinsics as I
from .common import fake_arguments

TILE_ROW_BYTES = 32  # one row of a 16x16 b16 tile in shared memory
POISON = 0xDEADBEEF  # shared slots before the cp.async probe writes them


class _Words:
    """Flat u32 / i32 / f32 views of one global word buffer, and its address."""

    def __init__(self, ptr: cute.Pointer):
        flat = cute.make_layout(MAX_WORDS)
        self.u32 = cute.make_tensor(ptr, flat)
        self.i32 = cute.make_tensor(cute.recast_ptr(ptr, dtype=Int32), flat)
        self.f32 = cute.make_tensor(cute.recast_ptr(ptr, dtype=Float32), flat)
        self.address = I.gmem_address(ptr)


class ProbeKernel:
    """Compile-time facts in __init__; __call__ launches; `kernel` is device code."""

    def __init__(self, spec: ProbeSpec):
        self.probe = spec.probe
        self.layout = spec.layout
        self.body = getattr(self, f"_{spec.probe.value}")

    @cute.jit
    def __call__(self, src: cute.Pointer, dst: cute.Pointer, items: Int32, stream):
        self.kernel(src, dst, items).launch(
            grid=(1, 1, 1), block=[self.layout.threads, 1, 1], smem=self.layout.smem_bytes, stream=stream
        )

    @cute.kernel
    def kernel(self, src: cute.Pointer, dst: cute.Pointer, items: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        s, d = _Words(src), _Words(dst)
        if cutlass.const_expr(self.layout.unit is ProbeUnit.WARP):
            smem = I.shared_ptr_to_u32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=16))
            self.body(s, d, Int32(bidx), Int32(tidx), smem)
        elif cutlass.const_expr(self.probe is Probe.CP_ASYNC):
            smem = I.shared_ptr_to_u32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=16))
            self._cp_async(s, d, Int32(bidx), Int32(tidx), items, smem)
        else:
            i = Int32(bidx) * THREAD_BLOCK + Int32(tidx)
            if i < items:
                self.body(s, d, i)

    # ------------------------------------------------------------------ decodes: 1 word -> 2 pairs

    def _pairs(self, s, d, i, decode):
        p, q = decode(s.u32[i])
        d.u32[2 * i] = p
        d.u32[2 * i + 1] = q

    def _quads(self, s, d, i, decode):
        out = decode(s.u32[i])
        for j in range(4):
            d.u32[4 * i + j] = out[j]

    def _e2m1_bf16(self, s, d, i):
        self._quads(s, d, i, I.dequant_e2m1x8_bf16)

    def _e2m1_f16(self, s, d, i):
        self._quads(s, d, i, I.dequant_e2m1x8_f16)

    def _s0e5m3_bf16(self, s, d, i):
        # the main loops' path: one word of two scales, each broadcast by the multiply (times 1.0, exact)
        for byte in range(4):
            halves = I.scale_halves_s0e5m3_bf16(s.u32[i], byte % 2)
            d.u32[4 * i + byte] = I.bf16x2_mul_half(Uint32(0x3F803F80), halves, byte // 2)

    def _s0e5m3_f16(self, s, d, i):
        for byte in range(4):
            halves = I.scale_halves_s0e5m3_f16(s.u32[i], byte % 2)
            d.u32[4 * i + byte] = I.f16x2_mul_half(Uint32(0x3C003C00), halves, byte // 2)

    def _e8m0_bf16(self, s, d, i):
        self._pairs(s, d, i, I.dequant_e8m0x4_bf16)

    def _e8m0_f16(self, s, d, i):
        self._pairs(s, d, i, I.dequant_e8m0x4_f16)

    def _nf3_bf16(self, s, d, i):
        words = [s.u32[3 * i + x] for x in range(3)]
        words.append(I.nf3_gather(*words))
        for jj, y in enumerate(words):
            out = I.dequant_nf3_word_bf16(y)
            for j in range(4):
                d.u32[16 * i + 4 * jj + j] = out[j]

    def _e2m1_codes_bf16(self, s, d, i):
        self._quads(s, d, i, I.dequant_e2m1_codes_bf16)

    def _e2m1_codes_f16(self, s, d, i):
        self._quads(s, d, i, I.dequant_e2m1_codes_f16)

    def _e4m3_pairs(self, s, d, i, helper):
        x = s.u32[i]
        y = (x >> Uint32(16)) | (x << Uint32(16))  # the second word: x's halves swapped
        for byte in range(4):
            p, q = helper(x, y, I.e4m3_pairs_selector(Int32(byte)))
            d.u32[8 * i + 2 * byte] = p
            d.u32[8 * i + 2 * byte + 1] = q

    def _e4m3_pair_bf16(self, s, d, i):
        self._e4m3_pairs(s, d, i, I.scale_pairs_e4m3_bf16)

    def _e4m3_pair_f16(self, s, d, i):
        self._e4m3_pairs(s, d, i, I.scale_pairs_e4m3_f16)

    # ------------------------------------------------------------------ pair arithmetic

    def _mul_bf16x2(self, s, d, i):
        d.u32[i] = I.bf16x2_mul(s.u32[2 * i], s.u32[2 * i + 1])

    def _mul_f16x2(self, s, d, i):
        d.u32[i] = I.f16x2_mul(s.u32[2 * i], s.u32[2 * i + 1])

    def _pack_f32(self, s, d, i):
        x0, x1 = s.f32[2 * i], s.f32[2 * i + 1]
        d.u32[4 * i] = I.pack_f32x2_bf16x2(x0, x1)
        d.u32[4 * i + 1] = I.pack_f32x2_f16x2(x0, x1)
        d.u32[4 * i + 2] = I.f32_to_bf16x2_broadcast(x0)
        d.u32[4 * i + 3] = I.f32_to_f16x2_broadcast(x0)

    def _unpack_pairs(self, s, d, i):
        x = s.u32[i]
        b0, b1 = I.bf16x2_to_f32x2(x)
        h0, h1 = I.f16x2_to_f32x2(x)
        d.f32[6 * i] = b0
        d.f32[6 * i + 1] = b1
        d.f32[6 * i + 2] = h0
        d.f32[6 * i + 3] = h1
        d.u32[6 * i + 4] = I.pair_broadcast_lane(x, 0)
        d.u32[6 * i + 5] = I.pair_broadcast_lane(x, 1)

    # ------------------------------------------------------------------ global reductions

    def _target(self, s, d, i) -> tuple[Int64, int]:
        """Reduction item i: the dst address its first src word names (a slot of `target_words` words, the
        layout's), and the index of its first value word."""
        lay = self.layout
        base = lay.src_words * i
        return d.address + Int64(s.i32[base]) * (4 * lay.target_words), base + 1

    def _red_chunk(self, s, d, i, red):
        addr, v = self._target(s, d, i)  # four value words into the 16-byte chunk
        red(addr, s.u32[v], s.u32[v + 1], s.u32[v + 2], s.u32[v + 3])

    def _red_add_v4_bf16x2(self, s, d, i):
        self._red_chunk(s, d, i, I.red_add_v4_bf16x2)

    def _red_add_v4_f16x2(self, s, d, i):
        self._red_chunk(s, d, i, I.red_add_v4_f16x2)

    def _red_max_f32(self, s, d, i):
        addr, v = self._target(s, d, i)
        I.red_max_f32_nonnegative(addr, s.f32[v])

    def _atom_add_i32(self, s, d, i):
        addr, v = self._target(s, d, i)
        d.i32[ATOMIC_SLOTS + i] = I.atom_add_i32(addr, s.i32[v])

    # ------------------------------------------------------------------ tensor cores (one warp, one item)
    #
    # A (16x16, row-major b16) word (r, c/2) is r*8 + c//2; B^T (8x16, row-major) word (n, k/2)
    # is n*8 + k//2; C and D (16x8 f32, row-major) element (r, c) is r*8 + c.  With g = lane // 4,
    # t = lane % 4 the fragments are exactly those of `mma_bf16_m16n8k16`'s docstring.

    def _mma(self, s, d, item, lane, mma):
        lay = self.layout
        a, bt = item * lay.src_words, item * lay.src_words + MMA_A_WORDS
        c, out = bt + MMA_BT_WORDS, item * lay.dst_words
        g, t = lane // 4, lane % 4
        a0, a1 = s.u32[a + g * 8 + t], s.u32[a + (g + 8) * 8 + t]
        a2, a3 = s.u32[a + g * 8 + t + 4], s.u32[a + (g + 8) * 8 + t + 4]
        b0, b1 = s.u32[bt + g * 8 + t], s.u32[bt + g * 8 + t + 4]
        top, bottom = g * 8 + 2 * t, (g + 8) * 8 + 2 * t  # D[g, 2t], D[g + 8, 2t]
        d0, d1, d2, d3 = mma(s.f32[c + top], s.f32[c + top + 1], s.f32[c + bottom], s.f32[c + bottom + 1],
                             a0, a1, a2, a3, b0, b1)
        d.f32[out + top] = d0
        d.f32[out + top + 1] = d1
        d.f32[out + bottom] = d2
        d.f32[out + bottom + 1] = d3

    def _mma_bf16(self, s, d, item, lane, smem):
        self._mma(s, d, item, lane, I.mma_bf16_m16n8k16)

    def _mma_f16(self, s, d, item, lane, smem):
        self._mma(s, d, item, lane, I.mma_f16_m16n8k16)

    # ------------------------------------------------------------------ ldmatrix (one warp, one 16x16 tile)

    def _stage_tile(self, s, item, lane, smem):
        """Each lane copies 4 words (half a tile row) into shared memory."""
        base = item * self.layout.src_words + 4 * lane
        I.st_shared_v4_u32(smem + lane * 16, s.u32[base], s.u32[base + 1], s.u32[base + 2], s.u32[base + 3])
        cute.arch.sync_threads()

    def _ldmatrix_x4(self, s, d, item, lane, smem):
        self._stage_tile(s, item, lane, smem)
        m, r = lane // 8, lane % 8  # lane supplies row r of matrix m
        row, col = (m % 2) * 8 + r, (m // 2) * 8
        regs = I.ldmatrix_x4(smem + row * TILE_ROW_BYTES + col * 2)
        for j in range(4):
            d.u32[item * self.layout.dst_words + 4 * lane + j] = regs[j]

    def _ldmatrix_x2(self, s, d, item, lane, smem):
        self._stage_tile(s, item, lane, smem)
        m, r = (lane // 8) % 2, lane % 8  # lanes 16-31 repeat 0-15 (their addresses are unused)
        regs = I.ldmatrix_x2(smem + r * TILE_ROW_BYTES + m * 16)
        for j in range(2):
            d.u32[item * self.layout.dst_words + 2 * lane + j] = regs[j]

    # ------------------------------------------------------------------ cp.async (one 16-byte slot per thread)

    @cute.jit
    def _cp_async(self, s, d, bidx: Int32, tidx: Int32, items: Int32, smem: Int32):
        i = bidx * THREAD_BLOCK + tidx
        slot = smem + tidx * 16
        flags, src_address, out = s.i32, s.address, d.u32  # tensors, not _Words, cross the `if`s
        poison = Uint32(POISON)
        I.st_shared_v4_u32(slot, poison, poison, poison, poison)
        cute.arch.sync_threads()
        if i < items:
            # Not named `pred`: CuTeDSL 4.8.1 names the condition of a dynamic `if` `pred` in the
            # function it generates, so a variable `pred` read inside the branches silently
            # becomes that condition (an i1).
            copy_flag = flags[8 * i + 4]
            data = src_address + Int64(i) * 32
            if copy_flag == -1:
                I.cp_async_16(slot, data)
            else:
                I.cp_async_16_zfill(slot, data, copy_flag)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        if i < items:
            w = I.ld_shared_v4_u32(slot)
            for j in cutlass.range_constexpr(4):
                out[4 * i + j] = w[j]


def build(spec: ProbeSpec):
    return ProbeKernel(spec), fake_arguments(spec)
