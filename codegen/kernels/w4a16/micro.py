"""CuTeDSL micro W4A16 MoE kernel: the small-M fused layer without a grid barrier (FusedSpec.micro).

The persistent decode kernel (fused.py) runs FC1 over every CTA, meets at a grid barrier, then runs FC2: at
Qwen3-30B M = 1 the barrier, FC2's route reads and its first stage cost ~4 us of a ~15 us kernel
(docs/benchmarks.md, "The decode kernel's timeline").  Here a CTA's work item is one route r and one FC1
n-tile j; nothing waits for another CTA until the very end:

1. FC1: the decode kernel's own whole-K tile (gemm.py `_tile`, direct routes, 8-row block), whose epilogue
   activates (gated epilogue, or relu2) and writes the tile's `micro_slice` activated columns of row r;
2. FC2 over that slice of K into all H output columns: each warp takes 64-column slabs of the weights
   (slab w, w + warps, ...); a lane's fragment words are loaded straight into registers, a few slabs ahead,
   with no shared memory and no barrier: packed, exactly the 16 bytes it would have copied to shared memory
   (the layout is in fragment order); read as stored (modelopt), 8 bytes of each of its rows' 32-byte piece
   of each 64 k of the slice, with the MMA's k slots relabelled as the stored layout's mma.sync loop does
   (docs/layouts.md).  The first slabs' loads are issued before FC1's epilogue, which hides their latency.
   The slice's activations (row r, read back after the CTA's barrier) are the MMA's token column 0;
3. every partial, times FC2's global scale and the route's router weight, is added (red.add.f32) into the
   (M, H) float32 sums in `locks` (with biases, the route's first item also adds its weight x FC2's bias);
   each CTA then counts itself done, and the last one converts the sums into the dtype output and zeroes them
   and the counter (the workspace is clean after every launch).

Work items are grid-strided, so any grid is correct and no CTA waits on another: no co-residency is needed.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import Float32, Int32, Int64, Uint32

from cuteaot.runtime.kernels.w4a16.fused_spec import MICRO_COUNTER_WORD, MICRO_SUMS_WORD, FusedSpec

from ... import intrinsics as I
from ..common import after_prior_grids
from .fused import FusedLaunch
from .gemm import _Operands
from .wgmma import gemm_kernel

# Slabs a warp loads ahead of the one it multiplies: each is micro_slice / 16 x 24 bytes a lane in flight; one CTA an
# SM (blocks_per_sm 1) has the registers for as many as MICRO_AHEAD_ALONE_WORDS words a lane (4 slabs of 64-k slices).
MICRO_LOOKAHEAD = 2
MICRO_AHEAD_ALONE_WORDS = 96
# The first slabs' loads are issued as FC1's main loop ends, before its epilogue (fold, activation, store), which
# then hides their latency: as many as MICRO_EARLY_WORDS words a lane (live across the epilogue; 96 spilled), none
# where FC1's epilogue adds a bias in a CTA of 128 registers (two an SM: gpt-oss with biases spilled 8 bytes even
# with one slab early, whose addresses then live across FC1's main loop).
# Measured on the H100 against loading them after it: 0.95-0.98x the layer's time at Qwen3-30B M = 1-5, up to 1.008x
# elsewhere (docs/benchmarks.md, thirty-third session).
MICRO_EARLY_WORDS = 48


class W4A16MicroMoeKernel(FusedLaunch):
    def __init__(self, spec: FusedSpec):
        assert spec.micro, "FusedSpec.micro selects this kernel"
        self.s = spec
        self.fc1 = gemm_kernel(spec.fc1_gemm, None, False)
        self.fc2 = gemm_kernel(spec.fc2_gemm, None, False)  # its dequant and MMA helpers only
        self.threads = spec.threads
        self.warps = spec.threads // 32
        g2 = spec.fc2_gemm
        self.n2, self.k2 = g2.n, g2.k
        self.rows = spec.micro_slice // 16  # 16-k rows of FC2 a work item multiplies
        self.slabs = self.n2 // 64
        self.slabs_per_warp = -(-self.slabs // self.warps)
        alone = MICRO_AHEAD_ALONE_WORDS // (6 * self.rows)  # (a slab: 6 words a lane per 16-k row, both layouts)
        self.lookahead = min(max(alone, MICRO_LOOKAHEAD) if spec.blocks_per_sm == 1 else MICRO_LOOKAHEAD,
                             self.slabs_per_warp)
        self.early = min(self.lookahead, max(1, MICRO_EARLY_WORDS // (6 * self.rows)))
        if spec.bias and spec.blocks_per_sm > 1:
            self.early = 0
        self.stored = spec.fc2_gemm.modelopt  # FC2 read as ModelOpt stores it: (E, H, I/2) bytes, k-contiguous rows
        self.parts = self.rows // 4  # stored: the slice's 64-k parts (a row's 32 bytes and 4 scale bytes each)

    @cute.kernel
    def kernel(self, a: cute.Pointer, w13: cute.Pointer, w2: cute.Pointer, fc1_out: cute.Pointer,
               activated: cute.Pointer, fc2_out: cute.Pointer, w13_scales: cute.Pointer, w2_scales: cute.Pointer,
               w13_global_scale: cute.Pointer, w2_global_scale: cute.Pointer, route_indices: cute.Pointer,
               block_experts: cute.Pointer, route_count: cute.Pointer, topk_weights: cute.Pointer,
               w13_bias: cute.Pointer, w2_bias: cute.Pointer, c_tmp: cute.Pointer, locks: cute.Pointer,
               amax: cute.Pointer, layer: Int32, tokens: Int32, num_experts: Int32):
        after_prior_grids(persistent=True)
        s = self.s
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        tid, cta, grid_x = Int32(tidx), Int32(bidx), Int32(gdim)
        smem = I.shared_ptr_to_u32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=16))
        lock_base = I.gmem_address(locks)
        sums = lock_base + Int64(MICRO_SUMS_WORD * 4)
        fc1_ops = _Operands(
            a=I.gmem_address(a), qweight=I.gmem_address(w13), out=I.gmem_address(activated),
            scales=I.gmem_address(w13_scales), global_scale=I.gmem_address(w13_global_scale),
            bias=I.gmem_address(w13_bias), route_indices=I.gmem_address(route_indices),
            block_experts=I.gmem_address(block_experts), route_count=I.gmem_address(route_count),
            topk_weights=I.gmem_address(topk_weights), c_tmp=I.gmem_address(c_tmp),
            locks=lock_base + Int64(s.barrier_words * 4), num_experts=num_experts,  # (a whole tile takes no lock)
        )
        routes = tokens * Int32(s.top_k)
        n1_tiles = Int32(s.fc1_gemm.n_tiles)
        items = routes * n1_tiles
        item = cta
        while item < items:
            route = item // n1_tiles
            j = item - route * n1_tiles
            expert, pair = self.fc1._direct_reads(fc1_ops, route, routes)
            # a route outside [0, E) (masked, or a caller's bug) adds nothing and never indexes the weights
            if expert >= Int32(0) and expert < num_experts:
                # FC2's per-route factors, loaded now so they are in registers when the slabs are
                weight = I.ld_global_nc_f32(I.gmem_address(topk_weights) + Int64(route) * Int64(4))
                scale = I.ld_global_nc_f32(I.gmem_address(w2_global_scale) + Int64(expert) * Int64(4)) * weight
                # FC2's slab addresses: before FC1 where its first slabs load before FC1's epilogue, else after
                if cutlass.const_expr(self.early > 0):
                    q0, s0 = self._slab_addresses(I.gmem_address(w2), I.gmem_address(w2_scales), tid, expert, j)
                    early = self._fc1_tile(fc1_ops, smem, tid, tokens, route, expert, j, pair,
                                           lambda: self._first_slabs(q0, s0, tid))
                else:
                    self._fc1_tile(fc1_ops, smem, tid, tokens, route, expert, j, pair, None)
                    early = []
                cute.arch.sync_threads()  # the tile's activated columns are in `activated`; smem is free again
                if cutlass.const_expr(self.early == 0):
                    q0, s0 = self._slab_addresses(I.gmem_address(w2), I.gmem_address(w2_scales), tid, expert, j)
                self._fc2_slice(I.gmem_address(activated), q0, s0, sums, tid, route, j, scale, early)
                if cutlass.const_expr(s.bias):
                    if j == Int32(0):  # the route's FC2 bias, once (its first slice)
                        self._add_bias(I.gmem_address(w2_bias), sums, tid, route, expert, weight)
            item += grid_x
        self._finish(I.gmem_address(fc2_out), lock_base + Int64(MICRO_COUNTER_WORD * 4), sums, tid, grid_x, tokens)

    @cute.jit
    def _fc1_tile(self, ops, smem: Int32, tid: Int32, tokens: Int32, route: Int32, expert: Int32, j: Int32, pair,
                  before_epilogue):
        """FC1 tile j of the route over the whole K, activated in its epilogue (gemm.py `_tile`); returns what
        `before_epilogue` (None, or the first FC2 slabs' loads) returns."""
        return self.fc1._tile(ops, smem, tid, tokens, route, expert, Int32(0), j, Int32(0),
                              Int32(self.s.fc1_gemm.k_tiles), Int32(1), Int32(0), Int32(0), pair,
                              before_epilogue=before_epilogue)

    # ------------------------------------------------------------------ FC2 over one slice of K

    @cute.jit
    def _slab_addresses(self, qweight: Int64, scales: Int64, tid: Int32, expert: Int32, j: Int32):
        """This lane's weight and scale addresses in slab 0 of FC1 tile j's slice of FC2 (packed: its int4 of the
        slice's first 16-k row and its scale bytes there; stored: `_stored_addresses`)."""
        lane = tid & Int32(31)
        g = lane // Int32(4)
        first_row = j * Int32(self.rows)  # the slice's first 16-k row of FC2's K
        if cutlass.const_expr(self.stored):
            return self._stored_addresses(qweight, scales, expert, first_row, g, lane % Int32(4))
        q0 = qweight + (Int64(expert) * Int64(self.n2 * self.k2 // 32) + Int64(first_row) * Int64(self.n2 // 2)
                        + Int64(lane)) * Int64(16)
        s0 = (scales + Int64(expert) * Int64(self.n2 * self.k2 // 16) + Int64(first_row) * Int64(self.n2)
              + Int64(g * Int32(8)))
        return q0, s0

    @cute.jit
    def _first_slabs(self, q0: Int64, s0: Int64, tid: Int32):
        """The loads of the warp's first `early` slabs (issued before FC1's epilogue)."""
        warp = tid // Int32(32)
        return [self._load_slab(q0, s0, self._slab(warp, i)) for i in range(self.early)]

    @cute.jit
    def _fc2_slice(self, activated: Int64, q0: Int64, s0: Int64, sums: Int64, tid: Int32, route: Int32, j: Int32,
                   scale: Float32, early):
        """sums[token of route, :] += scale * (activated[route, slice j] @ W2[expert][slice j, :]).

        Warp w multiplies slabs w, w + warps, ... (64 output columns each) over the slice's `rows` 16-k rows;
        lane (g, t) holds int4 `lane` of each 16-k row of the slab (four words: column blocks 16 jj + g, + 8)
        and the 8 bytes of scales its group g reads (docs/layouts.md), as the mma.sync loop's shared-memory
        reads would have given it.  The activations are the MMA's B operand, token column 0 only (lanes g = 0);
        the results for that column sit in lanes t = 0: acc[jj, 0] (column 16 jj + g) and acc[jj, 2] (+ 8).
        q0, s0: `_slab_addresses`; early: `_first_slabs`, already loaded."""
        s, rows = self.s, self.rows
        warp = tid // Int32(32)
        lane = tid & Int32(31)
        g = lane // Int32(4)
        t = lane % Int32(4)
        first_row = j * Int32(rows)  # the slice's first 16-k row of FC2's K
        if cutlass.const_expr(self.stored):
            act = self._stored_activations(activated, route, first_row, g, t)
        else:
            # activations: (k = 2t, 2t + 1) and (2t + 8, 2t + 9) of each 16-k row of the slice, row `route`
            act = cute.make_rmem_tensor((rows, 2), Uint32)
            act.fill(0)
            if g == Int32(0):
                k = Int64(first_row * Int32(16) + Int32(2) * t)
                base = activated + (Int64(route) * Int64(s.intermediate_size) + k) * Int64(2)
                for r in cutlass.range_constexpr(rows):
                    act[r, 0] = I.ld_global_u32(base + Int64(32 * r))
                    act[r, 1] = I.ld_global_u32(base + Int64(32 * r + 16))
        selector = I.e4m3_pairs_selector(t)  # (stored: the lane's scale byte of each row)
        token = route // Int32(s.top_k)
        out_row = sums + Int64(token) * Int64(self.n2 * 4)
        count, ahead = self.slabs_per_warp, self.lookahead
        loaded = [None] * count
        acc = cute.make_rmem_tensor((4, 4), Float32)
        frag = cute.make_rmem_tensor((2, 2), Uint32)
        for i in cutlass.range_constexpr(count + ahead):
            if cutlass.const_expr(i < count):
                if cutlass.const_expr(i < len(early)):
                    loaded[i] = early[i]
                else:
                    loaded[i] = self._load_slab(q0, s0, self._slab(warp, i))
            c = i - ahead
            if cutlass.const_expr(c >= 0):
                words, pieces = loaded[c]
                acc.fill(0.0)
                if cutlass.const_expr(self.stored):
                    self._multiply_stored(acc, words, pieces, act, selector)
                else:
                    self._multiply(acc, frag, words, pieces, act)
                slab = warp + Int32(c * self.warps)
                self._add_slab(acc, out_row + Int64(slab * Int32(64)) * Int64(4), g, t, scale,
                               slab < Int32(self.slabs) if (c + 1) * self.warps > self.slabs else None)

    @cute.jit
    def _add_slab(self, acc: cute.Tensor, row: Int64, g: Int32, t: Int32, scale: Float32, inside):
        """sums[row + column] += scale x the slab's token-0 results (acc[jj, 0]: column 16 jj + g, acc[jj, 2]:
        + 8, in lanes t = 0), one float reduction each (four-float ones with shuffles measured slower,
        docs/design.md); `inside` None: the slab exists for every warp, else whether this warp's does."""
        add = t == Int32(0)
        if cutlass.const_expr(inside is not None):
            add = add and inside
        if add:
            col = row + Int64(g) * Int64(4)
            for jj in cutlass.range_constexpr(4):
                I.red_add_f32(col + Int64(64 * jj), acc[jj, 0] * scale)
                I.red_add_f32(col + Int64(64 * jj + 32), acc[jj, 2] * scale)

    @cute.jit
    def _add_bias(self, bias: Int64, sums: Int64, tid: Int32, route: Int32, expert: Int32, weight: Float32):
        """sums[token of route, :] += weight * w2_bias[expert, :] (FC2's epilogue adds the bias before the router
        weight), two columns a thread a step."""
        h = self.s.hidden_size
        row = sums + Int64(route // Int32(self.s.top_k)) * Int64(self.n2 * 4)
        pairs = bias + Int64(expert) * Int64(h * 2)
        c = tid
        while c < Int32(h // 2):
            b0, b1 = self.fc2._unpack_pair(I.ld_global_nc_u32(pairs + Int64(c) * Int64(4)))
            I.red_add_f32(row + Int64(c) * Int64(8), b0 * weight)
            I.red_add_f32(row + Int64(c) * Int64(8) + Int64(4), b1 * weight)
            c += Int32(self.threads)

    @cute.jit
    def _slab(self, warp: Int32, i: cutlass.Constexpr[int]) -> Int32:
        """Warp `warp`'s i-th slab; past the last slab it re-reads the last (loaded, never added)."""
        slab = warp + Int32(i * self.warps)
        if cutlass.const_expr((i + 1) * self.warps > self.slabs):
            slab = cutlass.min(slab, Int32(self.slabs - 1))
        return slab

    @cute.jit
    def _load_slab(self, q0: Int64, s0: Int64, slab: Int32):
        """The lane's weight words (4 per 16-k row) and raw scale words (2 per row) of one slab; stored: per
        column block jj and half h, the v2 word pair and the scale word of row 16 jj + 8 h + g."""
        words, pieces = [], []
        if cutlass.const_expr(self.stored):
            row_bytes, scale_bytes = self.k2 // 2, self.k2 // 16
            q = q0 + Int64(slab) * Int64(64 * row_bytes)
            p = s0 + Int64(slab) * Int64(64 * scale_bytes)
            for part in cutlass.range_constexpr(self.parts):
                for jj in cutlass.range_constexpr(4):
                    for h in cutlass.range_constexpr(2):
                        row = 16 * jj + 8 * h
                        words.append(I.ld_global_nc_v2_u32(q + Int64(row * row_bytes + 32 * part)))
                        pieces.append(I.ld_global_nc_u32(p + Int64(row * scale_bytes + 4 * part)))
            return words, pieces
        q = q0 + Int64(slab) * Int64(32 * 16)
        p = s0 + Int64(slab) * Int64(64)
        for r in cutlass.range_constexpr(self.rows):
            words.append(I.ld_global_nc_v4_u32(q + Int64(r * self.n2 * 8)))
            pieces.append(I.ld_global_nc_v2_u32(p + Int64(r * self.n2)))
        return words, pieces

    @cute.jit
    def _multiply(self, acc: cute.Tensor, frag: cute.Tensor, words, pieces, act: cute.Tensor):
        """One slab's MMAs over the slice: acc[jj, :] += D^T of column blocks (16 jj + g, + 8) x tokens (2t, 2t+1)."""
        for r in cutlass.range_constexpr(self.rows):
            for jj in cutlass.range_constexpr(4):
                halves = self.fc2._scale_halves(pieces[r][jj // 2], jj % 2)
                self.fc2._scaled_weight_fragment(frag, words[r][jj], halves)
                d0, d1, d2, d3 = self.fc2._mma(acc[jj, 0], acc[jj, 1], acc[jj, 2], acc[jj, 3],
                                               frag[0, 0], frag[1, 0], frag[0, 1], frag[1, 1], act[r, 0], act[r, 1])
                acc[jj, 0] = d0
                acc[jj, 1] = d1
                acc[jj, 2] = d2
                acc[jj, 3] = d3

    # ------------------------------------------------------------------ FC2 read as stored (modelopt)

    @cute.jit
    def _stored_addresses(self, qweight: Int64, scales: Int64, expert: Int32, first_row: Int32, g: Int32, t: Int32):
        """Weights read as stored: this lane's first weight and scale addresses (`_stored_activations` says which
        bytes)."""
        row_bytes, scale_bytes = self.k2 // 2, self.k2 // 16
        row = Int64(expert) * Int64(self.n2) + Int64(g)
        q0 = qweight + row * Int64(row_bytes) + Int64(first_row * Int32(8) + Int32(8) * t)
        s0 = scales + row * Int64(scale_bytes) + Int64(first_row)
        return q0, s0

    @cute.jit
    def _stored_activations(self, activated: Int64, route: Int32, first_row: Int32, g: Int32, t: Int32):
        """The slice's activations, paired for weights read as stored.

        Row n of FC2 holds its K codes contiguously, two a byte, so each 64-k part of the slice is 32 bytes of
        each row, and 4 scale bytes.  Lane (g, t) takes bytes 8t .. 8t + 7 of a part (two words: k = 16t ..
        16t + 7 and 16t + 8 .. 16t + 15 of it, one 16-k group, so one scale: byte t of the row's 4) of rows
        16 jj + g and 16 jj + g + 8.  Each word decodes into pairs (code i, code i + 4), i = 0..3
        (`_dequant_codes`); k-step (part, w, ks) takes word w's pairs 2ks (the fragment's slots 2t, 2t + 1) and
        2ks + 1 (slots 2t + 8, 2t + 9), and the activations are paired alike (act[part, w, i] = k = 64 part +
        16t + 8w + i, + i + 4), as the stored layout's mma.sync loop relabels its k slots (docs/layouts.md):
        every product meets its own activation (tests/test_modelopt_dataflow.py plays it out)."""
        s = self.s
        first_k = first_row * Int32(16)
        act = cute.make_rmem_tensor((self.parts, 2, 4), Uint32)  # [64-k part, word, pair]
        act.fill(0)
        if g == Int32(0):
            base = activated + (Int64(route) * Int64(s.intermediate_size) + Int64(first_k + Int32(16) * t)) * Int64(2)
            for part in cutlass.range_constexpr(self.parts):
                for w in cutlass.range_constexpr(2):
                    pairs = self.fc2._chunk_pairs([I.ld_global_u32(base + Int64(128 * part + 16 * w + 4 * i))
                                                   for i in range(4)])
                    for i in cutlass.range_constexpr(4):
                        act[part, w, i] = pairs[i]
        return act

    @cute.jit
    def _multiply_stored(self, acc: cute.Tensor, words, pieces, act: cute.Tensor, selector: Int32):
        """One slab's MMAs over the slice, weights read as stored: column blocks (16 jj + g, + 8) x token column 0,
        four k-steps (two per word)."""
        for part in cutlass.range_constexpr(self.parts):
            for jj in cutlass.range_constexpr(4):
                at = 8 * part + 2 * jj  # (`_load_slab`'s order: part, column block, half)
                scales = self.fc2._scale_pairs_e4m3(pieces[at], pieces[at + 1], selector)  # rows c0, c1
                for w in cutlass.range_constexpr(2):
                    pairs = [[self.fc2._pair_mul(r, scales[h]) for r in self.fc2._dequant_codes(words[at + h][w])]
                             for h in range(2)]
                    for ks in cutlass.range_constexpr(2):
                        d0, d1, d2, d3 = self.fc2._mma(acc[jj, 0], acc[jj, 1], acc[jj, 2], acc[jj, 3],
                                                       pairs[0][2 * ks], pairs[1][2 * ks], pairs[0][2 * ks + 1],
                                                       pairs[1][2 * ks + 1], act[part, w, 2 * ks],
                                                       act[part, w, 2 * ks + 1])
                        acc[jj, 0] = d0
                        acc[jj, 1] = d1
                        acc[jj, 2] = d2
                        acc[jj, 3] = d3

    # ------------------------------------------------------------------ the last CTA

    @cute.jit
    def _finish(self, out: Int64, counter: Int64, sums: Int64, tid: Int32, grid_x: Int32, tokens: Int32):
        """Count this CTA done (release: after its adds); the last one (acquire: after everyone's) writes
        out = dtype(sums) for the launch's tokens and zeroes the sums and the counter."""
        cute.arch.sync_threads()  # every thread's adds precede thread 0's release
        last = Int32(0)
        if tid == Int32(0):
            if I.atom_add_release_i32(counter, Int32(1)) == grid_x - Int32(1):
                I.ld_global_acquire_i32(counter)  # reads the last add: ordered after every CTA's release
                last = Int32(1)
        if I.sync_threads_count(last) != Int32(0):
            chunks = tokens * Int32(self.n2 // 8)  # 8 outputs a thread a step: two float4 in, one 16-byte store
            zero = Float32(0.0)
            i = tid
            while i < chunks:
                at = sums + Int64(i) * Int64(32)
                x0, x1, x2, x3 = I.ld_global_v4_f32(at)
                y0, y1, y2, y3 = I.ld_global_v4_f32(at + Int64(16))
                pack = self.fc2._pack_pair  # dtype pairs, as the GEMM epilogue packs them
                I.st_global_v4_u32(out + Int64(i) * Int64(16), pack(x0, x1), pack(x2, x3), pack(y0, y1), pack(y2, y3))
                I.st_global_v4_f32(at, zero, zero, zero, zero)
                I.st_global_v4_f32(at + Int64(16), zero, zero, zero, zero)
                i += Int32(self.threads)
            if tid == Int32(0):
                I.st_global_i32(counter, Int32(0))
