"""Large-M tile of the W4A16 GEMM on sm_90a: warpgroup MMA with register-A dequant.

Same scheduler, route metadata and ABI as `W4A16GemmKernel` (this class only
replaces `_tile`); used for 64- and 128-row route blocks, where the mma.sync
loop is limited by its own issue rate.  The product is computed transposed,

    D[n, token] = sum_k W[n, k] * X[token, k]     (D = out^T for the block)

so the weights are wgmma's A operand, taken from registers, and decode straight
into it: per warp the m64 A fragment is the m16n8k16 A fragment, which is what
the packed layout's words decode to (docs/layouts.md).  The B = 64, 128 or 256
gathered activation rows of the block are wgmma's N, read by the tensor cores
from shared memory.

One warpgroup (128 threads) per CTA for 64- and 128-row blocks, tile = tile_n weight
rows (nw = tile_n / 64 wgmma per 16-k row: 4 for 256, 2 for 128) x B tokens, k-tile 64
(one 128-byte row of bf16 activations); two for 256-row blocks (below).  Example
tile_n = 256:

    shared stage p (from a 1024-aligned base):
      X[p]: B token rows x 128 B, 16-byte chunk c of row r stored at chunk c ^ (r % 8)
            -- the K-major 128B-swizzle layout wgmma's descriptor names
      W[p]: 4 rows of 16 k, 128 int4 each, copied verbatim (lane-major fragment order)
      S[p]: 4 rows of 16 k, 256 scale bytes each (the packed scale permutation)

    per 16-k row kk, thread (warp w, lane l): one 16-byte load of W[p] row kk, int4
    32w + l = the words of its four 16-row blocks jj = 0..3 of column group w; decode
    and scale them into four A fragments; wgmma jj (m64nBk16) then computes
    D rows {64 w' + 16 jj + r : w' = 0..3, r = 0..15} (warp w' supplies 16 of its
    64 rows) for all B tokens, from X[p] advanced by kk * 32 bytes.

With tile_n = 128 two warps share a 64-column group, each taking two of its four
16-row blocks (an 8-byte load).  The nw wgmma of a 16-k row are one commit
group.  After issuing row kk's group a thread waits until at most GROUPS_IN_FLIGHT
groups run (rows kk-1 and kk), decodes row kk+1 from the words it loaded from shared
memory one row earlier, and loads row kk+2's; at the end of a cycle of stages it drains
(see the comment in `_wg_mainloop`).  Stages
are refilled with cp.async as in the mma.sync loop, at row GROUPS_IN_FLIGHT - 1 of a k-tile
(after that row's wait and the next row's decode); shared data written by
cp.async is published to wgmma's async proxy with `fence.proxy.async` before the
barrier that precedes its use, at a k-tile's last row between issuing its group and the wait.

Gated FC1 (`Epilogue.SILU` / `SWIGLUOAI`): the first half of a tile's 64-column slabs is copied
from the gate half of W13 and the second from the up half (`_source_slab`), so the staged output
tile holds gate and up of the same tile_n / 2 columns and the store writes their activation.

128-row blocks carry one main loop per row variant (N = 32, 64, 96, 128 tokens):
a tile runs the narrowest that covers its block's valid rows (ROW_STEPS below), so
an expert's part-filled last block does not pay MMAs for its padding rows.

NVFP4 read as stored (`GemmSpec.layout = "modelopt"`, docs/layouts.md): the activations are the same;
a weight stage holds each tile row's 32 stored bytes and 4 scale bytes instead, and for 16-k row kk
lane (g, q) loads two words of rows g and g + 8 whose byte q is the fragment's (k lo) / (k hi) pair
in the stored k order (`_wg_plan_modelopt`, `_wg_words_modelopt`, `_wg_decode_modelopt`).  Its tiles
are 128 wide (six words per 16-row block).

256-row blocks (the standalone GEMM where experts average 256 routes or more) run two
warpgroups per CTA (256 threads) over the 128-wide tile: both read the same staged
activation tile, warpgroup g decodes and multiplies weight slab g (nw = 1 wgmma
m64n256k16 per 16-k row, 128 accumulator floats per thread).  Warp w of the CTA is
column group w // 4, part w % 4, so the addressing above holds as written; a thread's
one 16-row block takes the odd bytes of its scale word for odd parts.  Each decoded
weight fragment then feeds 256 tokens instead of 128: half the decode per MAC again,
with the same shared-memory traffic per MAC as the 128-row tile.  Row variants step by 64.

128-row blocks on the 256-wide tile (`planning.WGMMA_TALL_WIDE_TILE`) run two warpgroups too:
warpgroup g takes slabs 2g and 2g + 1 (nw = 2 wgmma m64n128k16 per 16-k row, 128 accumulator
floats per thread), warp w of the CTA is column group w // 2, part w % 2, exactly the 128-wide
tile's one-warpgroup addressing laid twice side by side.  A stage then holds 16 KiB of
activations for 256 weight rows (the 128-wide tile: for 128), so the gathered activations are
read from L2 half as often per MAC.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import Float32, Int32, Int64, Uint32

from cuteaot.runtime.kernels.w4a16.gemm_spec import Mainloop
from cuteaot.runtime.kernels.w4a16.geometry import WGMMA_SMEM_ALIGN, WGMMA_TALL_BLOCK, WGMMA_THREADS, WGMMA_WIDE_BLOCK

from ... import intrinsics as I
from . import ablate
from .gemm import W4A16GemmKernel, _Tile

_X_ROW = I.WGMMA_SW128_ROW_BYTES  # bytes per staged activation row (64 bf16)
_K16_BYTES = 32  # descriptor advance per 16 k inside a swizzle row
# A 128-row block's main loop runs the narrowest wgmma N (tokens) in steps of ROW_STEP that covers
# the block's valid rows: an expert's last block is usually part-filled (ncu on the H200, uniform
# routing, Qwen3-30B M = 4096: 1.27x the useful tensor work; gpt-oss-120b: 1.53x), and the padding
# rows would otherwise cost full MMAs.  One copy of the main loop per step.  The branch is not free:
# ptxas then keeps the wgmma descriptors in ordinary registers (one R2UR per wgmma), +1.4 % SASS in
# the 128-row loop and +4 % in the 64-row one, whose padding is at most one 64-row block's: so
# 64-row blocks keep one loop.
# 256-row blocks step by 64 (four loop copies, as the 128-row block's): their CTA copies 32 activation
# rows per pass, and an expert's last block wastes at most 63 rows of N = 256 MMAs.
ROW_STEPS = {WGMMA_TALL_BLOCK: 32, WGMMA_WIDE_BLOCK: 64}
# wgmma groups (16-k rows) left running while the next row's fragments decode: 1 holds two
# fragment sets in registers, 2 three (more time for the decode to hide behind the tensor cores).
GROUPS_IN_FLIGHT = 2
# Route blocks (moe_block_size) whose drained k-tiles (the last of each straight-line cycle) decode the next
# k-tile's first row before their wait_group 0, while its last two groups run, instead of after it with the
# tensor pipe idle.  A/B on the H100 (compare_layer, identical operands, docs/benchmarks.md thirty-seventh
# section), every wgmma kernel changed: 0.986-0.991x the layer at 4096 tokens and 0.990-0.996x at 2048 (128-row
# blocks), 0.997-1.003x at 256-1024 (16- to 64-row blocks), but 1.12-1.18x where 48-row blocks run (Qwen3-30B
# at 512, gpt-oss-120b at 1024); so the blocks where it won, packed layout only (NVFP4 read as stored was not
# measured with it).
EARLY_TILE_START_BLOCKS = frozenset({WGMMA_TALL_BLOCK, WGMMA_WIDE_BLOCK})


class W4A16WgmmaGemmKernel(W4A16GemmKernel):
    def __init__(self, spec, shared_routes: bool = False):
        super().__init__(spec, None, shared_routes)
        # 64-column weight slabs of a tile; warpgroups of the CTA (each takes slabs / wgs of them)
        self.slabs = spec.tile_n // 64
        self.wgs = spec.compute_threads // WGMMA_THREADS
        # wgmma per 16-k row of one warpgroup = packed words each thread decodes per row
        self.nw = self.slabs // self.wgs
        # activation rows staged per copy pass (8 threads of 16 bytes per 128-byte row)
        self.x_rows_per_pass = spec.compute_threads // 8
        # warps sharing one 64-column group (each takes nw of the group's four 16-row blocks)
        self.warps_per_group = 4 // self.nw
        # accumulator floats per thread per wgmma: the block's rows are the instruction's N
        self.acc_n = spec.moe_block_size // 2
        # the main loop's wgmma N by valid rows: the narrowest of these that covers them
        step = ROW_STEPS.get(spec.moe_block_size, spec.moe_block_size)
        self.row_variants = tuple(range(step, spec.moe_block_size + 1, step))
        self.early_tile_start = spec.moe_block_size in EARLY_TILE_START_BLOCKS and not spec.modelopt

    # ------------------------------------------------------------------ addressing

    @cute.jit
    def _wg_plan(self, ops, smem: Int32, tid: Int32, expert: Int32, n_tile: Int32, valid_rows: Int32):
        """This thread's copy and read addresses for stage 0 / k-tile 0 (constants add the rest)."""
        s = self.s
        base = (smem + Int32(s.wg_stage_base + WGMMA_SMEM_ALIGN - 1)) & Int32(-WGMMA_SMEM_ALIGN)
        t = _Tile(base=base, x_base=base, w_base=base + Int32(s.stages * s.wg_x_stage_bytes))
        t.s_base = t.w_base + Int32(s.stages * s.wg_w_stage_bytes)
        # activations: passes of threads / 8 rows, 8 chunks per row
        chunk = tid % Int32(8)
        t.x_src, t.x_ok, t.x_dst = [], [], []
        for i in cutlass.range_constexpr(s.moe_block_size // self.x_rows_per_pass):
            row = tid // Int32(8) + Int32(self.x_rows_per_pass * i)
            src_row = I.ld_shared_i32(smem + Int32(s.sh_rd_route_off * 16) + row * Int32(4))
            t.x_src.append(ops.a + (Int64(src_row) * Int64(s.a_width // 8) + Int64(chunk)) * Int64(16))
            ok = row < valid_rows
            t.x_ok.append(ok)
            t.x_dst.append(t.x_base + row * Int32(_X_ROW) + ((chunk ^ (row & Int32(7))) * Int32(16)))
        t.x_chunk = chunk
        group, part, lane = self._wg_thread(t, tid)
        if cutlass.const_expr(s.modelopt):
            self._wg_plan_modelopt(ops, t, tid, expert, n_tile, lane)
        else:
            self._wg_plan_packed(ops, t, tid, expert, n_tile, group, part, lane)
        t.desc = I.wgmma_desc_sw128(t.x_base)
        return t

    @cute.jit
    def _wg_thread(self, t, tid: Int32):
        """This thread's (column group, part, lane); sets t.n0, the warp's first output column."""
        # reads: warp w decodes 16-row blocks jj = part * nw + j (j < nw) of column group `group`
        lane = tid & Int32(31)
        group = self._column_group(tid)
        part = (tid // Int32(32)) % Int32(self.warps_per_group)
        # this warp's first output column: D row 16 w + g of wgmma jj is column n0 + 16 jj + g
        t.n0 = Int32(64) * group + Int32(16 * self.nw) * part
        return group, part, lane

    @cute.jit
    def _wg_plan_packed(self, ops, t, tid: Int32, expert: Int32, n_tile: Int32, group: Int32, part: Int32,
                        lane: Int32):
        """Packed layout: copy and read addresses of the weights and scales (docs/layouts.md)."""
        s = self.s
        # weights: a 16-k row of the tile is tile_n / 2 int4; 128 threads copy 128 / (tile_n / 2)
        # rows per pass
        # (a 64-column slab of a 16-k row: 32 weight int4, 4 scale int4; _source_slab says which)
        per_row = s.tile_n // 2
        w_col = tid % Int32(per_row)
        t.w_src = ops.qweight + (Int64(s.n * s.k // 32) * Int64(expert)
                                 + Int64(tid // Int32(per_row)) * Int64(s.n // 2)
                                 + Int64(self._slab_column(n_tile, w_col, 32))
                                 ) * Int64(16)
        t.w_dst = t.w_base + tid * Int32(16)
        # scales: tile_n / 16 int4 per 16-k row, one per thread of the first s_sh_stage threads
        t.s_ok = tid < Int32(s.s_sh_stage)
        s_col = tid % Int32(s.s_sh_stride)
        if cutlass.const_expr(s.n_tail):  # this thread's weight / scale column inside N (a last tile past N)
            t.w_in_n = n_tile * Int32(per_row) + w_col < Int32(s.n // 2)
            t.s_in_n = n_tile * Int32(s.s_sh_stride) + s_col < Int32(s.n // 16)
        t.s_src = ops.scales + (Int64(s.n * s.k // 256) * Int64(expert)
                                + Int64(tid // Int32(s.s_sh_stride)) * Int64(s.n // 16)
                                + Int64(self._slab_column(n_tile, s_col, 4))
                                ) * Int64(16)
        t.s_dst = t.s_base + tid * Int32(16)
        self._wg_reads_packed(t, group, part, lane)

    @cute.jit
    def _wg_reads_packed(self, t, group: Int32, part: Int32, lane: Int32):
        """Packed: this thread's shared-memory reads of a stage's weight and scale words."""
        # words part * nw.. of lane l's int4 (32 group + l), and the matching scale bytes (one scale
        # word holds two blocks' pairs: with nw = 1 an odd part takes the word's odd bytes, shifted down)
        t.w_rd = t.w_base + (Int32(32) * group + lane) * Int32(16) + part * Int32(4 * self.nw)
        if cutlass.const_expr(self.nw == 1):
            t.s_rd = t.s_base + (Int32(8) * group + lane // Int32(4)) * Int32(8) + (part // Int32(2)) * Int32(4)
            t.s_shift = (part % Int32(2)) * Int32(8)
        else:
            t.s_rd = t.s_base + (Int32(8) * group + lane // Int32(4)) * Int32(8) + part * Int32(4)

    @cute.jit
    def _wg_plan_modelopt(self, ops, t, tid: Int32, expert: Int32, n_tile: Int32, lane: Int32):
        """modelopt: a stage holds each of the tile's rows (one per output column, the stored rows that
        `_stored_row` names) as 32 stored bytes (two 16-byte chunks, chunk c at c ^ bit 2 of the row, so
        that the 8 rows g of a warp's loads fall on distinct banks) and its 4 scale bytes.

        Lane (g, q) reads, for 16-k row kk, 8 bytes of rows n0 + 16 j + g and + 8: bytes 8 (kk % 2) ..
        of chunk kk // 2, i.e. k = 16 kk .. 16 kk + 15.  Byte q of the first word holds k 16 kk + 2q, +1
        and byte q of the second k 16 kk + 8 + 2q, +1: the A fragment's (k lo) and (k hi) pairs, in the
        stored k order, so the activations stay as wgmma reads them (docs/layouts.md)."""
        s = self.s
        expert_row = Int64(expert) * Int64(s.n)
        t.w_src, t.w_dst, t.w_in_n = [], [], []
        for i in cutlass.range_constexpr(s.tile_n * 2 // s.threads):
            q = tid + Int32(i * s.threads)
            r = q // Int32(2)
            c = q % Int32(2)
            row = self._stored_row(n_tile, r)
            if cutlass.const_expr(s.n_tail):  # a last tile past N (not gated, not rotated): rows there read as zeros
                t.w_in_n.append(row < Int32(s.n))
            t.w_src.append(ops.qweight + (expert_row + Int64(row)) * Int64(s.k // 2) + Int64(c * Int32(16)))
            t.w_dst.append(t.w_base + (r * Int32(2) + (c ^ ((r >> Int32(2)) & Int32(1)))) * Int32(16))
        t.s_src, t.s_dst, t.s_in_n = [], [], []
        for i in cutlass.range_constexpr(max(s.tile_n // s.threads, 1)):
            r = tid + Int32(i * s.threads)
            row = self._stored_row(n_tile, r)
            if cutlass.const_expr(s.n_tail):
                t.s_in_n.append(row < Int32(s.n))
            t.s_src.append(ops.scales + (expert_row + Int64(row)) * Int64(s.k // 16))
            t.s_dst.append(t.s_base + r * Int32(4))
        t.s_ok = tid < Int32(s.tile_n)
        g = lane // Int32(4)
        row = t.n0 + g
        flip = (g >> Int32(2)) & Int32(1)
        t.w_rd = [t.w_base + row * Int32(32) + (Int32(c) ^ flip) * Int32(16) for c in range(2)]
        t.s_rd = t.s_base + row * Int32(4)
        t.byte_sel = I.e2m1_byte_selector(lane % Int32(4))

    @cute.jit
    def _column_group(self, tid: Int32) -> Int32:
        """The 64-column slab of the tile whose rows this thread's warp decodes."""
        return (tid // Int32(32)) // Int32(self.warps_per_group)

    # ------------------------------------------------------------------ staging

    @cute.jit
    def _wg_stage(self, ops, t, pipe: cutlass.Constexpr[int], k_tile: Int32, rows: cutlass.Constexpr[int]):
        """Copy k-tile `k_tile` into stage `pipe`: the first `rows` activation rows, weights, scales."""
        s = self.s
        if cutlass.const_expr("copy" in self.ablate):
            cute.arch.cp_async_commit_group()
            return
        k64 = Int64(k_tile)
        for i in cutlass.range_constexpr(rows // self.x_rows_per_pass):
            load = t.x_ok[i]
            if cutlass.const_expr(s.k_in is not None):  # zero-padded K: columns past k_in read as zeros
                load = load and k_tile * Int32(8) + t.x_chunk < Int32(s.k_in // 8)
            I.cp_async_16_zfill(t.x_dst[i] + Int32(pipe * s.wg_x_stage_bytes),
                                t.x_src[i] + k64 * Int64(_X_ROW), load.to(Int32))
        if cutlass.const_expr(s.modelopt):  # 32 stored bytes and 4 scale bytes of each tile row
            for i in cutlass.range_constexpr(len(t.w_src)):
                self._copy_inside(t.w_dst[i] + Int32(pipe * s.wg_w_stage_bytes), t.w_src[i] + k64 * Int64(s.tile_k // 2),
                                  t.w_in_n[i] if s.n_tail else None)
            for i in cutlass.range_constexpr(len(t.s_src)):
                if cutlass.const_expr(s.tile_n >= s.threads):
                    self._copy_inside(t.s_dst[i] + Int32(pipe * s.wg_s_stage_bytes), t.s_src[i] + k64 * Int64(s.tile_k // 16),
                                      t.s_in_n[i] if s.n_tail else None, nbytes=4)
                elif t.s_ok:
                    self._copy_inside(t.s_dst[i] + Int32(pipe * s.wg_s_stage_bytes), t.s_src[i] + k64 * Int64(s.tile_k // 16),
                                      t.s_in_n[i] if s.n_tail else None, nbytes=4)
        else:
            rows_per_pass = s.threads // (s.tile_n // 2)
            for i in cutlass.range_constexpr(s.k_blocks // rows_per_pass):  # columns past N: zeros, nothing read
                self._copy_inside(t.w_dst + Int32(pipe * s.wg_w_stage_bytes + i * s.threads * 16),
                                  t.w_src + (k64 * Int64(s.k_blocks) + Int64(i * rows_per_pass)) * Int64(s.n // 2 * 16),
                                  t.w_in_n if s.n_tail else None)
            if t.s_ok:
                self._copy_inside(t.s_dst + Int32(pipe * s.wg_s_stage_bytes),
                                  t.s_src + k64 * Int64(s.k_blocks * (s.n // 16) * 16), t.s_in_n if s.n_tail else None)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _wg_publish(self, pending: cutlass.Constexpr[int]):
        """Wait for all but `pending` copy groups and hand the landed stages to the tensor cores."""
        if cutlass.const_expr("sync" in self.ablate):
            return
        cute.arch.cp_async_wait_group(pending)
        if cutlass.const_expr("fence" not in self.ablate):
            I.fence_proxy_async_shared()
        cute.arch.sync_threads()

    # ------------------------------------------------------------------ fragments

    @cute.jit
    def _wg_words(self, words: cute.Tensor, t, pipe: cutlass.Constexpr[int], kk: cutlass.Constexpr[int]):
        """Load this thread's weight and scale words of 16-k row `kk` of stage `pipe`."""
        if cutlass.const_expr("decode" in self.ablate):
            return
        if cutlass.const_expr(self.s.modelopt):
            self._wg_words_modelopt(words, t, pipe, kk)
        else:
            self._wg_words_packed(words, t, pipe, kk)

    @cute.jit
    def _wg_words_packed(self, words: cute.Tensor, t, pipe: cutlass.Constexpr[int], kk: cutlass.Constexpr[int]):
        """Packed: the thread's nw packed weight words and raw scale words."""
        s = self.s
        w_at = t.w_rd + Int32(pipe * s.wg_w_stage_bytes + kk * s.tile_n * 8)
        s_at = t.s_rd + Int32(pipe * s.wg_s_stage_bytes + kk * s.tile_n)
        if cutlass.const_expr(self.nw == 4):
            q = I.ld_shared_v4_u32(w_at)
            p = I.ld_shared_v2_u32(s_at)  # raw scale words: blocks 0, 1 in p[0], blocks 2, 3 in p[1]
        elif cutlass.const_expr(self.nw == 2):
            q = I.ld_shared_v2_u32(w_at)
            p = (I.ld_shared_u32(s_at),)
        else:
            q = (I.ld_shared_u32(w_at),)
            p = (I.ld_shared_u32(s_at) >> t.s_shift.to(Uint32),)
        for j in cutlass.range_constexpr(self.nw):
            words[j] = q[j]
        for j in cutlass.range_constexpr(len(p)):
            words[self.nw + j] = p[j]

    @cute.jit
    def _wg_words_modelopt(self, words: cute.Tensor, t, pipe: cutlass.Constexpr[int], kk: cutlass.Constexpr[int]):
        """modelopt: per block j, the two words of rows g and g + 8 that hold 16-k row kk (see
        `_wg_plan_modelopt`), and the rows' scale words (one e4m3 byte per 16-k row)."""
        s = self.s
        w_at = t.w_rd[kk // 2] + Int32(pipe * s.wg_w_stage_bytes + 8 * (kk % 2))
        s_at = t.s_rd + Int32(pipe * s.wg_s_stage_bytes)
        for j in cutlass.range_constexpr(self.nw):
            lo = I.ld_shared_v2_u32(w_at + Int32(16 * j * 32))
            hi = I.ld_shared_v2_u32(w_at + Int32((16 * j + 8) * 32))
            words[6 * j + 0] = lo[0]
            words[6 * j + 1] = lo[1]
            words[6 * j + 2] = hi[0]
            words[6 * j + 3] = hi[1]
            words[6 * j + 4] = I.ld_shared_u32(s_at + Int32(16 * j * 4))
            words[6 * j + 5] = I.ld_shared_u32(s_at + Int32((16 * j + 8) * 4))

    @cute.jit
    def _wg_decode_modelopt(self, frag: cute.Tensor, words: cute.Tensor, t, kk: cutlass.Constexpr[int]):
        """modelopt: byte q of each word -> the (k lo) / (k hi) pairs of rows g and g + 8, times the
        rows' e4m3 scale of 16-k row kk."""
        for j in cutlass.range_constexpr(self.nw):
            s_g, s_g8 = self._scale_pairs_e4m3(words[6 * j + 4], words[6 * j + 5], I.e4m3_pairs_selector(kk % 4))
            frag[j, 0] = self._pair_mul(self._dequant_byte(words[6 * j + 0], t.byte_sel), s_g)
            frag[j, 1] = self._pair_mul(self._dequant_byte(words[6 * j + 2], t.byte_sel), s_g8)
            frag[j, 2] = self._pair_mul(self._dequant_byte(words[6 * j + 1], t.byte_sel), s_g)
            frag[j, 3] = self._pair_mul(self._dequant_byte(words[6 * j + 3], t.byte_sel), s_g8)

    @cute.jit
    def _wg_decode(self, frag: cute.Tensor, words: cute.Tensor, t, kk: cutlass.Constexpr[int]):
        """Decode and scale the loaded words of 16-k row kk into this thread's nw A fragments."""
        if cutlass.const_expr("decode" in self.ablate):
            for j in cutlass.range_constexpr(self.nw):
                for i in cutlass.range_constexpr(4):
                    frag[j, i] = Uint32(ablate.CONSTANT_FRAGMENT)
        elif cutlass.const_expr(self.s.modelopt):
            self._wg_decode_modelopt(frag, words, t, kk)
        else:
            self._wg_decode_packed(frag, words)

    @cute.jit
    def _wg_decode_packed(self, frag: cute.Tensor, words: cute.Tensor):
        """Packed: each word's 8 codes are a 16-row block's A fragment (docs/layouts.md)."""
        for j in cutlass.range_constexpr(self.nw):
            c0_b0, c0_b1, c1_b0, c1_b1 = self._dequant_weights(words[j])
            scales = self._scale_halves(words[self.nw + j // 2], j % 2)  # (rows g, g + 8)
            # m16n8k16 A order: (row g, k lo), (row g + 8, k lo), (row g, k hi), (row g + 8, k hi)
            frag[j, 0] = self._half_mul(c0_b0, scales, 0)
            frag[j, 1] = self._half_mul(c1_b0, scales, 1)
            frag[j, 2] = self._half_mul(c0_b1, scales, 0)
            frag[j, 3] = self._half_mul(c1_b1, scales, 1)

    @cute.jit
    def _wg_tile_start(self, frag: cute.Tensor, words: cute.Tensor, t, pipe: cutlass.Constexpr[int]):
        """At a k-tile's start (its stage just published): row 0's fragments, and row 1's words loaded
        ahead (rows 1.. decode from words loaded one row earlier: the shared-load latency hides
        behind the running MMAs)."""
        self._wg_words(words, t, pipe, 0)
        self._wg_decode(frag, words, t, 0)
        self._wg_words(words, t, pipe, 1)

    @cute.jit
    def _wg_mma(self, acc: cute.Tensor, frag: cute.Tensor, t, pipe: cutlass.Constexpr[int],
                kk: cutlass.Constexpr[int], rows: cutlass.Constexpr[int]):
        """Issue the nw wgmma (N = rows) of 16-k row `kk` as one commit group."""
        s = self.s
        regs = I.pin_u32([frag[jj, i] for jj in range(self.nw) for i in range(4)])
        desc = t.desc + Int64((pipe * s.wg_x_stage_bytes + kk * _K16_BYTES) >> 4)
        I.wgmma_fence()
        for jj in cutlass.range_constexpr(self.nw):
            d = [acc[jj, i] for i in range(rows // 2)]
            a = regs[4 * jj: 4 * jj + 4]
            if cutlass.const_expr(self.is_fp16):
                d = I.wgmma_f16_m64k16_rs(d, a[0], a[1], a[2], a[3], desc)
            else:
                d = I.wgmma_bf16_m64k16_rs(d, a[0], a[1], a[2], a[3], desc)
            for i in cutlass.range_constexpr(rows // 2):
                acc[jj, i] = d[i]
        I.wgmma_commit_group()

    # ------------------------------------------------------------------ the loop

    @cute.jit
    def _wg_k_tile(self, ops, t, acc: cute.Tensor, frag: cute.Tensor, words: cute.Tensor, pipe: cutlass.Constexpr[int],
                   tile_idx: Int32,
                   k_tiles: Int32, k_start: Int32, drain: cutlass.Constexpr[bool], rows: cutlass.Constexpr[int]):
        """The 16-k rows of k-tile `tile_idx` (in stage `pipe`); with `drain`, no group is left running."""
        s = self.s
        assert GROUPS_IN_FLIGHT < s.k_blocks
        for kk in cutlass.range_constexpr(s.k_blocks):
            self._wg_mma(acc, frag, t, pipe, kk, rows)
            last = kk + 1 == s.k_blocks
            if cutlass.const_expr(last):
                # the next stage's copies, proxy fence and barrier while this row's MMAs run, not after
                # the wait: 0.965-0.994x the layer at 2048-16384 tokens (H100, docs/benchmarks.md)
                self._wg_publish(s.stages - 2)
                if cutlass.const_expr(drain and self.early_tile_start):
                    # the next k-tile's row 0 decodes while this k-tile's last groups run, as every other
                    # row's does, instead of after the drain.  Unconditional, so no branch joins while groups
                    # run: past the last k-tile it reads a stage nothing refilled, and nothing uses the result.
                    self._wg_tile_start(frag, words, t, (pipe + 1) % s.stages)
            # row kk - GROUPS_IN_FLIGHT's group is done: its A registers are free for the next decode
            I.wgmma_wait_group(0 if last and drain else GROUPS_IN_FLIGHT)
            if cutlass.const_expr(not last):
                self._wg_decode(frag, words, t, kk + 1)  # row kk + 1, loaded a row ago
                if cutlass.const_expr(kk + 2 < s.k_blocks):
                    self._wg_words(words, t, pipe, kk + 2)
                # GROUPS_IN_FLIGHT rows into this k-tile the previous one's last row is done, so its stage may
                # be refilled: after the next row's decode, which then follows the wait directly (with the
                # copies first the layer took 1.02-1.03x the time at 2048-4096 tokens, H100, docs/benchmarks.md)
                if cutlass.const_expr(kk == GROUPS_IN_FLIGHT - 1):
                    fetch = tile_idx + Int32(s.stages - 1)
                    if fetch < k_tiles:
                        self._wg_stage(ops, t, (pipe + s.stages - 1) % s.stages, k_start + fetch, rows)
                    else:
                        cute.arch.cp_async_commit_group()
            elif cutlass.const_expr(not drain):
                self._wg_tile_start(frag, words, t, (pipe + 1) % s.stages)
            elif cutlass.const_expr(not self.early_tile_start):  # (otherwise decoded before the wait, above)
                if tile_idx + Int32(1) < k_tiles:
                    self._wg_tile_start(frag, words, t, (pipe + 1) % s.stages)

    @cute.jit
    def _wg_mainloop(self, ops, t, acc: cute.Tensor, k_start: Int32, k_tiles: Int32, rows: cutlass.Constexpr[int]):
        """Whole cycles of `stages` k-tiles run straight through; the remainder one k-tile at a time.

        A group may only be in flight across straight-line code.  Where control flow joins
        (the back-edge of a cycle, the per-tile branches of the remainder), the loop-carried
        fragments may move to other registers and the old ones be reused by the next decode
        while a running wgmma still reads them: the H200 showed sporadic inf rows.  So each
        cycle and each remainder tile ends drained (wait_group 0); with packed 128- and 256-row blocks the
        next k-tile's first row decodes just before that wait, while the last groups run (EARLY_TILE_START_BLOCKS).
        """
        s = self.s
        for pipe in cutlass.range_constexpr(s.stages - 1):
            if Int32(pipe) < k_tiles:
                self._wg_stage(ops, t, pipe, k_start + Int32(pipe), rows)
            else:
                cute.arch.cp_async_commit_group()
        self._wg_publish(s.stages - 2)
        frag = cute.make_rmem_tensor((self.nw, 4), Uint32)
        # a row's weight + scale words
        words = cute.make_rmem_tensor((6 * self.nw if self.s.modelopt else self.nw + max(self.nw // 2, 1),), Uint32)
        self._wg_tile_start(frag, words, t, 0)
        tile_idx = Int32(0)
        while tile_idx + Int32(s.stages) <= k_tiles:
            for pipe in cutlass.range_constexpr(s.stages):
                self._wg_k_tile(ops, t, acc, frag, words, pipe, tile_idx + Int32(pipe), k_tiles, k_start,
                                pipe == s.stages - 1, rows)
            tile_idx += Int32(s.stages)
        for pipe in cutlass.range_constexpr(s.stages - 1):
            if tile_idx < k_tiles:
                self._wg_k_tile(ops, t, acc, frag, words, pipe, tile_idx, k_tiles, k_start, True, rows)
                tile_idx += Int32(1)
        self._wg_pin_acc(acc, rows)

    @cute.jit
    def _wg_pin_acc(self, acc: cute.Tensor, rows: cutlass.Constexpr[int]):
        """After the last wait: route the accumulators through `pin_f32`, so no later use of them can move
        above the wait."""
        pinned = I.pin_f32([acc[jj, i] for jj in range(self.nw) for i in range(rows // 2)])
        for jj in cutlass.range_constexpr(self.nw):
            for i in cutlass.range_constexpr(rows // 2):
                acc[jj, i] = pinned[jj * (rows // 2) + i]

    @cute.jit
    def _wg_rows_mainloop(self, ops, smem: Int32, tid: Int32, expert: Int32, n_tile: Int32, valid_rows: Int32,
                          acc: cute.Tensor, k_start: Int32, k_tiles: Int32, rows: cutlass.Constexpr[int]):
        """One row variant: its own addressing (planned inside the branch, so that ptxas keeps the
        hoisted addresses in registers instead of rematerializing them in the loop) and main loop."""
        t = self._wg_plan(ops, smem, tid, expert, n_tile, valid_rows)
        self._wg_mainloop(ops, t, acc, k_start, k_tiles, rows)

    @cute.jit
    def _wg_mainloop_for_rows(self, ops, smem: Int32, tid: Int32, expert: Int32, n_tile: Int32, valid_rows: Int32,
                              acc: cute.Tensor, k_start: Int32, k_tiles: Int32):
        """The main loop whose wgmma N is the narrowest row variant covering `valid_rows`.

        Accumulators past that N stay zero; the store never writes rows past `valid_rows`.
        """
        self._for_row_variant(valid_rows, self._wg_rows_mainloop,
                              (ops, smem, tid, expert, n_tile, valid_rows, acc, k_start, k_tiles))

    @cute.jit
    def _for_row_variant(self, valid_rows: Int32, run, args):
        """run(*args, rows) for `rows` the narrowest row variant that covers `valid_rows`."""
        v = self.row_variants
        if cutlass.const_expr(len(v) == 1):
            run(*args, v[0])
        elif cutlass.const_expr(len(v) == 2):
            if valid_rows <= Int32(v[0]):
                run(*args, v[0])
            else:
                run(*args, v[1])
        else:
            assert len(v) == 4, v
            if valid_rows <= Int32(v[1]):
                if valid_rows <= Int32(v[0]):
                    run(*args, v[0])
                else:
                    run(*args, v[1])
            else:
                if valid_rows <= Int32(v[2]):
                    run(*args, v[2])
                else:
                    run(*args, v[3])

    # ------------------------------------------------------------------ split-K and store

    @cute.jit
    def _wg_merge_split_k(self, ops, acc: cute.Tensor, tid: Int32, lock_slot: Int32, slice_idx: Int32,
                          slice_count: Int32):
        """As the mma.sync merge, with each thread's 128 floats in its own slots of the partial."""
        s = self.s
        lock = self._wait_slice_turn(ops, tid, lock_slot, slice_idx)
        tile_int4 = s.moe_block_size * s.tile_n // 4
        for jj in cutlass.range_constexpr(self.nw):
            for v in cutlass.range_constexpr(self.acc_n // 4):
                slot = jj * (self.acc_n // 4) + v
                addr = (ops.c_tmp + Int64(lock_slot * Int32(tile_int4) + Int32(slot * s.compute_threads) + tid)
                        * Int64(16))
                c = [acc[jj, 4 * v + e] for e in range(4)]
                if slice_idx != Int32(0):
                    r = I.ld_global_v4_f32(addr)
                    c = [c[e] + r[e] for e in range(4)]
                if slice_idx != slice_count - Int32(1):
                    I.st_global_v4_f32(addr, c[0], c[1], c[2], c[3])
                for e in cutlass.range_constexpr(4):
                    acc[jj, 4 * v + e] = c[e]
        self._pass_slice_turn(lock, tid, slice_idx, slice_count)

    @cute.jit
    def _wg_store(self, ops, acc: cute.Tensor, smem: Int32, t, tid: Int32, n_tile: Int32, valid_rows: Int32,
                  global_scale, bias_row: Int64):
        """acc * global_scale -> dtype, staged as [token][n] in shared memory -> 16-byte row stores."""
        s = self.s
        row_bytes = Int32(s.wg_out_row_bytes)
        self._sync()  # the stages are reused
        lane = tid & Int32(31)
        # D[n, token] fragments -> staged[token][n] with stmatrix .trans: matrix m of a store is
        # token block i + m // 2, column half m % 2 (rows g or g + 8 of the wgmma's 16); lane l
        # addresses stored row l % 8 (a token) of matrix l // 8.
        m = lane // Int32(8)
        at0 = t.base + (Int32(8) * (m // Int32(2)) + lane % Int32(8)) * row_bytes + (t.n0 + Int32(8) * (m % Int32(2))) * Int32(2)
        for jj in cutlass.range_constexpr(self.nw):
            for i in cutlass.range_constexpr(0, self.acc_n // 4, 2):
                q = [self._pack_pair(acc[jj, 4 * i + 2 * h] * global_scale, acc[jj, 4 * i + 2 * h + 1] * global_scale)
                     for h in range(4)]
                I.stmatrix_x4_trans(at0 + Int32(8 * i) * row_bytes + Int32(16 * jj * 2), q[0], q[1], q[2], q[3])
        self._sync()

        # 16-byte output chunks per row: the tile's, or with a gated epilogue one per gate / up pair
        chunks = s.tile_n // 16 if cutlass.const_expr(s.epilogue.is_gated) else s.tile_n // 8
        col = tid % Int32(chunks)
        for it in cutlass.range_constexpr(s.moe_block_size * chunks // s.compute_threads):
            row = tid // Int32(chunks) + Int32(it * s.compute_threads // chunks)
            staged = t.base + row * row_bytes + col * Int32(16)
            if cutlass.const_expr(s.epilogue.is_gated):
                self._store_gated_chunk(ops, smem, row, Int32(chunks) * n_tile + col, valid_rows, staged,
                                        staged + Int32(chunks * 16), bias_row)
            else:
                self._store_chunk(ops, smem, row, Int32(chunks) * n_tile + col, valid_rows, staged, bias_row)
        self._sync()

    # ------------------------------------------------------------------ one tile

    @cute.jit
    def _tile(self, ops, smem: Int32, tid: Int32, tokens: Int32, route_block: Int32, expert: Int32, route: Int32,
              n_tile: Int32, k_start: Int32, k_count: Int32, slice_count: Int32, slice_idx: Int32, lock_slot: Int32,
              record=None):
        self._trace(ops, tid, record, 0)
        scale_index = Int64(expert)
        if cutlass.const_expr(self.s.split_global_scale):  # (E, 2): [gate, up], by this warp's slab's half
            scale_index = self._split_scale_index(expert, self._source_slab(n_tile, self._column_group(tid)))
        global_scale = I.ld_global_nc_f32(ops.global_scale + scale_index * Int64(4))
        valid_rows = self._read_block(ops, smem, tid, route_block, route, tokens)
        self._trace(ops, tid, record, 1)
        acc = cute.make_rmem_tensor((self.nw, self.acc_n), Float32)
        acc.fill(0.0)
        self._wg_mainloop_for_rows(ops, smem, tid, expert, n_tile, valid_rows, acc, k_start, k_count)
        self._trace(ops, tid, record, 2)
        t = self._wg_plan(ops, smem, tid, expert, n_tile, valid_rows)
        if slice_count > Int32(1):
            self._wg_merge_split_k(ops, acc, tid, lock_slot, slice_idx, slice_count)
        if cutlass.const_expr("epilogue" in self.ablate):
            self._keep_alive(ops, tid, [acc[jj, i] for jj in range(self.nw) for i in range(self.acc_n)])
        elif slice_idx == slice_count - Int32(1):
            self._wg_store(ops, acc, smem, t, tid, n_tile, valid_rows, global_scale, self._bias_row(ops, expert))
        self._trace(ops, tid, record, 3)


def gemm_kernel(spec, timeline_slot: int | None = None, shared_routes: bool = False) -> W4A16GemmKernel:
    """The device code of a GEMM spec: the mma.sync loop, or the warpgroup-MMA loop (sm_90a), with or
    without a producer warpgroup.  `timeline_slot`: the mma.sync loop's first timeline probe (fused.TIMELINE;
    decode plans, the only ones probed, run that loop).  `shared_routes`: the kernel reads the route packing
    from shared memory (FusedSpec.pack_experts; not the producer warpgroup's loop, which no fused kernel runs)."""
    if spec.mainloop is Mainloop.WGMMA:
        assert timeline_slot is None, "timeline probes are in the mma.sync loop only"
        if spec.producer_warp:
            assert not shared_routes, "the producer warpgroup reads the routes from global memory"
            from .wgmma_ws import W4A16WgmmaWsGemmKernel  # it subclasses this module's kernel

            return W4A16WgmmaWsGemmKernel(spec)
        return W4A16WgmmaGemmKernel(spec, shared_routes)
    return W4A16GemmKernel(spec, timeline_slot, shared_routes)
