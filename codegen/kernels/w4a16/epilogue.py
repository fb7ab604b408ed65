"""Epilogue of the W4A16 GEMM: fold the K-direction warp partials, merge split-K
slices through global scratch in lock order, scale, and store the tile.

Accumulator fragments (m16n8k16, g = lane // 4, t = lane % 4):
  large-M: acc[mb, jj, half, 0..3] = D rows (16*mb + g, +8) x columns
           (16*jj + 8*half + 2t, +1) of the warp's 64 columns;
  M <= 8:  acc[jj, 0..3] = D^T: columns (16*jj + g, +8) x tokens (2t, 2t+1).
Partials of warps stacked along K are summed in shared memory (`_fold_*`);
split-K slices of one tile arrive in slice order, each waiting for the lock to
reach its index, adding the previous partial from `c_tmp` and publishing its
own, the last one resetting the lock to 0 (the workspace is clean after every
launch).  The tile is then written as dtype through shared memory and stored
with 16-byte writes to the rows of its routes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import Int32, Int64, Uint32

from ... import intrinsics as I


class EpilogueMixin:
    @cute.jit
    def _pack_pair(self, x0, x1) -> Uint32:
        if cutlass.const_expr(self.is_fp16):
            return I.pack_f32x2_f16x2(x0, x1)
        return I.pack_f32x2_bf16x2(x0, x1)

    @cute.jit
    def _red_chunk(self, addr: Int64, q0: Uint32, q1: Uint32, q2: Uint32, q3: Uint32):
        """Add a 16-byte chunk of dtype pairs into global memory: one vector reduction (sm_90+)."""
        if cutlass.const_expr(self.is_fp16):
            I.red_add_v4_f16x2(addr, q0, q1, q2, q3)
        else:
            I.red_add_v4_bf16x2(addr, q0, q1, q2, q3)

    @cute.jit
    def _unpack_pair(self, x: Uint32):
        """A dtype pair as two floats (exact)."""
        if cutlass.const_expr(self.is_fp16):
            return I.f16x2_to_f32x2(x)
        return I.bf16x2_to_f32x2(x)

    @cute.jit
    def _pair_add(self, x: Uint32, y: Uint32) -> Uint32:
        """Two dtype pairs added in float32 (one rounding back to dtype)."""
        x0, x1 = self._unpack_pair(x)
        y0, y1 = self._unpack_pair(y)
        return self._pack_pair(x0 + y0, x1 + y1)

    @cute.jit
    def _st_elem(self, addr: Int32, v):
        if cutlass.const_expr(self.is_fp16):
            I.st_shared_f16_from_f32(addr, v)
        else:
            I.st_shared_bf16_from_f32(addr, v)

    @cute.jit
    def _relu2_pair(self, x: Uint32) -> Uint32:
        x0, x1 = self._unpack_pair(x)
        x0 = cute.arch.fmax(x0, cutlass.Float32(0.0))
        x1 = cute.arch.fmax(x1, cutlass.Float32(0.0))
        return self._pack_pair(x0 * x0, x1 * x1)

    @cute.jit
    def _store_chunk(self, ops, smem: Int32, row: Int32, col: Int32, valid_rows: Int32, staged: Int32,
                     bias_row: Int64):
        """Write the staged 16-byte chunk at `staged` to output column chunk `col` of block row `row`.

        Rows past the block's routes and columns past the logical N (zero-padded N, or a last tile past N)
        are not written.
        """
        s = self.s
        store = row < valid_rows
        if cutlass.const_expr(s.n_out is not None or s.n_tail):
            store = store and col < Int32(s.bias_width // 8)
        if store:
            route = I.ld_shared_i32(smem + Int32(s.sh_route_off * 16) + row * Int32(4))
            q0, q1, q2, q3 = self._finish_chunk(smem, row, I.ld_shared_v4_u32(staged), bias_row + Int64(col) * Int64(16))
            if cutlass.const_expr(s.sum_topk > 0):
                # fused top-k sum: add this route's row into its token's row (zeroed before)
                addr = ops.out + (Int64(route // Int32(s.sum_topk)) * Int64(s.out_width // 8) + Int64(col)) * Int64(16)
                self._red_chunk(addr, q0, q1, q2, q3)
            else:
                out_int4 = Int64(route) * Int64(s.out_width // 8) + Int64(col)
                I.st_global_v4_u32(ops.out + out_int4 * Int64(16), q0, q1, q2, q3)

    @cute.jit
    def _store_gated_chunk(self, ops, smem: Int32, row: Int32, col: Int32, valid_rows: Int32, gate_at: Int32,
                           up_at: Int32, bias_row: Int64):
        """Gated epilogue: output chunk `col` (8 columns of N / 2) of block row `row` from the staged gate
        and up chunks, each finished as an ordinary output (bias, router weight), then activated."""
        s = self.s
        if row < valid_rows:
            route = I.ld_shared_i32(smem + Int32(s.sh_route_off * 16) + row * Int32(4))
            gate = self._finish_chunk(smem, row, I.ld_shared_v4_u32(gate_at), bias_row + Int64(col) * Int64(16))
            up = self._finish_chunk(smem, row, I.ld_shared_v4_u32(up_at),
                                    bias_row + Int64(col + Int32(s.out_width // 8)) * Int64(16))
            q = [self._activate_pair(gate[i], up[i]) for i in range(4)]
            out_int4 = Int64(route) * Int64(s.out_width // 8) + Int64(col)
            I.st_global_v4_u32(ops.out + out_int4 * Int64(16), q[0], q[1], q[2], q[3])

    @cute.jit
    def _store_gated_rows(self, ops, smem: Int32, tid: Int32, n_tile: Int32, valid_rows: Int32,
                          rows: cutlass.Constexpr[int], c_sh_stride: Int32, bias_row: Int64):
        """Gated epilogue of the mma.sync loop: the staged tile row holds gate chunks then up chunks
        (tile_n / 16 of each, `_source_slab`); one thread per output chunk (8 columns of N / 2)."""
        s = self.s
        chunks = s.tile_n // 16
        per_iter = s.threads // chunks
        col = tid % Int32(chunks)
        for it in cutlass.range_constexpr(-(-rows // per_iter)):
            row = tid // Int32(chunks) + Int32(it * per_iter)
            gate_at = self._sh(smem, Int32(s.sh_red_off) + c_sh_stride * row + col)
            self._store_gated_chunk(ops, smem, row, Int32(chunks) * n_tile + col, valid_rows, gate_at,
                                    gate_at + Int32(chunks * 16), bias_row)
        cute.arch.sync_threads()

    @cute.jit
    def _activate_pair(self, gate: Uint32, up: Uint32) -> Uint32:
        """act(gate, up) of two dtype pairs, in float32 as the activation kernel computes it."""
        g0, g1 = self._unpack_pair(gate)
        u0, u1 = self._unpack_pair(up)
        return self._pack_pair(self.act._silu_times_up(g0, u0), self.act._silu_times_up(g1, u1))

    @cute.jit
    def _finish_chunk(self, smem: Int32, row: Int32, q, bias_chunk: Int64):
        """One staged 16-byte output chunk of block row `row`: + the expert's bias, x its router weight, relu2."""
        s = self.s
        q0, q1, q2, q3 = q
        if cutlass.const_expr(s.bias):
            b0, b1, b2, b3 = I.ld_global_nc_v4_u32(bias_chunk)
            q0 = self._pair_add(q0, b0)
            q1 = self._pair_add(q1, b1)
            q2 = self._pair_add(q2, b2)
            q3 = self._pair_add(q3, b3)
        if cutlass.const_expr(s.mul_topk_weights):
            weight = I.ld_shared_u32(smem + Int32(s.sh_topk_off * 16) + row * Int32(4))
            q0 = self._pair_mul(q0, weight)
            q1 = self._pair_mul(q1, weight)
            q2 = self._pair_mul(q2, weight)
            q3 = self._pair_mul(q3, weight)
        if cutlass.const_expr(self.relu2):
            q0 = self._relu2_pair(q0)
            q1 = self._relu2_pair(q1)
            q2 = self._relu2_pair(q2)
            q3 = self._relu2_pair(q3)
        return q0, q1, q2, q3

    # ------------------------------------------------------------------ K-direction fold

    @cute.jit
    def _fold_partials(self, acc: cute.Tensor, smem: Int32, tid: Int32):
        """Sum the accumulators of the warp rows stacked along K (red_off * 2 of them) into row 0.

        A halving tree through shared memory: at step i (red_off, red_off / 2, .., 1) warp rows
        [i, 2i) publish their running sum in slot row - i, having first added the two slots the step
        before filled for them (rows + 2i and + i of that step); row 0 adds slot 0 last."""
        s = self.s
        red_off = s.threads // s.b_sh_stride // 2  # tile_k / 64
        assert red_off & (red_off - 1) == 0, red_off
        if cutlass.const_expr(red_off >= 1):
            red_idx = tid // Int32(s.b_sh_stride)
            red_sh_stride = Int32(s.b_sh_stride * 8)
            red_sh_delta = Int32(s.b_sh_stride)
            red_sh_rd = red_sh_stride * red_idx + tid % Int32(s.b_sh_stride)
            frags = 4 if self.m8 else 8
            spread = 2 if self.m8 else 1  # slot offsets of the fragments (m8: every other, as staged before)
            steps = [red_off >> e for e in range(red_off.bit_length())]  # red_off, .., 2, 1
            for mb in cutlass.range_constexpr(1 if self.m8 else s.m_blocks):
                for i in cutlass.range_constexpr(len(steps)):
                    step = steps[i]
                    if Int32(step) <= red_idx and red_idx < Int32(2 * step):
                        for j in cutlass.range_constexpr(frags):
                            wr = red_sh_delta * Int32(spread * j) + red_sh_rd - red_sh_stride * Int32(step)
                            if cutlass.const_expr(step < red_off):
                                r0, r1, r2, r3 = I.ld_shared_v4_f32(
                                    self._sh(smem, Int32(s.sh_red_off) + red_sh_delta * Int32(spread * j) + red_sh_rd))
                                w0, w1, w2, w3 = I.ld_shared_v4_f32(self._sh(smem, Int32(s.sh_red_off) + wr))
                                self._acc_add(acc, mb, j, r0 + w0, r1 + w1, r2 + w2, r3 + w3)
                            v = self._acc_vec(acc, mb, j)
                            I.st_shared_v4_f32(self._sh(smem, Int32(s.sh_red_off) + wr), v[0], v[1], v[2], v[3])
                    cute.arch.sync_threads()
                if red_idx == Int32(0):
                    for j in cutlass.range_constexpr(frags):
                        r0, r1, r2, r3 = I.ld_shared_v4_f32(
                            self._sh(smem, Int32(s.sh_red_off) + red_sh_delta * Int32(spread * j) + red_sh_rd))
                        self._acc_add(acc, mb, j, r0, r1, r2, r3)
                cute.arch.sync_threads()

    @cute.jit
    def _acc_vec(self, acc: cute.Tensor, mb: cutlass.Constexpr[int], j: cutlass.Constexpr[int]):
        """The 4 accumulators of fragment j (large-M: j = 2*jj + half)."""
        if cutlass.const_expr(self.m8):
            return acc[j, 0], acc[j, 1], acc[j, 2], acc[j, 3]
        return acc[mb, j // 2, j % 2, 0], acc[mb, j // 2, j % 2, 1], acc[mb, j // 2, j % 2, 2], acc[mb, j // 2, j % 2, 3]

    @cute.jit
    def _acc_add(self, acc: cute.Tensor, mb: cutlass.Constexpr[int], j: cutlass.Constexpr[int], r0, r1, r2, r3):
        if cutlass.const_expr(self.m8):
            acc[j, 0] = acc[j, 0] + r0
            acc[j, 1] = acc[j, 1] + r1
            acc[j, 2] = acc[j, 2] + r2
            acc[j, 3] = acc[j, 3] + r3
        else:
            jj = j // 2
            h = j % 2
            acc[mb, jj, h, 0] = acc[mb, jj, h, 0] + r0
            acc[mb, jj, h, 1] = acc[mb, jj, h, 1] + r1
            acc[mb, jj, h, 2] = acc[mb, jj, h, 2] + r2
            acc[mb, jj, h, 3] = acc[mb, jj, h, 3] + r3

    @cute.jit
    def _acc_set(self, acc: cute.Tensor, mb: cutlass.Constexpr[int], j: cutlass.Constexpr[int], r0, r1, r2, r3):
        if cutlass.const_expr(self.m8):
            acc[j, 0] = r0
            acc[j, 1] = r1
            acc[j, 2] = r2
            acc[j, 3] = r3
        else:
            jj = j // 2
            h = j % 2
            acc[mb, jj, h, 0] = r0
            acc[mb, jj, h, 1] = r1
            acc[mb, jj, h, 2] = r2
            acc[mb, jj, h, 3] = r3

    # ------------------------------------------------------------------ split-K

    @cute.jit
    def _merge_split_k(self, ops, acc: cute.Tensor, tid: Int32, valid_rows: Int32, lock_slot: Int32,
                       slice_idx: Int32, slice_count: Int32):
        """Wait for this slice's turn, add the running partial, publish (or reset the lock if last)."""
        s = self.s
        lock = self._wait_slice_turn(ops, tid, lock_slot, slice_idx)
        active = Int32(32 * s.n_warps)
        tile_int4 = Int32(16 * s.m_blocks * s.tile_n // 4)
        if tid < active:
            lane_row = (tid & Int32(31)) // Int32(4)
            for mb in cutlass.range_constexpr(1 if self.m8 else s.m_blocks):
                for j in cutlass.range_constexpr(4 if self.m8 else 8):
                    slot = j * 2 if self.m8 else mb * 8 + j
                    row_ok = Int32(1)
                    if cutlass.const_expr(not self.m8):
                        if Int32(mb * 16) + lane_row >= valid_rows:
                            row_ok = Int32(0)
                    if row_ok != Int32(0):
                        int4_off = lock_slot * tile_int4 + active * Int32(slot) + tid
                        addr = ops.c_tmp + Int64(int4_off) * Int64(16)
                        v = self._acc_vec(acc, mb, j)
                        c0 = v[0]
                        c1 = v[1]
                        c2 = v[2]
                        c3 = v[3]
                        if slice_idx != Int32(0):
                            r0, r1, r2, r3 = I.ld_global_v4_f32(addr)
                            c0 = c0 + r0
                            c1 = c1 + r1
                            c2 = c2 + r2
                            c3 = c3 + r3
                        if slice_idx != slice_count - Int32(1):
                            I.st_global_v4_f32(addr, c0, c1, c2, c3)
                        self._acc_set(acc, mb, j, c0, c1, c2, c3)
        self._pass_slice_turn(lock, tid, slice_idx, slice_count)

    @cute.jit
    def _wait_slice_turn(self, ops, tid: Int32, lock_slot: Int32, slice_idx: Int32) -> Int64:
        """Block until the tile's lock reaches this slice's index; returns the lock's address.

        Slice 0 goes first without reading it: a launch gives each split tile a lock slot of its own
        (runtime/kernels/w4a16/geometry.py `lock_slots`; the partition tests check it), and finds it at 0
        (the last slice of its previous user reset it; in the fused kernel before the grid barrier)."""
        lock = ops.locks + Int64(lock_slot) * Int64(4)
        if slice_idx != Int32(0):
            if tid == Int32(0):
                state = Int32(-1)
                while state != slice_idx:
                    state = I.ld_global_acquire_i32(lock)
            self._sync()
        return lock

    @cute.jit
    def _pass_slice_turn(self, lock: Int64, tid: Int32, slice_idx: Int32, slice_count: Int32):
        """After the CTA's partial is written: hand the turn on, or reset the lock if last."""
        self._sync()
        if tid == Int32(0):
            if slice_idx == slice_count - Int32(1):
                I.st_global_i32(lock, Int32(0))
            else:
                I.red_add_release_i32(lock, Int32(1))

    # ------------------------------------------------------------------ store

    @cute.jit
    def _store_tile(self, ops, acc: cute.Tensor, smem: Int32, tid: Int32, n_tile: Int32, valid_rows: Int32,
                    global_scale, bias_row: Int64):
        """acc * global_scale -> dtype in shared memory -> (+ bias, x topk weight, relu2) -> out rows."""
        s = self.s
        c_sh_stride = Int32(2 * s.n_blocks + 1)  # int4 per staged row (+1 against bank conflicts)
        red = smem + Int32(s.sh_red_off * 16)
        if tid // Int32(32) < Int32(s.n_warps):
            lane = tid & Int32(31)
            if cutlass.const_expr(self.m8):
                # D^T fragments: element (column c, token r) -> row r, column c of the staged tile.
                wr = (Int32(8) * c_sh_stride * ((lane % Int32(4)) * Int32(2)) + lane // Int32(4)
                      + Int32(64) * (tid // Int32(32)))
                for jj in cutlass.range_constexpr(4):
                    w = wr + Int32(16 * jj)
                    self._st_elem(red + w * Int32(2), acc[jj, 0] * global_scale)
                    self._st_elem(red + (w + Int32(8) * c_sh_stride) * Int32(2), acc[jj, 1] * global_scale)
                    self._st_elem(red + (w + Int32(8)) * Int32(2), acc[jj, 2] * global_scale)
                    self._st_elem(red + (w + Int32(8) + Int32(8) * c_sh_stride) * Int32(2), acc[jj, 3] * global_scale)
            else:
                wr = Int32(4) * c_sh_stride * (lane // Int32(4)) + lane % Int32(4) + Int32(32) * (tid // Int32(32))
                for mb in cutlass.range_constexpr(s.m_blocks):
                    for jj in cutlass.range_constexpr(4):
                        w = wr + Int32(8 * jj) + Int32(mb * 16 * 4 * (2 * s.n_blocks + 1))
                        lower = Int32(4) * c_sh_stride * Int32(8)  # 8 rows further down, in pairs
                        for half in cutlass.range_constexpr(2):
                            I.st_shared_u32(red + (w + Int32(4 * half)) * Int32(4), self._pack_pair(
                                acc[mb, jj, half, 0] * global_scale, acc[mb, jj, half, 1] * global_scale))
                            I.st_shared_u32(red + (w + lower + Int32(4 * half)) * Int32(4), self._pack_pair(
                                acc[mb, jj, half, 2] * global_scale, acc[mb, jj, half, 3] * global_scale))
        cute.arch.sync_threads()

        rows = 16 if self.m8 else 16 * s.m_blocks
        if cutlass.const_expr(s.epilogue.is_gated):
            self._store_gated_rows(ops, smem, tid, n_tile, valid_rows, rows, c_sh_stride, bias_row)
        else:
            per_iter = s.threads // (2 * s.n_blocks)
            c_gl_stride = Int32(s.n_tiles * s.tile_n // 8)  # chunks per row of whole tiles (N where they divide it)
            c_gl_wr = (c_gl_stride * (tid // Int32(2 * s.n_blocks)) + tid % Int32(2 * s.n_blocks)
                       + Int32(2 * s.n_blocks) * n_tile)
            c_sh_rd = c_sh_stride * (tid // Int32(2 * s.n_blocks)) + tid % Int32(2 * s.n_blocks)
            for _ in cutlass.range_constexpr(-(-rows // per_iter)):
                row = c_gl_wr // c_gl_stride
                col = c_gl_wr - row * c_gl_stride  # 16-byte chunk in the (stored) tile row
                self._store_chunk(ops, smem, row, col, valid_rows, self._sh(smem, Int32(s.sh_red_off) + c_sh_rd), bias_row)
                c_gl_wr += c_gl_stride * Int32(per_iter)
                c_sh_rd += c_sh_stride * Int32(per_iter)
            cute.arch.sync_threads()
