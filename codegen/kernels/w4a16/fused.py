"""CuTeDSL fused W4A16 MoE kernel: FC1 -> activation -> FC2 in one persistent launch.

Port of the seed's `W4A16FusedMoeKernel`.  The two GEMM phases are the
grouped GEMM of w4a16/gemm.py (one GEMM kernel object per phase: the mma.sync
loop, or on sm_90a at large M the warpgroup-MMA loop of w4a16/wgmma.py; sharing the
dynamic shared-memory arena and the split-K scratch); between phases every CTA
meets at a grid barrier, so each phase sees all of the previous one's writes.
Phases, shapes and buffers: runtime/kernels/w4a16/fused_spec.py.

Grid barrier: `common.grid_barrier` on the first word of `locks`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import Float32, Int32, Int64

from cuteaot.runtime.kernels.activation import VECTOR
from cuteaot.runtime.kernels.w4a16.fused_spec import PACK_MAX_ROUTES, FusedSpec
from cuteaot.runtime.types import DType

from ... import intrinsics as I
from ..activation import ActivationKernel
from ..common import after_prior_grids, grid_barrier, store_clocks
from ..route_pack import ld_global_if_i32, same_id_lanes, warp_inclusive_sum
from .gemm import _Operands
from .wgmma import gemm_kernel


# Measurement switch (benchmarks/decode_timeline.py): decode kernels store a per-CTA timeline of both clocks in
# c_tmp, which their whole tiles leave unused: entry 0, after the prior-grid wait 1, FC1 tile 2-5 (routes read,
# first stage in, main loop done, stored), after the grid barrier 6, FC2 tile 7-10, exit 11; slot SM_SLOT holds
# the CTA's SM (%smid, %nsmid) instead of clocks.  Read while compiling and not a key fact: set it only to build
# a separate bundle for that script, never a served one.
TIMELINE = False
SM_SLOT = 12


class FusedLaunch:
    """The launch of a kernel of the fused family (FusedSpec.SIGNATURE's parameters, the spec's CTA size and shared
    memory), shared by the persistent kernel below and the micro kernel (micro.py); each defines its `kernel`."""

    @cute.jit
    def __call__(self, a: cute.Pointer, w13: cute.Pointer, w2: cute.Pointer, fc1_out: cute.Pointer,
                 activated: cute.Pointer, fc2_out: cute.Pointer, w13_scales: cute.Pointer, w2_scales: cute.Pointer,
                 w13_global_scale: cute.Pointer, w2_global_scale: cute.Pointer, route_indices: cute.Pointer,
                 block_experts: cute.Pointer, route_count: cute.Pointer, topk_weights: cute.Pointer,
                 w13_bias: cute.Pointer, w2_bias: cute.Pointer, c_tmp: cute.Pointer, locks: cute.Pointer,
                 amax: cute.Pointer, layer: Int32, tokens: Int32, num_experts: Int32, stream):
        self.kernel(a, w13, w2, fc1_out, activated, fc2_out, w13_scales, w2_scales, w13_global_scale,
                    w2_global_scale, route_indices, block_experts, route_count, topk_weights, w13_bias, w2_bias,
                    c_tmp, locks, amax, layer, tokens, num_experts).launch(
            grid=(1, 1, 1), block=[self.threads, 1, 1], smem=self.s.shared_bytes,
            min_blocks_per_mp=self.s.blocks_per_sm, stream=stream, preferred_smem_carveout=100,
        )


class W4A16FusedMoeKernel(FusedLaunch):
    def __init__(self, spec: FusedSpec):
        self.s = spec
        self.timeline = TIMELINE and spec.decode
        # the wgmma loop when the plan chose it for both phases; FC1's tile probes are slots 2-5, FC2's 7-10
        packs = spec.pack_experts is not None  # both phases read the kernel's own route packing
        self.fc1 = gemm_kernel(spec.fc1_gemm, 2 if self.timeline else None, packs)
        self.fc2 = gemm_kernel(spec.fc2_gemm, 7 if self.timeline else None, packs)
        self.act = ActivationKernel(spec.activation_spec)
        self.threads = spec.threads
        self.elem = cutlass.BFloat16 if spec.dtype is DType.BF16 else cutlass.Float16

    @cute.kernel
    def kernel(self, a: cute.Pointer, w13: cute.Pointer, w2: cute.Pointer, fc1_out: cute.Pointer,
               activated: cute.Pointer, fc2_out: cute.Pointer, w13_scales: cute.Pointer, w2_scales: cute.Pointer,
               w13_global_scale: cute.Pointer, w2_global_scale: cute.Pointer, route_indices: cute.Pointer,
               block_experts: cute.Pointer, route_count: cute.Pointer, topk_weights: cute.Pointer,
               w13_bias: cute.Pointer, w2_bias: cute.Pointer, c_tmp: cute.Pointer, locks: cute.Pointer,
               amax: cute.Pointer, layer: Int32, tokens: Int32, num_experts: Int32):
        if cutlass.const_expr(self.timeline):
            g0, c0 = I.read_timers()
        after_prior_grids(persistent=True)
        s = self.s
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        tid, cta, grid_x = Int32(tidx), Int32(bidx), Int32(gdim)
        smem = I.shared_ptr_to_u32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=16))
        barrier = I.gmem_address(locks)
        routing = dict(
            route_indices=I.gmem_address(route_indices), block_experts=I.gmem_address(block_experts),
            route_count=I.gmem_address(route_count), topk_weights=I.gmem_address(topk_weights),
            c_tmp=I.gmem_address(c_tmp), locks=barrier + Int64(s.barrier_words * 4), num_experts=num_experts,
        )
        if cutlass.const_expr(s.pack_experts is not None):  # the routes packed into this CTA's shared memory
            pack = s.pack_layout
            self._pack_routes(I.gmem_address(route_indices), tokens * Int32(s.top_k), num_experts, smem, tid)
            routing.update(route_indices=smem + Int32(pack.slots), block_experts=smem + Int32(pack.blocks),
                           route_count=smem + Int32(pack.count))
        # relu2, or the gated activation with gated_epilogue, is FC1's epilogue
        activates = not s.gated or bool(s.gated_epilogue)
        fc1_target = activated if activates else fc1_out
        fc1_ops = _Operands(a=I.gmem_address(a), qweight=I.gmem_address(w13), out=I.gmem_address(fc1_target),
                            scales=I.gmem_address(w13_scales), global_scale=I.gmem_address(w13_global_scale),
                            bias=I.gmem_address(w13_bias), **routing)
        fc2_ops = _Operands(a=I.gmem_address(activated), qweight=I.gmem_address(w2), out=I.gmem_address(fc2_out),
                            scales=I.gmem_address(w2_scales), global_scale=I.gmem_address(w2_global_scale),
                            bias=I.gmem_address(w2_bias), **routing)
        fc1_first = None
        if cutlass.const_expr(self.fc1.direct):  # the first tile's route read before the output is zeroed
            fc1_first = self.fc1._guessed_first_reads(fc1_ops, cta, tokens)
        routes = tokens * Int32(s.top_k)
        first = cta * Int32(self.threads) + tid  # this thread's index in grid-strided passes
        stride = grid_x * Int32(self.threads)

        if cutlass.const_expr(s.sums_topk):
            # FC2 adds into the output: zero it now; the barrier after FC1 orders it before FC2
            self._zero(I.gmem_address(fc2_out), tokens * Int32(s.hidden_size // 8), first, stride)

        if cutlass.const_expr(self.timeline):
            if tid == Int32(0):
                store_clocks(routing["c_tmp"], 0, (g0, c0))
                store_clocks(routing["c_tmp"], 1, I.read_timers())
                store_clocks(routing["c_tmp"], SM_SLOT, I.read_sm_ids())
        self.fc1._persistent(fc1_ops, smem, tid, cta, grid_x, tokens, fc1_first)
        # direct routes: while the other CTAs finish FC1, FC2's first route reads and its first tile's first
        # stages into L2 (on packed plans the same prefetch measured no faster, docs/benchmarks.md)
        fc2_first = None
        if cutlass.const_expr(self.fc2.direct):
            fc2_first = grid_barrier(barrier, tid, grid_x,
                                     lambda: self.fc2._first_tile_reads(fc2_ops, tid, cta, grid_x, routes))
        else:
            grid_barrier(barrier, tid, grid_x)
        if cutlass.const_expr(self.timeline):
            if tid == Int32(0):
                store_clocks(routing["c_tmp"], 6, I.read_timers())
        if cutlass.const_expr(not activates):
            v = Int64(first)
            total = Int64(routes) * Int64(s.intermediate_size // VECTOR)
            while v < total:
                self.act.apply_vector(fc1_out, activated, v)
                v += Int64(stride)
            grid_barrier(barrier, tid, grid_x)
        if cutlass.const_expr(s.expert_map):
            # rows of remote experts' routes are never written by FC2: zero them all first
            # (fc2_out may alias fc1_out, so only after the activation pass has read it)
            self._zero(I.gmem_address(fc2_out), routes * Int32(s.hidden_size // 8), first, stride)
            grid_barrier(barrier, tid, grid_x)
        if cutlass.const_expr(s.collect_amax):
            self._collect_amax(a, activated, routing, I.gmem_address(amax), layer, smem, tid, cta, grid_x, routes)
        self.fc2._persistent(fc2_ops, smem, tid, cta, grid_x, routes, fc2_first)
        if cutlass.const_expr(self.timeline):
            if tid == Int32(0):
                store_clocks(routing["c_tmp"], 11, I.read_timers())

    # ------------------------------------------------------------------ route packing

    @cute.jit
    def _pack_routes(self, ids: Int64, routes: Int32, num_experts: Int32, smem: Int32, tid: Int32):
        """Group the routes (flat topk_ids at `ids`) by expert into this CTA's shared-memory tables
        (FusedSpec.pack_layout), in route_pack.py's order: warp w takes the w-th contiguous segment of the
        routes and ranks each route among the earlier ones of its expert in the segment (a ballot per id
        bit: the lanes with the same expert), counting per (warp, expert); a scan over the experts' padded
        counts turns the counts into each (warp, expert)'s first slot; every route then lands at that slot
        plus its rank, so each expert's routes are in increasing route index.  Ids outside [0, num_experts)
        are dropped (num_experts <= pack_experts: the runtime checks it)."""
        s, lay = self.s, self.s.pack_layout
        warps, experts, block = self.threads // 32, lay.experts, s.moe_block_size
        steps = -(-PACK_MAX_ROUTES // (32 * warps))  # 32-route steps of a warp's segment, at most
        bits = max(1, (experts - 1).bit_length())
        lane = tid & Int32(31)
        warp = tid // Int32(32)
        hist_row = smem + Int32(lay.hist) + warp * Int32(4 * experts)
        i = tid
        while i < Int32(warps * experts):
            I.st_shared_i32(smem + Int32(lay.hist) + i * Int32(4), Int32(0))
            i += Int32(self.threads)
        seg = (routes + Int32(32 * warps - 1)) // Int32(32 * warps) * Int32(32)
        lo = warp * seg
        hi = cutlass.min(lo + seg, routes)
        expert = cute.make_rmem_tensor(steps, Int32)
        for u in cutlass.range_constexpr(steps):  # predicated loads, all in flight at once
            r = lo + Int32(32 * u) + lane
            expert[u] = ld_global_if_i32(ids + Int64(r) * Int64(4), Int32(r < hi), Int32(-1))
        for u in cutlass.range_constexpr(steps):
            if expert[u] < Int32(0) or expert[u] >= num_experts or expert[u] >= Int32(experts):
                expert[u] = Int32(-1)
        cute.arch.sync_threads()  # the counts are zero
        rank = cute.make_rmem_tensor(steps, Int32)
        below = Int32(cute.arch.lanemask_lt())
        for u in cutlass.range_constexpr(steps):
            e = expert[u]
            valid = cute.arch.vote_ballot_sync(e >= Int32(0))
            rank[u] = Int32(0)
            if valid != Int32(0):
                peers = same_id_lanes(e, valid, bits)
                ahead = Int32(cute.arch.popc(peers & below))
                count = Int32(0)
                if e >= Int32(0):
                    count = I.ld_shared_i32(hist_row + e * Int32(4))
                    rank[u] = count + ahead
                cute.arch.sync_warp()  # every equal lane has read the count before the first one moves it
                if e >= Int32(0) and ahead == Int32(0):
                    I.st_shared_i32(hist_row + e * Int32(4), count + Int32(cute.arch.popc(peers)))
                cute.arch.sync_warp()
        cute.arch.sync_threads()
        # experts [first, first + per_thread) of this thread: their padded sizes, scanned over the CTA
        per_thread = -(-experts // self.threads)
        first = tid * Int32(per_thread)
        mine = Int32(0)
        for j in cutlass.range_constexpr(per_thread):
            e = first + Int32(j)
            if e < Int32(experts):
                total = Int32(0)
                for w in cutlass.range_constexpr(warps):
                    total += I.ld_shared_i32(smem + Int32(lay.hist) + (Int32(w * experts) + e) * Int32(4))
                mine += (total + Int32(block - 1)) // Int32(block) * Int32(block)
        start = self._exclusive_scan(mine, smem + Int32(lay.sums), lane, warp)
        if tid == Int32(self.threads - 1):
            I.st_shared_i32(smem + Int32(lay.count), start + mine)
        for j in cutlass.range_constexpr(per_thread):
            e = first + Int32(j)
            if e < Int32(experts):
                slot = start
                for w in cutlass.range_constexpr(warps):  # counts -> each warp's first slot of e
                    at = smem + Int32(lay.hist) + (Int32(w * experts) + e) * Int32(4)
                    c = I.ld_shared_i32(at)
                    I.st_shared_i32(at, slot)
                    slot += c
                end = (slot - start + Int32(block - 1)) // Int32(block) * Int32(block) + start
                pad = slot
                while pad < end:  # the expert's last block: the sentinel after its routes
                    I.st_shared_i32(smem + Int32(lay.slots) + pad * Int32(4), routes)
                    pad += Int32(1)
                b = start // Int32(block)
                while b < end // Int32(block):
                    I.st_shared_i32(smem + Int32(lay.blocks) + b * Int32(4), e)
                    b += Int32(1)
                start = end
        cute.arch.sync_threads()  # the first slots are in place
        for u in cutlass.range_constexpr(steps):
            e = expert[u]
            if e >= Int32(0):
                slot = I.ld_shared_i32(hist_row + e * Int32(4)) + rank[u]
                I.st_shared_i32(smem + Int32(lay.slots) + slot * Int32(4), lo + Int32(32 * u) + lane)
        cute.arch.sync_threads()

    @cute.jit
    def _exclusive_scan(self, v: Int32, sums: Int32, lane: Int32, warp: Int32) -> Int32:
        """The CTA-wide exclusive prefix sum of one value per thread (`sums`: one shared-memory word per warp)."""
        x = warp_inclusive_sum(v, lane)
        if lane == Int32(31):
            I.st_shared_i32(sums + warp * Int32(4), x)
        cute.arch.sync_threads()
        prefix = Int32(0)
        for w in cutlass.range_constexpr(self.threads // 32):
            if Int32(w) < warp:
                prefix += I.ld_shared_i32(sums + Int32(4 * w))
        return prefix + x - v

    # ------------------------------------------------------------------ grid-wide passes

    @cute.jit
    def _zero(self, base: Int64, chunks: Int32, first: Int32, stride: Int32):
        """Zero `chunks` 16-byte chunks from `base`, grid-strided."""
        i = first
        zero = cutlass.Uint32(0)
        while i < chunks:
            I.st_global_v4_u32(base + Int64(i) * Int64(16), zero, zero, zero, zero)
            i += stride

    # ------------------------------------------------------------------ calibration

    @cute.jit
    def _collect_amax(self, a: cute.Pointer, activated: cute.Pointer, routing: dict, amax: Int64, layer: Int32, smem: Int32,
                      tid: Int32, cta: Int32, grid_x: Int32, routes: Int32):
        """amax[layer, e, 0] = max |FC1 input| and [.., 1] = max |FC2 input| over the routes of local expert e.

        CTAs take packed route blocks grid-strided; each block reduces its rows and
        merges into the table with red.max (non-negative floats order as integers).
        """
        s = self.s
        bs = Int32(s.moe_block_size)
        blocks = (I.ld_global_nc_i32(routing["route_count"]) + bs - Int32(1)) // bs
        b = cta
        while b < blocks:
            expert = I.ld_global_nc_i32(routing["block_experts"] + Int64(b) * Int64(4))
            # route packing only emits experts in [0, E) or -1; the upper bound costs nothing and keeps
            # the amax table in bounds whatever fills block_experts
            if expert >= Int32(0) and expert < routing["num_experts"]:
                in_max = Float32(0.0)
                act_max = Float32(0.0)
                for r in cutlass.range(s.moe_block_size):
                    route = I.ld_global_nc_i32(routing["route_indices"] + Int64(b * bs + Int32(r)) * Int64(4))
                    if route < routes:
                        in_max = self._row_amax(a, Int64(route // Int32(s.top_k)) * Int64(s.hidden_size),
                                                s.hidden_size, in_max, tid)
                        act_max = self._row_amax(activated, Int64(route) * Int64(s.intermediate_size),
                                                 s.intermediate_size, act_max, tid)
                slot = amax + (Int64(layer) * Int64(s.amax_experts) + Int64(expert)) * Int64(8)
                self._block_max_into(in_max, slot, smem, tid)
                self._block_max_into(act_max, slot + Int64(4), smem, tid)
            b += grid_x

    @cute.jit
    def _row_amax(self, base: cute.Pointer, offset: Int64, width: int, running: Float32, tid: Int32) -> Float32:
        """max(running, |row[c]|) over this thread's columns c = tid, tid + threads, ... of one row."""
        c = tid
        while c < Int32(width):
            x = cute.make_tensor(base + (offset + Int64(c)), cute.make_layout(1))
            running = I.fmax_f32(running, I.fabs_f32(x[0].to(Float32)))
            c += Int32(self.threads)
        return running

    @cute.jit
    def _block_max_into(self, value: Float32, addr: Int64, smem: Int32, tid: Int32):
        lane = tid & Int32(31)
        warp = tid // Int32(32)
        value = I.warp_reduce(value, "max")
        if lane == Int32(0):
            I.st_shared_f32(smem + warp * Int32(4), value)
        cute.arch.sync_threads()
        if warp == Int32(0):
            v = Float32(0.0)
            if lane < Int32(self.threads // 32):
                v = I.ld_shared_f32(smem + lane * Int32(4))
            v = I.warp_reduce(v, "max")
            if lane == Int32(0) and v > Float32(0.0):
                I.red_max_f32_nonnegative(addr, v)
        cute.arch.sync_threads()
