"""Main loop of the W4A16 GEMM: cp.async staging, fragment loads, dequant, MMA.

Per k-tile (tile_k deep) a stage holds, in shared memory:
  A: the CTA's 16*m_blocks gathered activation rows (row = route's source row),
     tile_k wide, 16-byte chunks XOR-swizzled by row (`_a_swizzle`) so the
     ldmatrix reads are bank-conflict free;
  B: tile_k/16 rows of packed weights, tile_n/2 int4 per row, copied verbatim
     (the packed layout is already in fragment order);
  S: tile_k/16 rows of tile_n scale bytes.
Four stages are in flight; a thread consumes `b_sh_wr_iters` 16-k rows of a
stage ("kk"), loading the next row's registers while the current one runs on
the tensor cores (register double buffering).

Warps are arranged n_warps along N (64 columns each) by threads/32/n_warps
along K; the K-direction partials are folded in the epilogue.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import Int32, Int64, Uint32

from cuteaot.runtime.nf3 import LANES as NF3_LANES
from cuteaot.runtime.nf3 import NF3_BLOCK_K

from ... import intrinsics as I
from . import ablate

# The stored (modelopt) layout's weight and scale copies read a few bytes of each K-contiguous row a stage (the
# mma.sync loop's 128-deep tiles 64 and 8, the wgmma loop's 64-deep stages 32 and 4); `.L2::<n>B` has L2 fetch
# this many bytes of the row around each copy, by main loop (0: no qualifier).  ptxas gives the mma.sync loop's
# copies 128 bytes on its own (SASS `LDGSTS...LTC128B`), the wgmma loop's none.  A/B on the H200 (compare_layer
# --weights modelopt, docs/benchmarks.md "twelfth session"): on the wgmma loop 256 bytes took 0.92-0.99x the
# layer's time of none at M = 256-1024 (128 bytes 0.93-0.99x); on the mma.sync loop 256 took 1.02-1.08x that of
# 128.
MODELOPT_L2_PREFETCH = {"mma_sync": 128, "wgmma": 256}


class MainloopMixin:
    # ------------------------------------------------------------------ element helpers

    @cute.jit
    def _dequant_weights(self, x: Uint32):
        if cutlass.const_expr(self.nf3):
            return I.dequant_nf3_word_bf16(x)
        if cutlass.const_expr(self.is_fp16):
            return I.dequant_e2m1x8_f16(x)
        return I.dequant_e2m1x8_bf16(x)

    @cute.jit
    def _scale_halves(self, p: Uint32, byte: cutlass.Constexpr[int]) -> Uint32:
        """(s_byte, s_byte+2) of the raw scale word p, byte 0 or 1: the scales of one weight word's two
        column blocks (docs/layouts.md, "scales")."""
        if cutlass.const_expr(self.is_fp16):
            return I.scale_halves_s0e5m3_f16(p, byte)
        return I.scale_halves_s0e5m3_bf16(p, byte)

    @cute.jit
    def _dequant_codes(self, x: Uint32):
        """modelopt: four bytes of a stored weight row -> pairs (code j, code j + 4) (docs/layouts.md)."""
        if cutlass.const_expr(self.is_fp16):
            return I.dequant_e2m1_codes_f16(x)
        return I.dequant_e2m1_codes_bf16(x)

    @cute.jit
    def _dequant_byte(self, x: Uint32, selector: Int32) -> Uint32:
        """modelopt, wgmma loop: the byte `selector` picks of a stored word -> (low code, high code)."""
        if cutlass.const_expr(self.is_fp16):
            return I.dequant_e2m1_byte_f16(x, selector)
        return I.dequant_e2m1_byte_bf16(x, selector)

    @cute.jit
    def _scale_pairs_e4m3(self, p: Uint32, q: Uint32, selector: Int32):
        """modelopt: (sp, sp), (sq, sq) of the stored e4m3 scale bytes `selector` picks in the scale
        words p and q (one conversion for both)."""
        if cutlass.const_expr(self.is_fp16):
            return I.scale_pairs_e4m3_f16(p, q, selector)
        return I.scale_pairs_e4m3_bf16(p, q, selector)

    @cute.jit
    def _pair_mul(self, a: Uint32, b: Uint32) -> Uint32:
        if cutlass.const_expr(self.is_fp16):
            return I.f16x2_mul(a, b)
        return I.bf16x2_mul(a, b)

    @cute.jit
    def _half_mul(self, a: Uint32, s: Uint32, half: cutlass.Constexpr[int]) -> Uint32:
        """a times (s.lo, s.lo) (half 0) or (s.hi, s.hi) (half 1)."""
        if cutlass.const_expr(self.is_fp16):
            return I.f16x2_mul_half(a, s, half)
        return I.bf16x2_mul_half(a, s, half)

    @cute.jit
    def _mma(self, d0, d1, d2, d3, a0, a1, a2, a3, b0, b1):
        if cutlass.const_expr(self.is_fp16):
            return I.mma_f16_m16n8k16(d0, d1, d2, d3, a0, a1, a2, a3, b0, b1)
        return I.mma_bf16_m16n8k16(d0, d1, d2, d3, a0, a1, a2, a3, b0, b1)

    # ------------------------------------------------------------------ addressing

    @cute.jit
    def _a_swizzle(self, i: Int32) -> Int32:
        """int4 index within an A stage -> swizzled index (16-byte chunk XOR row % 8).

        modelopt: XOR (row % 8) ^ 4 (row % 2) instead.  Its lanes read whole 16-byte chunks (rows g and
        g + 8, chunk 4 * warp_row + t), so the two rows of one quarter-warp must land in opposite halves
        of the bank rows; the plain swizzle puts them on the same banks."""
        row = i // Int32(self.s.a_sh_stride)
        flip = row & Int32(7)
        if cutlass.const_expr(self.s.modelopt):
            flip = flip ^ ((row & Int32(1)) << Int32(2))
        return Int32(self.s.a_sh_stride) * row + ((i - row * Int32(self.s.a_sh_stride)) ^ flip)

    @cute.jit
    def _modelopt_b_swizzle(self, n: Int32) -> Int32:
        """modelopt B stage: chunk c of weight row n is stored at c ^ this, so that the 8 rows one ldmatrix
        matrix reads (same chunk, rows 8j .. 8j + 7) fall on distinct banks."""
        c = self.s.modelopt_chunks
        return (n // Int32(8 // c)) % Int32(c)

    @cute.jit
    def _sh(self, smem: Int32, int4_off: Int32) -> Int32:
        return smem + int4_off * Int32(16)

    # ------------------------------------------------------------------ staging

    @cute.jit
    def _plan_staging(self, ops, t, smem: Int32, tid: Int32, valid_rows: Int32):
        """Per-thread copy addresses for k-tile 0 / stage 0, computed once per tile.

        A stage's copies then only add `k_tile * stride` to the global address and a constant
        to the shared one, so the unrolled main loop carries no address arithmetic beyond that.
        """
        s = self.s
        t.a_src, t.a_ok, t.a_dst, t.a_in_stage = [], [], [], []
        for i in cutlass.range_constexpr(s.a_sh_wr_iters):
            row = Int32(s.a_rows_per_iter * i) + t.a_gl_rd_row
            src_row = Int32(0)
            if row < Int32(s.moe_block_size):
                src_row = I.ld_shared_i32(smem + Int32(s.sh_rd_route_off * 16) + row * Int32(4))
            t.a_src.append(ops.a + (Int64(src_row) * Int64(s.a_width // 8) + Int64(t.a_gl_rd_col0)) * Int64(16))
            t.a_ok.append(row < valid_rows)
            t.a_in_stage.append(row < Int32(16 * s.m_blocks))
            t.a_dst.append(smem + (Int32(s.sh_a_off) + self._a_swizzle(Int32(i * s.a_sh_wr_delta) + t.a_sh_wr)) * Int32(16))
        if cutlass.const_expr(s.modelopt):
            self._plan_modelopt_staging(ops, t, smem, tid)
        elif cutlass.const_expr(s.nf3):
            # a stage is tile_k/32 rows of nf3_tile_row_int4 chunks, copied verbatim: chunk c = tid + i * threads
            t.b_src, t.b_dst, t.b_ok = [], [], []
            for i in cutlass.range_constexpr(s.b_copies):
                c = tid + Int32(i * s.threads)
                row = c // Int32(s.nf3_tile_row_int4)
                col = c - row * Int32(s.nf3_tile_row_int4)
                if cutlass.const_expr(s.epilogue.is_gated):  # the int4 column in its source slab
                    col = self._slab_column(t.n_tile, col, s.nf3_tile_row_int4 // (s.tile_n // 64))
                t.b_src.append(ops.qweight + (t.b_gl_rd + Int64(row) * Int64(s.nf3_row_int4) + Int64(col)) * Int64(16))
                t.b_dst.append(smem + (Int32(s.sh_b_off) + c) * Int32(16))
                t.b_ok.append(c < Int32(s.b_sh_stage))
        else:
            t.b_src = ops.qweight + t.b_gl_rd * Int64(16)
            t.b_dst = smem + (Int32(s.sh_b_off) + tid) * Int32(16)
            if cutlass.const_expr(s.k_tail):  # the 16-k row of a stage this thread's first copy fills
                t.b_k_row = tid // Int32(s.b_sh_stride)
            if cutlass.const_expr(s.n_tail):  # this thread's int4 column (the same in every copy) inside N
                t.b_in_n = t.n_tile * Int32(s.b_sh_stride) + tid % Int32(s.b_sh_stride) < Int32(s.n // 2)
        if cutlass.const_expr(not s.modelopt):
            t.s_ok = tid < Int32(s.s_sh_stage)
            if cutlass.const_expr(s.k_tail):  # the scale row of a stage this thread copies
                t.s_k_row = tid // Int32(s.s_sh_stride)
            n_group = Int32(s.s_sh_stride) * t.n_tile + tid % Int32(s.s_sh_stride)
            if cutlass.const_expr(s.epilogue.is_gated):  # 4 scale int4 per 64-column slab
                n_group = self._slab_column(t.n_tile, tid % Int32(s.s_sh_stride), 4)
            if cutlass.const_expr(s.n_tail):
                t.s_in_n = n_group < Int32(s.n // 16)
            t.s_src = ops.scales + (t.scales_base + Int64(tid // Int32(s.s_sh_stride)) * Int64(s.n // 16)
                                    + Int64(n_group)) * Int64(16)
            t.s_dst = smem + (Int32(s.sh_s_off) + tid) * Int32(16)

    @cute.jit
    def _plan_modelopt_staging(self, ops, t, smem: Int32, tid: Int32):
        """modelopt: a stage holds the tile_k / 2 stored bytes of each of the tile's tile_n weight rows
        (row = output column; C = tile_k / 32 chunks of 16 bytes, row-major, chunks swizzled), copy
        ci = (row, chunk) so that a warp reads whole rows; and each row's tile_k / 16 scale bytes, one
        small copy per row."""
        s = self.s
        c_count = s.modelopt_chunks
        row_bytes = Int64(s.k // 2)
        expert_rows = Int64(t.expert) * Int64(s.n) + Int64(t.src_n0)
        expert_row0 = Int64(t.expert) * Int64(s.n)
        t.b_src, t.b_dst, t.b_in_n = [], [], []
        for i in cutlass.range_constexpr(s.b_copies):
            ci = tid + Int32(i * s.threads)
            n = ci // Int32(c_count)
            c = ci - n * Int32(c_count)
            if cutlass.const_expr(s.n_tail):  # a last tile past N (not gated, not rotated): rows there read as zeros
                t.b_in_n.append(t.src_n0 + n < Int32(s.n))
            if cutlass.const_expr(s.epilogue.is_gated):  # rows of the gate and up slabs (`_stored_row`)
                t.b_src.append(ops.qweight + (expert_row0 + Int64(self._stored_row(t.n_tile, n))) * row_bytes
                               + Int64(c * Int32(16)))
            else:
                t.b_src.append(ops.qweight + (expert_rows + Int64(n)) * row_bytes + Int64(c * Int32(16)))
            t.b_dst.append(smem + (Int32(s.sh_b_off) + n * Int32(c_count) + (c ^ self._modelopt_b_swizzle(n)))
                           * Int32(16))
        t.s_ok = tid < Int32(s.tile_n)
        if cutlass.const_expr(s.n_tail):
            t.s_in_n = t.src_n0 + tid < Int32(s.n)
        if cutlass.const_expr(s.epilogue.is_gated):
            t.s_src = ops.scales + (expert_row0 + Int64(self._stored_row(t.n_tile, tid))) * Int64(s.k // 16)
        else:
            t.s_src = ops.scales + (expert_rows + Int64(tid)) * Int64(s.k // 16)
        t.s_dst = smem + Int32(s.sh_s_off * 16) + tid * Int32(s.tile_k // 16)

    @cute.jit
    def _copy_inside(self, dst: Int32, src: Int64, in_n=None, row=None, rows: cutlass.Constexpr[int] = 0,
                     nbytes: cutlass.Constexpr[int] = 16):
        """A weight-side copy of `nbytes` (16: `cp.async.cg`; 4 or 8, the stored layout's scale bytes:
        `cp.async.ca`).  In a tile that runs past N or K it is zero-filled (nothing read) unless its column
        is inside N (`in_n`, None: always) and its row is one of the first `rows` (`row`, None: always);
        with neither it is a plain copy.  The stored layout's copies have L2 fetch MODELOPT_L2_PREFETCH bytes
        of their row around them, by main loop."""
        pf = MODELOPT_L2_PREFETCH[self.s.mainloop.value] * int(self.s.modelopt)
        if cutlass.const_expr(in_n is None and row is None):
            if cutlass.const_expr(nbytes == 16):
                I.cp_async_16(dst, src, l2_prefetch=pf)
            else:
                I.cp_async_ca(dst, src, nbytes, l2_prefetch=pf)
        else:
            inside = Int32(1)
            if cutlass.const_expr(in_n is not None):
                inside = in_n.to(Int32)
            if cutlass.const_expr(row is not None):
                inside = inside & (row < Int32(rows)).to(Int32)
            if cutlass.const_expr(nbytes == 16):
                I.cp_async_16_zfill(dst, src, inside, l2_prefetch=pf)
            else:
                I.cp_async_ca_zfill(dst, src, nbytes, inside, l2_prefetch=pf)

    @cute.jit
    def _stage_k_tile(self, ops, t, pipe: cutlass.Constexpr[int], k_tile: Int32):
        """Issue the cp.async copies of k-tile `k_tile` into stage `pipe` and commit them."""
        s = self.s
        if cutlass.const_expr("copy" in self.ablate):
            cute.arch.cp_async_commit_group()
            return
        k64 = Int64(k_tile)
        for i in cutlass.range_constexpr(s.a_sh_wr_iters):
            load = t.a_ok[i]
            if cutlass.const_expr(s.k_in is not None or s.k_tail):  # columns past the logical K read as zeros
                load = load and k_tile * Int32(s.a_sh_stride) + t.a_gl_rd_col0 < Int32(s.a_width // 8)
            src = t.a_src[i] + k64 * Int64(s.a_sh_stride * 16)
            dst = t.a_dst[i] + Int32(pipe * s.a_sh_stage * 16)
            if cutlass.const_expr(s.a_rows_per_iter * (i + 1) > 16 * s.m_blocks):
                # tile_n = 256 with 1 or 3 MMA rows: this pass covers rows past the stage; issue
                # nothing for them (a zero-fill would overwrite the next stage or run off the end)
                if t.a_in_stage[i]:
                    I.cp_async_16_zfill(dst, src, load.to(Int32))
            else:
                I.cp_async_16_zfill(dst, src, load.to(Int32))
        if cutlass.const_expr(s.modelopt):
            for i in cutlass.range_constexpr(s.b_copies):
                self._copy_inside(t.b_dst[i] + Int32(pipe * s.b_sh_stage * 16), t.b_src[i] + k64 * Int64(s.tile_k // 2),
                                  t.b_in_n[i] if s.n_tail else None)
        elif cutlass.const_expr(s.nf3):
            for i in cutlass.range_constexpr(s.b_copies):
                src = t.b_src[i] + k64 * Int64(s.tile_k // NF3_BLOCK_K * s.nf3_row_int4 * 16)
                if cutlass.const_expr((i + 1) * s.threads <= s.b_sh_stage):
                    I.cp_async_16(t.b_dst[i] + Int32(pipe * s.b_sh_stage * 16), src)
                elif t.b_ok[i]:
                    I.cp_async_16(t.b_dst[i] + Int32(pipe * s.b_sh_stage * 16), src)
        else:
            b_row = s.threads // s.b_sh_stride  # 16-k rows one pass of the CTA covers
            for i in cutlass.range_constexpr(s.b_sh_wr_iters):  # past K (the last k-tile) or N: zeros, nothing read
                self._copy_inside(t.b_dst + Int32((pipe * s.b_sh_stage + i * s.threads) * 16),
                                  t.b_src + k64 * Int64(s.k_blocks * (s.n // 2) * 16)
                                  + Int64(i * b_row * (s.n // 2) * 16),
                                  t.b_in_n if s.n_tail else None,
                                  k_tile * Int32(s.k_blocks) + Int32(i * b_row) + t.b_k_row if s.k_tail else None,
                                  s.k // 16)
        scale_rows = s.tile_k // self.scale_group  # scale rows a k-tile holds
        if cutlass.const_expr(s.modelopt):
            if t.s_ok:  # this thread's row's tile_k / 16 scale bytes
                self._copy_inside(t.s_dst + Int32(pipe * s.s_sh_stage * 16), t.s_src + k64 * Int64(s.tile_k // 16),
                                  t.s_in_n if s.n_tail else None, nbytes=s.tile_k // 16)
        elif t.s_ok:  # and their scales (zero bytes: finite, times zero codes)
            self._copy_inside(t.s_dst + Int32(pipe * s.s_sh_stage * 16),
                              t.s_src + k64 * Int64(scale_rows * (s.n // 16) * 16), t.s_in_n if s.n_tail else None,
                              k_tile * Int32(scale_rows) + t.s_k_row if s.k_tail else None, s.k // self.scale_group)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _prefetch_initial(self, ops, t, k_tiles: Int32, k_start: Int32):
        for pipe in cutlass.range_constexpr(self.s.stages - 1):
            if Int32(pipe) < k_tiles:
                self._stage_k_tile(ops, t, pipe, k_start + Int32(pipe))
            else:
                cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.defers_router_weight()):  # its load was issued with the block's routes
            if t.router_weight_mine:
                I.st_shared_u32(t.router_weight_sh, self._weight_pair(t.router_weight))
        self._publish()

    @cute.jit
    def _publish(self):
        """Wait for all but the newest stages' copies and make the landed stage visible to every warp."""
        if cutlass.const_expr("sync" not in self.ablate):
            cute.arch.cp_async_wait_group(self.s.stages - 2)
            cute.arch.sync_threads()

    @cute.jit
    def _prefetch_lookahead(self, ops, t, pipe: cutlass.Constexpr[int], tile_idx: Int32, k_tiles: Int32,
                            k_start: Int32):
        fetch = tile_idx + Int32(self.s.stages - 1)
        if fetch < k_tiles:
            self._stage_k_tile(ops, t, (pipe + self.s.stages - 1) % self.s.stages, k_start + fetch)
        else:
            cute.arch.cp_async_commit_group()
        self._publish()

    # ------------------------------------------------------------------ register fragments

    @cute.jit
    def _load_a_regs(self, regs: cute.Tensor, t, pipe: cutlass.Constexpr[int], kk: cutlass.Constexpr[int]):
        """ldmatrix the activation fragments of 16-k row `kk` of stage `pipe`.

        t.a_rd[kk] is this lane's swizzled shared address for MMA row block 0, computed once
        per tile; stage and row block only add constants (the swizzle XOR repeats every 8 rows).
        """
        s = self.s
        if cutlass.const_expr(s.modelopt):  # both k-steps of the warp's 32-k slice, whole 16-byte chunks
            base = t.a_mo + Int32((s.sh_a_off + pipe * s.a_sh_stage) * 16)
            if cutlass.const_expr(self.m8):
                u = self._modelopt_activation_pairs(base)
                for j in cutlass.range_constexpr(4):
                    regs[j] = u[j]
            else:
                for mb in cutlass.range_constexpr(s.m_blocks):
                    u = self._modelopt_activation_pairs(base + Int32(mb * 16 * s.a_sh_stride * 16))
                    v = self._modelopt_activation_pairs(base + Int32((mb * 16 + 8) * s.a_sh_stride * 16))
                    for j in cutlass.range_constexpr(4):
                        regs[mb, j] = u[j]
                        regs[mb, 4 + j] = v[j]
        elif cutlass.const_expr(self.m8):
            r0, r1 = I.ldmatrix_x2(t.a_rd[kk] + Int32((s.sh_a_off + pipe * s.a_sh_stage) * 16))
            regs[0] = r0
            regs[1] = r1
        else:
            for mb in cutlass.range_constexpr(s.m_blocks):
                r0, r1, r2, r3 = I.ldmatrix_x4(
                    t.a_rd[kk] + Int32((s.sh_a_off + pipe * s.a_sh_stage + mb * s.a_sh_stride * 16) * 16)
                )
                regs[mb, 0] = r0
                regs[mb, 1] = r1
                regs[mb, 2] = r2
                regs[mb, 3] = r3

    @cute.jit
    def _modelopt_activation_pairs(self, addr: Int32):
        """modelopt: one row's 16-byte chunk k = 8t .. 8t+7 as the pairs (k, k + 4), k = 8t .. 8t+3:
        the pairing of the stored codes' decode (code j with code j + 4), so each product meets
        its own activation."""
        return self._chunk_pairs(I.ld_shared_v4_u32(addr))

    @staticmethod
    def _chunk_pairs(u) -> list:
        """The four words of a 16-byte activation chunk (k .. k + 7, two a word) as pairs (k + j, k + j + 4),
        j = 0..3: how the stored layout's decode pairs its codes (the micro kernel's FC2 slice pairs alike)."""
        return [I.pair_halves(u[j // 2], u[2 + j // 2], j % 2) for j in range(4)]

    @cute.jit
    def _load_bs_regs(self, regs: cute.Tensor, t, pipe: cutlass.Constexpr[int], kk: cutlass.Constexpr[int]):
        """Four weight words (one per jj) and the two raw scale words of 16-k row `kk` of stage `pipe`.

        t.b_rd / t.s_rd are this thread's shared addresses in stage 0, row 0 (computed once per
        tile); stage and row add constants, so the loads take immediate offsets.  The scales stay
        raw (4 bytes a word) until `_scaled_weight_fragment` expands the pair it needs, which keeps
        two registers per set instead of four decoded pairs.
        """
        s = self.s
        if cutlass.const_expr("decode" in self.ablate):
            return
        if cutlass.const_expr(s.modelopt):
            # "row" kk is column half kk of the warp's 64 columns (blocks 4kk .. 4kk + 3): their stored words
            # (ldmatrix: codes 8t .. 8t + 7 of the warp's 32-k slice of column 8b + g) and scale words
            q = I.ldmatrix_x4(t.b_rd + Int32(pipe * s.b_sh_stage * 16 + kk * 32 * s.modelopt_chunks * 16))
            for j in cutlass.range_constexpr(4):
                regs[j] = q[j]
                regs[4 + j] = I.ld_shared_u32(t.s_rd + Int32(pipe * s.s_sh_stage * 16 + (4 * kk + j) * 8 * (s.tile_k // 16)))
        elif cutlass.const_expr(s.nf3):  # x0, x1, x2 of row kk (regs[3] unused); both rows share a scale row
            x0, x1 = I.ld_shared_v2_u32(t.b_rd + Int32(pipe * s.b_sh_stage * 16 + kk * 8 * NF3_LANES))
            regs[0] = x0
            regs[1] = x1
            regs[2] = I.ld_shared_u32(t.b_rd2 + Int32(pipe * s.b_sh_stage * 16 + kk * 4 * NF3_LANES))
            if cutlass.const_expr(kk == 0):  # row 1 reuses row 0's decoded scale pairs
                p0, p1 = I.ld_shared_v2_u32(t.s_rd + Int32(pipe * s.s_sh_stage * 16))
                regs[4] = p0
                regs[5] = p1
        else:
            q0, q1, q2, q3 = I.ld_shared_v4_u32(
                t.b_rd + Int32((s.sh_b_off + pipe * s.b_sh_stage + s.b_sh_stride * kk) * 16)
            )
            p0, p1 = I.ld_shared_v2_u32(t.s_rd + Int32(pipe * s.s_sh_stage * 16 + kk * 2 * s.s_sh_stride * 8))
            regs[0] = q0
            regs[1] = q1
            regs[2] = q2
            regs[3] = q3
            regs[4] = p0
            regs[5] = p1

    @cute.jit
    def _load_next(self, bs_next, a_next, t, pipe: cutlass.Constexpr[int], kk: cutlass.Constexpr[int],
                   tile_idx: Int32, k_tiles: Int32):
        """Registers for the 16-k row after (pipe, kk): the next row, or row 0 of the next stage."""
        if cutlass.const_expr(kk + 1 < self.s.b_sh_wr_iters):
            if tile_idx < k_tiles:
                self._load_bs_regs(bs_next, t, pipe, kk + 1)
                self._load_a_regs(a_next, t, pipe, kk + 1)
        else:
            if tile_idx + Int32(1) < k_tiles:
                self._load_bs_regs(bs_next, t, (pipe + 1) % self.s.stages, 0)
                self._load_a_regs(a_next, t, (pipe + 1) % self.s.stages, 0)

    @cute.jit
    def _scaled_weight_fragment(self, frag: cute.Tensor, q: Uint32, scales: Uint32):
        """One packed word -> b0/b1 fragments of two 8-column blocks, times their scales (the low /
        high half of `scales`, from `_scale_halves`).

        frag[0, *] is column block c0, frag[1, *] block c1 = c0 + 8.  frag[x, 0] holds
        k = 2t, 2t+1 and frag[x, 1] k = 2t+8, 2t+9 (docs/layouts.md).
        """
        c0_b0, c0_b1, c1_b0, c1_b1 = self._dequant_weights(q)
        frag[0, 0] = self._half_mul(c0_b0, scales, 0)
        frag[0, 1] = self._half_mul(c0_b1, scales, 0)
        frag[1, 0] = self._half_mul(c1_b0, scales, 1)
        frag[1, 1] = self._half_mul(c1_b1, scales, 1)

    @cute.jit
    def _mma_row(self, t, acc: cute.Tensor, a_regs: cute.Tensor, bs: cute.Tensor, frag: cute.Tensor,
                 pairs: cute.Tensor, kk: cutlass.Constexpr[int]):
        """The MMAs of 16-k row kk: word jj's weights scaled by bytes jj % 2 (column block c0) and
        jj % 2 + 2 (c1) of raw scale word jj // 2 (SCALE_BYTE_ORDER).  NF3: the two rows of a 32-k
        row share one scale row, so row 0 decodes its four scale-half words into `pairs` and row 1
        reuses them; the fourth decode word is gathered from the other three."""
        if cutlass.const_expr(self.s.modelopt):
            self._mma_row_modelopt(t, acc, a_regs, bs, frag, kk)
            return
        words = [bs[0], bs[1], bs[2], bs[3]]
        if cutlass.const_expr(self.nf3 and "decode" not in self.ablate):
            words[3] = I.nf3_gather(bs[0], bs[1], bs[2])
        for jj in cutlass.range_constexpr(4):
            if cutlass.const_expr("decode" in self.ablate):
                for i in cutlass.range_constexpr(4):
                    frag[i // 2, i % 2] = Uint32(ablate.CONSTANT_FRAGMENT)
            else:
                if cutlass.const_expr(self.nf3 and kk == 1):
                    scales = pairs[jj]
                else:
                    scales = self._scale_halves(bs[4 + jj // 2], jj % 2)
                    if cutlass.const_expr(self.nf3):
                        pairs[jj] = scales
                self._scaled_weight_fragment(frag, words[jj], scales)
            if cutlass.const_expr(self.m8):
                # Weights as the 16-row A operand (16 output columns), activations as B (8 tokens).
                d0, d1, d2, d3 = self._mma(acc[jj, 0], acc[jj, 1], acc[jj, 2], acc[jj, 3],
                                           frag[0, 0], frag[1, 0], frag[0, 1], frag[1, 1], a_regs[0], a_regs[1])
                acc[jj, 0] = d0
                acc[jj, 1] = d1
                acc[jj, 2] = d2
                acc[jj, 3] = d3
            else:
                for mb in cutlass.range_constexpr(self.s.m_blocks):
                    for half in cutlass.range_constexpr(2):
                        d0, d1, d2, d3 = self._mma(
                            acc[mb, jj, half, 0], acc[mb, jj, half, 1], acc[mb, jj, half, 2], acc[mb, jj, half, 3],
                            a_regs[mb, 0], a_regs[mb, 1], a_regs[mb, 2], a_regs[mb, 3],
                            frag[half, 0], frag[half, 1],
                        )
                        acc[mb, jj, half, 0] = d0
                        acc[mb, jj, half, 1] = d1
                        acc[mb, jj, half, 2] = d2
                        acc[mb, jj, half, 3] = d3

    @cute.jit
    def _mma_row_modelopt(self, t, acc: cute.Tensor, a_regs: cute.Tensor, bs: cute.Tensor, frag: cute.Tensor,
                          kk: cutlass.Constexpr[int]):
        """modelopt: the MMAs of column half kk over the warp's whole 32-k slice.

        A lane's stored word holds k = 8t .. 8t + 7 of the slice, not the fragment's 2t, 2t + 1,
        2t + 8, 2t + 9: its decode pairs code j with code j + 4 (k = 8t + j, 8t + j + 4), k-step ks
        takes pairs 2ks, 2ks + 1, and the activations are paired the same way
        (`_modelopt_activation_pairs`), so every product still meets its own activation.  One scale
        per word (its 8 k lie in one 16-k group)."""
        s = self.s
        for jl in cutlass.range_constexpr(2):
            jj = 2 * kk + jl  # columns 16 jj + g (block c0) and + 8 (c1)
            scales = self._scale_pairs_e4m3(bs[4 + 2 * jl], bs[4 + 2 * jl + 1], t.s_sel)  # columns c0, c1
            pairs = []
            for half in cutlass.range_constexpr(2):
                pairs.append([self._pair_mul(r, scales[half]) for r in self._dequant_codes(bs[2 * jl + half])])
            for ks in cutlass.range_constexpr(2):
                for half in cutlass.range_constexpr(2):
                    frag[half, 0] = pairs[half][2 * ks]
                    frag[half, 1] = pairs[half][2 * ks + 1]
                if cutlass.const_expr(self.m8):
                    d0, d1, d2, d3 = self._mma(acc[jj, 0], acc[jj, 1], acc[jj, 2], acc[jj, 3],
                                               frag[0, 0], frag[1, 0], frag[0, 1], frag[1, 1],
                                               a_regs[2 * ks], a_regs[2 * ks + 1])
                    acc[jj, 0] = d0
                    acc[jj, 1] = d1
                    acc[jj, 2] = d2
                    acc[jj, 3] = d3
                else:
                    for mb in cutlass.range_constexpr(s.m_blocks):
                        for half in cutlass.range_constexpr(2):
                            d0, d1, d2, d3 = self._mma(
                                acc[mb, jj, half, 0], acc[mb, jj, half, 1], acc[mb, jj, half, 2], acc[mb, jj, half, 3],
                                a_regs[mb, 2 * ks], a_regs[mb, 4 + 2 * ks], a_regs[mb, 2 * ks + 1],
                                a_regs[mb, 4 + 2 * ks + 1], frag[half, 0], frag[half, 1],
                            )
                            acc[mb, jj, half, 0] = d0
                            acc[mb, jj, half, 1] = d1
                            acc[mb, jj, half, 2] = d2
                            acc[mb, jj, half, 3] = d3

    # ------------------------------------------------------------------ the loop

    @cute.jit
    def _mainloop(self, ops, t, smem: Int32, tid: Int32, acc: cute.Tensor, k_start: Int32, k_tiles: Int32,
                  valid_rows: Int32):
        s = self.s
        self._plan_staging(ops, t, smem, tid, valid_rows)
        self._prefetch_initial(ops, t, k_tiles, k_start)
        self._stamp(ops, tid, 1)
        # Two register sets, one per 16-k row of a stage (there are always two rows per thread:
        # b_sh_wr_iters == 2): row kk computes from set kk while the other set is being loaded,
        # so nothing is copied between "current" and "next" registers.
        a_shape = (2,) if self.m8 else (s.m_blocks, 4)
        bs_words = 6
        if cutlass.const_expr(s.modelopt):  # whole 16-byte activation chunks; 4 weight + 4 scale words
            a_shape = (4,) if self.m8 else (s.m_blocks, 8)
            bs_words = 8
        a_regs = [cute.make_rmem_tensor(a_shape, Uint32), cute.make_rmem_tensor(a_shape, Uint32)]
        bs_regs = [cute.make_rmem_tensor((bs_words,), Uint32), cute.make_rmem_tensor((bs_words,), Uint32)]
        frag = cute.make_rmem_tensor((2, 2), Uint32)
        pairs = cute.make_rmem_tensor((4 if self.nf3 else 1,), Uint32)  # NF3: a 32-k row's scale halves
        self._load_bs_regs(bs_regs[0], t, 0, 0)
        self._load_a_regs(a_regs[0], t, 0, 0)

        tile_idx = Int32(0)
        while tile_idx < k_tiles:
            for pipe in cutlass.range_constexpr(self.s.stages):
                if tile_idx < k_tiles:
                    for kk in cutlass.range_constexpr(2):
                        self._load_next(bs_regs[1 - kk], a_regs[1 - kk], t, pipe, kk, tile_idx, k_tiles)
                        if cutlass.const_expr(kk == 0):
                            self._prefetch_lookahead(ops, t, pipe, tile_idx, k_tiles, k_start)
                        self._mma_row(t, acc, a_regs[kk], bs_regs[kk], frag, pairs, kk)
                    tile_idx += Int32(1)
            if cutlass.const_expr("sync" not in self.ablate):
                cute.arch.sync_threads()
            if tile_idx < k_tiles:
                self._load_bs_regs(bs_regs[0], t, 0, 0)
                self._load_a_regs(a_regs[0], t, 0, 0)
