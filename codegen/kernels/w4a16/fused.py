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
from cuteaot.runtime.kernels.w4a16.fused_spec import FusedSpec
from cuteaot.runtime.types import DType

from ... import intrinsics as I
from ..activation import ActivationKernel
from ..common import after_prior_grids, grid_barrier, store_clocks
from .gemm import _Operands
from .wgmma import gemm_kernel


# Measurement switch (benchmarks/decode_timeline.py): decode kernels store a per-CTA timeline of both clocks in
# c_tmp, which their whole tiles leave unused: entry 0, after the prior-grid wait 1, FC1 tile 2-5 (routes read,
# first stage in, main loop done, stored), after the grid barrier 6, FC2 tile 7-10, exit 11.  Read while
# compiling and not a key fact: set it only to build a separate bundle for that script, never a served one.
TIMELINE = False


class W4A16FusedMoeKernel:
    def __init__(self, spec: FusedSpec):
        self.s = spec
        self.timeline = TIMELINE and spec.decode
        # the wgmma loop when the plan chose it for both phases; FC1's tile probes are slots 2-5, FC2's 7-10
        self.fc1 = gemm_kernel(spec.fc1_gemm, 2 if self.timeline else None)
        self.fc2 = gemm_kernel(spec.fc2_gemm, 7 if self.timeline else None)
        self.act = ActivationKernel(spec.activation_spec)
        self.threads = spec.threads
        self.elem = cutlass.BFloat16 if spec.dtype is DType.BF16 else cutlass.Float16

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
        # relu2, or the gated activation with gated_epilogue, is FC1's epilogue
        activates = not s.gated or bool(s.gated_epilogue)
        fc1_target = activated if activates else fc1_out
        fc1_ops = _Operands(a=I.gmem_address(a), qweight=I.gmem_address(w13), out=I.gmem_address(fc1_target),
                            scales=I.gmem_address(w13_scales), global_scale=I.gmem_address(w13_global_scale),
                            bias=I.gmem_address(w13_bias), **routing)
        fc2_ops = _Operands(a=I.gmem_address(activated), qweight=I.gmem_address(w2), out=I.gmem_address(fc2_out),
                            scales=I.gmem_address(w2_scales), global_scale=I.gmem_address(w2_global_scale),
                            bias=I.gmem_address(w2_bias), **routing)
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
        self.fc1._persistent(fc1_ops, smem, tid, cta, grid_x, tokens)
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
        self.fc2._persistent(fc2_ops, smem, tid, cta, grid_x, routes)
        if cutlass.const_expr(self.timeline):
            if tid == Int32(0):
                store_clocks(routing["c_tmp"], 11, I.read_timers())

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
