"""The wgmma GEMM with a producer warpgroup (sm_90a, `GemmSpec.producer_warp`; planned only where the
"producer" knob of planning.MEASURED_KNOBS was measured to win, so far nowhere: the comment there says why).

The loop of wgmma.py makes its warpgroup(s) copy their own stages: every tile starts with a pipeline
fill (the first stages' loads, in full view of the tensor cores) and ends with an epilogue that
stages its output over the pipeline's shared memory, so the next tile's loads cannot start before
it is done.  One CTA of 256-row blocks holds a whole SM, so nothing else hides either (docs/benchmarks.md,
"256-row route blocks": the short-K FC2 loses to 128-row blocks for that reason).

Here the same warpgroup(s) only decode, multiply and store, and one more warpgroup (the last of the
CTA) streams every stage:

    producer warpgroup                         compute warpgroup(s)
    for each tile of the CTA's schedule:       for each tile of the same schedule:
      the block's source rows -> shared          route metadata (compute barrier)
      for each k-tile:                           for each k-tile:
        wait empty[s]                              wait full[s]; decode + wgmma (as wgmma.py)
        cp.async activations, weights, scales      once its MMAs are done: arrive empty[s]
        arrive full[s] when they land            epilogue into its own output tile
          (cp.async.mbarrier.arrive.noinc)

`s` walks a ring of `stages` stages across tile boundaries: while the warpgroups run a tile's
epilogue the producer is already filling the next tile's stages.  Both roles run the scheduler of
gemm.py (`_persistent`), so they visit the same tiles with the same K ranges; each keeps its ring
position in shared memory between tiles (`WgmmaWsLayout.rings`).  `setmaxnreg` moves registers from
the producer (PRODUCER_REGISTERS) to the compute warpgroups.

Barriers: full[s] expects the producer's 128 threads (each arrives when its own copies have landed);
empty[s] expects one arrival per compute warp (lane 0, after the wgmma groups that read the stage
have completed).  The compute warps synchronise among themselves with named barrier 1 (`_sync`), the
producer's with barrier 2, never with each other.  Shared data written by cp.async is made visible to
wgmma's async proxy by a `fence.proxy.async` after each full wait.  Padding rows of a block are not
copied (no stored output reads them) except with a zero-padded K, whose columns must read as zeros.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import Float32, Int32, Int64, Uint32

from cuteaot.runtime.kernels.w4a16.geometry import (
    PRODUCER_REGISTERS,
    PRODUCER_THREADS,
    WGMMA_SMEM_ALIGN,
    wgmma_ws_compute_registers,
)

from ... import intrinsics as I
from .gemm import W4A16GemmKernel, _Tile
from .wgmma import _X_ROW, GROUPS_IN_FLIGHT, W4A16WgmmaGemmKernel

COMPUTE_BARRIER = 1  # named barriers of the compute warps and of the producer (0 is the whole CTA's)
PRODUCER_BARRIER = 2
# k-tiles per straight-line run of the compute loop; a run ends drained (wait_group 0), for the
# reason given in wgmma.py's `_wg_mainloop`
UNROLL = 4


class W4A16WgmmaWsGemmKernel(W4A16WgmmaGemmKernel):
    def __init__(self, spec):
        super().__init__(spec)
        self.compute = spec.compute_threads
        self.lay = spec.ws_layout
        # which role `_tile` is being traced for: set around the two traces of the scheduler
        self.producing = False

    # ------------------------------------------------------------------ barriers of the compute warps

    @cute.jit
    def _sync(self):
        I.named_barrier_sync(COMPUTE_BARRIER, self.compute)

    @cute.jit
    def _sync_count(self, flag: Int32) -> Int32:
        return I.named_barrier_count(COMPUTE_BARRIER, self.compute, flag)

    # ------------------------------------------------------------------ roles

    @cute.jit
    def _persistent(self, ops, smem: Int32, tid: Int32, cta: Int32, grid_x: Int32, tokens: Int32):
        s = self.s
        lay = self.lay
        if tid == Int32(0):
            for i in cutlass.range_constexpr(s.stages):
                I.mbarrier_init(smem + Int32(lay.full + 8 * i), PRODUCER_THREADS)
                I.mbarrier_init(smem + Int32(lay.empty + 8 * i), self.compute // 32)
            I.st_shared_i32(smem + Int32(lay.rings), Int32(0))
            I.st_shared_i32(smem + Int32(lay.rings + 4), Int32(0))
            I.fence_mbarrier_init()
        cute.arch.sync_threads()
        # the role by warpgroup (setmaxnreg is executed by whole warpgroups), uniform as ptxas sees it
        if I.warp_uniform(tid // Int32(128)) >= Int32(self.compute // 128):
            I.setmaxnreg(PRODUCER_REGISTERS, increase=False)
            self._schedule(True, ops, smem, tid, cta, grid_x, tokens)
            I.cp_async_wait_all()
        else:
            I.setmaxnreg(wgmma_ws_compute_registers(s.moe_block_size, s.blocks_per_sm), increase=True)
            self._schedule(False, ops, smem, tid, cta, grid_x, tokens)

    def _schedule(self, producing: bool, *args):
        """Trace gemm.py's scheduler for one role (`_tile` reads `producing` at trace time; plain Python,
        so that the flag is not a value the traced branches carry)."""
        self.producing = producing
        W4A16GemmKernel._persistent(self, *args)

    @cute.jit
    def _block_route(self, ops, tid: Int32, route_block: Int32) -> Int32:
        """The compute threads' route (gemm.py); the producer reads the block's rows itself."""
        route = Int32(0)
        if cutlass.const_expr(not self.producing):
            route = W4A16GemmKernel._block_route(self, ops, tid, route_block)
        return route

    @cute.jit
    def _tile(self, ops, smem: Int32, tid: Int32, tokens: Int32, route_block: Int32, expert: Int32, route: Int32,
              n_tile: Int32, k_start: Int32, k_count: Int32, slice_count: Int32, slice_idx: Int32, lock_slot: Int32,
              record=None):
        if cutlass.const_expr(self.producing):
            self._produce_tile(ops, smem, tid - Int32(self.compute), tokens, route_block, expert, n_tile, k_start,
                               k_count)
        else:
            self._compute_tile(ops, smem, tid, tokens, route_block, expert, route, n_tile, k_count, slice_count,
                               slice_idx, lock_slot)

    @cute.jit
    def _stage_bases(self, smem: Int32):
        """The 1024-aligned first activation stage, and the first weight, scale stage and the output tile."""
        s = self.s
        x = (smem + Int32(self.lay.stages_at + WGMMA_SMEM_ALIGN - 1)) & Int32(-WGMMA_SMEM_ALIGN)
        w = x + Int32(s.stages * s.wg_x_stage_bytes)
        sc = w + Int32(s.stages * s.wg_w_stage_bytes)
        return x, w, sc, sc + Int32(s.stages * s.wg_s_stage_bytes)

    @cute.jit
    def _ring_at(self, ring: Int32):
        """(stage, phase parity) of ring position `ring`."""
        return ring % Int32(self.s.stages), (ring // Int32(self.s.stages)) & Int32(1)

    # ------------------------------------------------------------------ the producer warpgroup

    @cute.jit
    def _produce_tile(self, ops, smem: Int32, p: Int32, tokens: Int32, route_block: Int32, expert: Int32,
                      n_tile: Int32, k_start: Int32, k_count: Int32):
        """Copy the tile's k_count k-tiles into the ring.  Producer thread p = (g, chunk) = (p // 8, p % 8)
        copies 16-byte chunk `chunk` of block rows g * R .. g * R + R - 1 (R = block / 16; a warp
        instruction: four whole rows) and int4 p, p + 128, ... of the weight and scale stages."""
        s = self.s
        lay = self.lay
        block = s.moe_block_size
        rows_sh = smem + Int32(lay.rows)
        routes = tokens * Int32(s.top_k)
        # the block's source rows as 16-byte offsets into A (-1: padding), through shared memory to the
        # threads that copy them
        for j in cutlass.range_constexpr(block // PRODUCER_THREADS):
            r = p + Int32(PRODUCER_THREADS * j)
            idx = I.ld_global_nc_i32(ops.route_indices + Int64(route_block * Int32(block) + r) * Int64(4))
            src = Int32(-1)
            if idx < routes:
                src = idx // Int32(s.top_k) * Int32(s.a_width // 8)
            I.st_shared_i32(rows_sh + r * Int32(4), src)
        I.named_barrier_sync(PRODUCER_BARRIER, PRODUCER_THREADS)
        ring = I.ld_shared_i32(smem + Int32(lay.rings))
        chunk = p % Int32(8)
        rows = block // (PRODUCER_THREADS // 8)  # R, a multiple of 8
        first = p // Int32(8) * Int32(rows)
        # row first + j of a stage: 128 (first + j) + 16 (chunk ^ (j % 8)), the 128B swizzle
        x_dst = first * Int32(_X_ROW) + chunk * Int32(16)
        x_rows = rows_sh + first * Int32(4)
        x_src = ops.a + Int64(chunk * Int32(16))
        # weights: a stage is k_blocks 16-k rows of tile_n / 2 int4 (row-major), this thread's are
        # p + 128 c: row p // per_row + c * rows_per_pass, column p % per_row
        per_row = s.tile_n // 2
        assert PRODUCER_THREADS % per_row == 0, per_row
        rows_per_pass = PRODUCER_THREADS // per_row
        w_src = ops.qweight + (Int64(s.n * s.k // 32) * Int64(expert) + Int64(p // Int32(per_row)) * Int64(s.n // 2)
                               + Int64(self._slab_column(n_tile, p % Int32(per_row), 32))) * Int64(16)
        # scales: s_sh_stage int4 a stage, s_sh_stride per 16-k row, one per thread p < s_sh_stage
        assert s.s_sh_stage <= PRODUCER_THREADS, s.s_sh_stage
        s_src = ops.scales + (Int64(s.n * s.k // 256) * Int64(expert)
                              + Int64(p // Int32(s.s_sh_stride)) * Int64(s.n // 16)
                              + Int64(self._slab_column(n_tile, p % Int32(s.s_sh_stride), 4))) * Int64(16)
        x_base, w_base, s_base, _ = self._stage_bases(smem)
        i = Int32(0)
        while i < k_count:
            st, ph = self._ring_at(ring)
            I.mbarrier_wait_parity(smem + Int32(lay.empty) + st * Int32(8), ph ^ Int32(1))
            k_tile = k_start + i
            xs = x_base + st * Int32(s.wg_x_stage_bytes) + x_dst
            x_at = x_src + Int64(k_tile) * Int64(_X_ROW)
            chunk_ok = Int32(1)
            if cutlass.const_expr(s.k_in is not None):  # zero-padded K: columns past k_in read as zeros
                chunk_ok = (k_tile * Int32(8) + chunk < Int32(s.k_in // 8)).to(Int32)
            for q in cutlass.range_constexpr(rows // 4):
                offsets = I.ld_shared_v4_u32(x_rows + Int32(16 * q))
                for e in cutlass.range_constexpr(4):
                    j = 4 * q + e
                    src = Int32(offsets[e])
                    dst = (xs + Int32(j * _X_ROW)) ^ Int32(16 * (j % 8))
                    if cutlass.const_expr(s.k_in is not None):  # the padded K's columns must read as zeros
                        I.cp_async_16_zfill(dst, x_at + Int64(src) * Int64(16), (src >= Int32(0)).to(Int32) & chunk_ok)
                    elif src >= Int32(0):  # padding rows are left as they are: no stored output reads them
                        I.cp_async_16(dst, x_at + Int64(src) * Int64(16))
            ws = w_base + st * Int32(s.wg_w_stage_bytes) + p * Int32(16)
            for c in cutlass.range_constexpr(per_row * s.k_blocks // PRODUCER_THREADS):
                I.cp_async_16(ws + Int32(c * PRODUCER_THREADS * 16),
                              w_src + (Int64(k_tile) * Int64(s.k_blocks) + Int64(c * rows_per_pass)) * Int64(s.n // 2 * 16))
            if p < Int32(s.s_sh_stage):
                I.cp_async_16(s_base + st * Int32(s.wg_s_stage_bytes) + p * Int32(16),
                              s_src + Int64(k_tile) * Int64(s.k_blocks * (s.n // 16) * 16))
            I.cp_async_mbarrier_arrive_noinc(smem + Int32(lay.full) + st * Int32(8))
            ring += Int32(1)
            i += Int32(1)
        # every producer thread is done with the source rows and read `ring` before it moves on
        I.named_barrier_sync(PRODUCER_BARRIER, PRODUCER_THREADS)
        if p == Int32(0):
            I.st_shared_i32(smem + Int32(lay.rings), ring)

    # ------------------------------------------------------------------ the compute warpgroup(s)

    @cute.jit
    def _ws_reads(self, smem: Int32, tid: Int32):
        """This thread's stage-0 read addresses, wgmma descriptor and output tile (t.base)."""
        x_base, w_base, s_base, out = self._stage_bases(smem)
        t = _Tile(base=out, x_base=x_base, w_base=w_base, s_base=s_base)
        group, part, lane = self._wg_thread(t, tid)
        self._wg_reads_packed(t, group, part, lane)
        t.desc = I.wgmma_desc_sw128(x_base)
        t.full = smem + Int32(self.lay.full)
        t.empty = smem + Int32(self.lay.empty)
        t.lane0 = (lane == Int32(0)).to(Int32)
        return t

    @cute.jit
    def _ws_view(self, t, st: Int32):
        """The read addresses of stage `st` (what wgmma.py's helpers take with pipe 0)."""
        s = self.s
        v = _Tile(w_rd=t.w_rd + st * Int32(s.wg_w_stage_bytes), s_rd=t.s_rd + st * Int32(s.wg_s_stage_bytes),
                  desc=t.desc + Int64(st * Int32(s.wg_x_stage_bytes >> 4)))
        if cutlass.const_expr(self.nw == 1):
            v.s_shift = t.s_shift
        return v

    @cute.jit
    def _ws_wait_full(self, t, st: Int32, ph: Int32):
        I.mbarrier_wait_parity(t.full + st * Int32(8), ph)
        I.fence_proxy_async_shared()

    @cute.jit
    def _ws_k_tile(self, t, acc: cute.Tensor, frag: cute.Tensor, words: cute.Tensor, st: Int32, ph: Int32, i: Int32,
                   k_tiles: Int32, drain: cutlass.Constexpr[bool], release_prev: cutlass.Constexpr[bool],
                   rows: cutlass.Constexpr[int]):
        """k-tile i of the tile, in stage st (waited for, its row 0 decoded); returns the next (stage, phase).

        Its stage is released once its wgmma groups are done: GROUPS_IN_FLIGHT rows into the next
        k-tile (`release_prev` there), or at its end where it drains."""
        s = self.s
        v = self._ws_view(t, st)
        wrap = (st + Int32(1)) // Int32(s.stages)
        nst = st + Int32(1) - wrap * Int32(s.stages)
        nph = ph ^ wrap
        prev = (st + Int32(s.stages - 1)) % Int32(s.stages)
        for kk in cutlass.range_constexpr(s.k_blocks):
            self._wg_mma(acc, frag, v, 0, kk, rows)
            last = kk + 1 == s.k_blocks
            I.wgmma_wait_group(0 if last and drain else GROUPS_IN_FLIGHT)
            if cutlass.const_expr(release_prev and kk == GROUPS_IN_FLIGHT - 1):
                I.mbarrier_arrive_if(t.empty + prev * Int32(8), t.lane0)
            if cutlass.const_expr(not last):
                self._wg_decode(frag, words, v, kk + 1)  # row kk + 1, loaded a row ago
                if cutlass.const_expr(kk + 2 < s.k_blocks):
                    self._wg_words(words, v, 0, kk + 2)
            elif cutlass.const_expr(drain):
                I.mbarrier_arrive_if(t.empty + st * Int32(8), t.lane0)
                if i + Int32(1) < k_tiles:
                    self._ws_wait_full(t, nst, nph)
                    self._wg_tile_start(frag, words, self._ws_view(t, nst), 0)
            else:
                self._ws_wait_full(t, nst, nph)
                self._wg_tile_start(frag, words, self._ws_view(t, nst), 0)
        return nst, nph

    @cute.jit
    def _ws_rows_mainloop(self, smem: Int32, tid: Int32, acc: cute.Tensor, k_tiles: Int32, ring: Int32,
                          rows: cutlass.Constexpr[int]):
        """One row variant's main loop over the tile's k_tiles k-tiles from ring position `ring`."""
        t = self._ws_reads(smem, tid)
        frag = cute.make_rmem_tensor((self.nw, 4), Uint32)
        words = cute.make_rmem_tensor((self.nw + max(self.nw // 2, 1),), Uint32)
        st, ph = self._ring_at(ring)
        self._ws_wait_full(t, st, ph)
        self._wg_tile_start(frag, words, self._ws_view(t, st), 0)
        # k_tiles % UNROLL k-tiles one at a time, each drained, then whole runs of UNROLL (in this order:
        # with the runs first, ptxas serialized every wgmma of the kernel)
        i = Int32(0)
        rest = k_tiles % Int32(UNROLL)
        while i < rest:
            st, ph = self._ws_k_tile(t, acc, frag, words, st, ph, i, k_tiles, True, False, rows)
            i += Int32(1)
        while i < k_tiles:
            for u in cutlass.range_constexpr(UNROLL):
                st, ph = self._ws_k_tile(t, acc, frag, words, st, ph, i + Int32(u), k_tiles, u == UNROLL - 1, u > 0,
                                         rows)
            i += Int32(UNROLL)
        self._wg_pin_acc(acc, rows)

    @cute.jit
    def _compute_tile(self, ops, smem: Int32, tid: Int32, tokens: Int32, route_block: Int32, expert: Int32,
                      route: Int32, n_tile: Int32, k_count: Int32, slice_count: Int32, slice_idx: Int32,
                      lock_slot: Int32):
        global_scale = I.ld_global_nc_f32(ops.global_scale + Int64(expert) * Int64(4))
        valid_rows = self._read_block(ops, smem, tid, route_block, route, tokens)
        # uniform as ptxas sees them (the main loop branches on them around wgmma).  Added while chasing
        # C7520 (wgmma serialized "in divergent path"); what removed it was the order of the remainder
        # loop (_ws_rows_mainloop), but this is the code the H200 runs verified
        ring = I.warp_uniform(I.ld_shared_i32(smem + Int32(self.lay.rings + 4)))
        k_tiles = I.warp_uniform(k_count)
        acc = cute.make_rmem_tensor((self.nw, self.acc_n), Float32)
        acc.fill(0.0)
        self._for_row_variant(I.warp_uniform(valid_rows), self._ws_rows_mainloop, (smem, tid, acc, k_tiles, ring))
        t = self._ws_reads(smem, tid)
        if slice_count > Int32(1):
            self._wg_merge_split_k(ops, acc, tid, lock_slot, slice_idx, slice_count)
        if slice_idx == slice_count - Int32(1):
            self._wg_store(ops, acc, smem, t, tid, n_tile, valid_rows, global_scale, self._bias_row(ops, expert))
        # every thread read `ring` before the barriers of the merge or the store above
        if tid == Int32(0):
            I.st_shared_i32(smem + Int32(self.lay.rings + 4), ring + k_count)
