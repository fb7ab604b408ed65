"""CuTeDSL W4A16 grouped MoE GEMM (port of the seed's `W4A16GemmKernel`, packed NVFP4).

One persistent launch of grid_x CTAs covers route_blocks x n_tiles output
tiles, each tile_n wide and reduced over K in k-tiles of tile_k:

* full waves: while at least grid_x whole tiles remain, CTA c takes tiles
  c, c + grid_x, ... over the whole K;
* tail: the remaining tiles' k-iterations are split evenly over all CTAs
  (`iters` each), so a tile may be reduced by several CTAs ("split-K slices")
  that merge in order through `c_tmp` and a per-tile lock slot.  If the tail
  would leave most CTAs idle (<= 1/3 of a wave), one more full wave joins it.
  The mma.sync loop may take a few more k-iterations a CTA where its range then
  meets one tile fewer (`_aligned_iters`: a tile start and a merge cost more).
* M <= 8 (`moe_block_size == 8`): when every tile fits in the grid each CTA
  takes one whole tile and there is no split-K at all.

Files: this one holds the scheduler, the route metadata of a block and the
per-tile driver; w4a16/mainloop.py the pipeline, w4a16/epilogue.py the
reductions and stores.  Shapes and layouts: runtime/kernels/w4a16/gemm_spec.py and
docs/layouts.md.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import Float32, Int32, Int64, Uint32

from cuteaot.runtime.kernels.w4a16.gemm_spec import Epilogue, GemmSpec, Mainloop, Routes
from cuteaot.runtime.kernels.w4a16.geometry import ScaleFormat, split_range_forms, split_span_cost
from cuteaot.runtime.nf3 import SLAB_ROW_WORDS, X2_BASE
from cuteaot.runtime.types import DType

from ... import intrinsics as I
from ..activation import ActivationKernel
from ..common import after_prior_grids, store_clocks
from . import ablate
from .epilogue import EpilogueMixin
from .mainloop import MainloopMixin


NF3_SLAB_ROW_BYTES = 4 * SLAB_ROW_WORDS  # one slab (64 columns) of one 32-k NF3 row


class _Operands:
    """64-bit base addresses of the kernel operands and the expert count (read-only inside the kernel); with
    `shared_routes`, route_indices / block_experts / route_count are 32-bit shared-memory addresses."""

    def __init__(self, **addresses):
        self.__dict__.update(addresses)


class _Tile:
    """Per-tile thread offsets computed once before the main loop."""

    def __init__(self, **values):
        self.__dict__.update(values)


class W4A16GemmKernel(MainloopMixin, EpilogueMixin):
    def __init__(self, spec: GemmSpec, timeline_slot: int | None = None, shared_routes: bool = False):
        self.s = spec
        self.is_fp16 = spec.dtype is DType.FP16
        self.m8 = spec.moe_block_size == 8
        self.relu2 = spec.epilogue is Epilogue.RELU2
        # gated epilogue (wgmma loop): the activation kernel's own math on the tile's gate and up halves
        self.act = ActivationKernel(spec.activation_spec) if spec.epilogue.is_gated else None
        self.direct = spec.routes is Routes.DIRECT
        self.nf3 = spec.nf3
        self.scale_group = ScaleFormat(spec.scale_format).group_size
        self.timeline_slot = timeline_slot  # fused.TIMELINE: this phase's first timeline slot (None: no probes)
        # the fused kernel packed the routes into shared memory itself (FusedSpec.pack_experts)
        self.shared_routes = shared_routes
        assert not (shared_routes and self.direct), "direct routes are read from topk_ids"
        self.ablate = ablate.active()  # parts of the tile taken out (a measurement build only; ablate.py)
        assert not ("decode" in self.ablate and spec.modelopt), "the stored layout keeps its decode (ablate.py)"

    @cute.jit
    def __call__(self, a: cute.Pointer, qweight: cute.Pointer, out: cute.Pointer, scales: cute.Pointer,
                 global_scale: cute.Pointer, route_indices: cute.Pointer, block_experts: cute.Pointer,
                 route_count: cute.Pointer, topk_weights: cute.Pointer, bias: cute.Pointer, c_tmp: cute.Pointer,
                 locks: cute.Pointer, tokens: Int32, num_experts: Int32, stream):
        self.kernel(a, qweight, out, scales, global_scale, route_indices, block_experts, route_count, topk_weights,
                    bias, c_tmp, locks, tokens, num_experts).launch(
            grid=(1, 1, 1), block=[self.s.threads, 1, 1], smem=self.s.shared_bytes,
            min_blocks_per_mp=self.s.blocks_per_sm, stream=stream,
            # stated so CuTeDSL does not query a GPU; the runtime sets the carveout at load
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(self, a: cute.Pointer, qweight: cute.Pointer, out: cute.Pointer, scales: cute.Pointer,
               global_scale: cute.Pointer, route_indices: cute.Pointer, block_experts: cute.Pointer,
               route_count: cute.Pointer, topk_weights: cute.Pointer, bias: cute.Pointer, c_tmp: cute.Pointer,
               locks: cute.Pointer, tokens: Int32, num_experts: Int32):
        after_prior_grids(persistent=True)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        smem_ptr = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=16)
        ops = _Operands(
            a=I.gmem_address(a), qweight=I.gmem_address(qweight), out=I.gmem_address(out),
            scales=I.gmem_address(scales), global_scale=I.gmem_address(global_scale),
            route_indices=I.gmem_address(route_indices), block_experts=I.gmem_address(block_experts),
            route_count=I.gmem_address(route_count), topk_weights=I.gmem_address(topk_weights),
            bias=I.gmem_address(bias), c_tmp=I.gmem_address(c_tmp), locks=I.gmem_address(locks),
            num_experts=num_experts,
        )
        self._persistent(ops, I.shared_ptr_to_u32(smem_ptr), Int32(tidx), Int32(bidx), Int32(gdim), tokens)

    # ------------------------------------------------------------------ scheduler

    @cute.jit
    def _persistent(self, ops, smem: Int32, tid: Int32, cta: Int32, grid_x: Int32, tokens: Int32, preread=None):
        """This CTA's tiles, whole or split-K slices, one after another.  `preread` (direct routes): its first
        tile's route block, expert and router weight pair as `_first_tile_reads` loaded them, earlier."""
        s = self.s
        n_tiles = Int32(s.n_tiles)
        k_tiles = Int32(s.k_tiles)
        route_blocks, global_mn_tiles, tail_mn_tiles, full_grid_mn_iters, iters = self._schedule_tiles(
            ops, cta, grid_x, tokens)
        lock_slot = Int32(0)
        if tail_mn_tiles >= grid_x:
            lock_slot = cta
        else:
            lock_slot = (iters * cta) // k_tiles - Int32(1)

        in_tail = Int32(0)
        has_work = Int32(1)
        work_mn_tile = cta
        reduce_k_tile = Int32(0)
        route_block = Int32(0)
        n_tile = Int32(0)
        if iters == Int32(0) and full_grid_mn_iters == Int32(0):
            has_work = Int32(0)
        scheduled = Int32(0)  # ablate.TRACE: this CTA's tiles so far (the record a tile writes)

        while has_work != Int32(0):
            k_count = Int32(0)
            slice_count = Int32(1)
            slice_idx = Int32(0)
            if in_tail == Int32(0) and full_grid_mn_iters > Int32(0):
                route_block = work_mn_tile // n_tiles
                n_tile = work_mn_tile - route_block * n_tiles
                reduce_k_tile = Int32(0)
                k_count = k_tiles
                full_grid_mn_iters -= Int32(1)
            else:
                if in_tail == Int32(0):
                    in_tail = Int32(1)
                    tail_base = global_mn_tiles - tail_mn_tiles
                    start = iters * cta
                    work_mn_tile = start // k_tiles
                    reduce_k_tile = start - work_mn_tile * k_tiles
                    g = work_mn_tile + tail_base
                    route_block = g // n_tiles
                    n_tile = g - route_block * n_tiles
                if work_mn_tile < tail_mn_tiles and iters > Int32(0):
                    k_count = iters * (cta + Int32(1)) - (k_tiles * work_mn_tile + reduce_k_tile)
                    if k_count < Int32(0):
                        k_count = Int32(0)
                    if reduce_k_tile + k_count > k_tiles:
                        k_count = k_tiles - reduce_k_tile
                    if k_count > Int32(0):
                        first_boundary = iters * ((k_tiles * work_mn_tile + iters - Int32(1)) // iters)
                        if first_boundary <= k_tiles * (work_mn_tile + Int32(1)):
                            boundary_offset = first_boundary - k_tiles * work_mn_tile
                            slice_count = (k_tiles - boundary_offset + iters - Int32(1)) // iters
                            if boundary_offset > Int32(0):
                                slice_count += Int32(1)
                            boundary_delta = iters * cta - first_boundary
                            if boundary_delta < Int32(0):
                                slice_idx = slice_count - Int32(1)
                            else:
                                if boundary_offset == Int32(0) and boundary_delta == Int32(0):
                                    slice_idx = slice_count - Int32(1)
                                else:
                                    slice_idx = slice_count - Int32(1) - boundary_delta // iters
                                    if boundary_offset > Int32(0):
                                        slice_idx -= Int32(1)
                        if tail_mn_tiles >= grid_x:
                            if slice_count > Int32(1) and slice_idx == slice_count - Int32(1):
                                lock_slot += Int32(1)
                        else:
                            lock_slot += Int32(1)
                    else:
                        has_work = Int32(0)
                else:
                    has_work = Int32(0)

            if has_work != Int32(0) and k_count > Int32(0) and route_block < route_blocks:
                expert, pair = self._block_expert(ops, route_block, route_blocks, tokens, preread)
                # this thread's route of the block, loaded beside the expert rather than after it (one
                # dependent L2 round trip less before the tile's first copies)
                route = self._block_route(ops, tid, route_block)
                # Direct routes carry raw router ids (-1 for masked routes, anything from a buggy
                # caller): a route outside [0, E) is dropped, never used to index the weights.  Every
                # split-K slice of a tile reads the same id, so they all skip it and no lock is touched.
                if expert >= Int32(0) and expert < ops.num_experts:
                    if cutlass.const_expr(self.direct):  # (the wgmma loops serve packed routes only)
                        self._tile(ops, smem, tid, tokens, route_block, expert, route, n_tile, reduce_k_tile, k_count,
                                   slice_count, slice_idx, lock_slot, pair, record=scheduled)
                    else:
                        self._tile(ops, smem, tid, tokens, route_block, expert, route, n_tile, reduce_k_tile,
                                   k_count, slice_count, slice_idx, lock_slot, record=scheduled)

            if has_work != Int32(0):
                scheduled += Int32(1)
                if in_tail == Int32(0):
                    work_mn_tile += grid_x
                else:
                    reduce_k_tile = Int32(0)
                    work_mn_tile += Int32(1)
                    n_tile += Int32(1)
                    if n_tile == n_tiles:
                        n_tile = Int32(0)
                        route_block += Int32(1)

    @cute.jit
    def _block_expert(self, ops, route_block: Int32, route_blocks: Int32, tokens: Int32, preread):
        """(expert, router weight pair) of a route block; the pair is None on packed routes, which read
        their router weights per row.  Direct routes: the block's topk_ids entry and weight, or what
        `preread` loaded for it before the phase (the same for every n-tile of the block).  Packed: the
        block's expert, and for a block of a taller packing (GemmSpec.packing_block) its packing block's,
        -1 for a block of padding only (routes fill a packing block from its start)."""
        s = self.s
        expert = Int32(0)
        pair = None
        if cutlass.const_expr(self.direct):
            pair = Uint32(0)
            if cutlass.const_expr(preread is not None):
                if route_block == preread[0]:
                    expert = preread[1]
                    pair = preread[2]
                else:
                    expert, pair = self._direct_reads(ops, route_block, route_blocks)
            else:
                expert, pair = self._direct_reads(ops, route_block, route_blocks)
        elif cutlass.const_expr(s.packing_block is not None):
            expert = self._route_word(ops.block_experts, route_block // Int32(s.packing_ratio))
            first = self._route_word(ops.route_indices, route_block * Int32(s.moe_block_size))
            if first >= tokens * Int32(s.top_k):
                expert = Int32(-1)
        else:
            expert = self._route_word(ops.block_experts, route_block)
        return expert, pair

    @cute.jit
    def _schedule_tiles(self, ops, cta: Int32, grid_x: Int32, tokens: Int32):
        """(route blocks, m-n tiles, of them the split-K tail's, whole tiles a CTA takes before the tail, the
        tail's k-tiles a CTA) of this launch: whole tiles grid-strided while they fill every CTA, then the
        rest split over K (at most 1/3 of a wave on its own, else with one wave of whole tiles)."""
        s = self.s
        k_tiles = Int32(s.k_tiles)
        route_blocks = tokens * Int32(s.top_k)
        if cutlass.const_expr(not self.direct):
            route_blocks = self._route_word(ops.route_count, Int32(0)) // Int32(s.moe_block_size)
        global_mn_tiles = route_blocks * Int32(s.n_tiles)

        tail_mn_tiles = global_mn_tiles
        full_grid_mn_iters = Int32(0)
        one_tile_per_cta = Int32(0)
        if cutlass.const_expr(self.m8 and self.s.whole_tiles_m8):
            if global_mn_tiles <= grid_x:
                one_tile_per_cta = Int32(1)
        if one_tile_per_cta != Int32(0):
            tail_mn_tiles = Int32(0)
            full_grid_mn_iters = Int32(1)
        elif global_mn_tiles > grid_x:
            tail_mn_tiles = global_mn_tiles - (global_mn_tiles // grid_x) * grid_x
            if tail_mn_tiles * Int32(3) <= grid_x:
                tail_mn_tiles += grid_x
            full_grid_mn_iters = (global_mn_tiles - tail_mn_tiles) // grid_x

        iters = (k_tiles * tail_mn_tiles + grid_x - Int32(1)) // grid_x
        if cutlass.const_expr(s.mainloop is Mainloop.MMA_SYNC):
            if iters > Int32(0):
                iters = self._aligned_iters(iters)
        return route_blocks, global_mn_tiles, tail_mn_tiles, full_grid_mn_iters, iters

    @cute.jit
    def _direct_reads(self, ops, route_block: Int32, route_blocks: Int32):
        """Direct routes: the route's expert (its topk_ids entry) and router weight pair, loaded together (the
        weight does not wait for the expert)."""
        expert = I.ld_global_nc_i32(ops.route_indices + Int64(route_block) * Int64(4))
        pair = Uint32(0)
        if cutlass.const_expr(self.s.mul_topk_weights):
            pair = self._topk_pair(ops, route_block, route_blocks)
        return expert, pair

    @cute.jit
    def _first_tile(self, ops, cta: Int32, grid_x: Int32, tokens: Int32):
        """(route block, n-tile, first k-tile, route blocks) of this CTA's first tile of the launch `_persistent`
        will run, by its arithmetic; route block -1 where the CTA has none."""
        route_blocks, global_mn_tiles, tail_mn_tiles, full_grid_mn_iters, iters = self._schedule_tiles(
            ops, cta, grid_x, tokens)
        n_tiles = Int32(self.s.n_tiles)
        k_tiles = Int32(self.s.k_tiles)
        block = Int32(-1)
        work = cta
        k0 = Int32(0)
        if full_grid_mn_iters > Int32(0):
            block = cta // n_tiles
        elif iters > Int32(0):
            work = iters * cta // k_tiles
            k0 = iters * cta - work * k_tiles
            work += global_mn_tiles - tail_mn_tiles
            block = work // n_tiles
        if block >= route_blocks:
            block = Int32(-1)
        return block, work - block * n_tiles, k0, route_blocks

    @cute.jit
    def _first_tile_reads(self, ops, tid: Int32, cta: Int32, grid_x: Int32, tokens: Int32):
        """Direct routes: (route block, expert, router weight pair) of this CTA's first tile of a launch
        `_persistent` will run, loaded now (route block -1 and nothing read where the CTA has none), and that
        tile's first stages brought into L2 (`_prefetch_first_stages`).  The fused kernel calls it while it
        waits at the grid barrier before FC2: the barrier's acquire empties L1, so these reads would
        otherwise be a round trip to L2 after it, and the first copies one to HBM."""
        assert self.direct, "packed routes are read per tile"
        block, n_tile, k0, route_blocks = self._first_tile(ops, cta, grid_x, tokens)
        expert, pair = self._reads_if_any(ops, block, route_blocks)
        if expert >= Int32(0) and expert < ops.num_experts:
            self._prefetch_first_stages(ops, tid, expert, n_tile, k0)
        return block, expert, pair

    @cute.jit
    def _reads_if_any(self, ops, block: Int32, route_blocks: Int32):
        """`_direct_reads` of route block `block`, or (-1, 0) and nothing read for block -1 (no tile)."""
        expert = Int32(-1)
        pair = Uint32(0)
        if block >= Int32(0):
            expert, pair = self._direct_reads(ops, block, route_blocks)
        return expert, pair

    def prefetches_first_stages(self) -> bool:
        """`_prefetch_first_stages` has something to do: the mma.sync loop on the packed NVFP4 layout with whole N
        and K tiles, not gated (a tile's 16-k weight row is one contiguous run of tile_n / 2 bytes, its scale
        row one of tile_n bytes)."""
        s = self.s
        return (s.mainloop is Mainloop.MMA_SYNC and self.scale_group == 16
                and not (s.modelopt or s.nf3 or s.n_tail or s.k_tail or s.epilogue.is_gated))

    @cute.jit
    def _prefetch_first_stages(self, ops, tid: Int32, expert: Int32, n_tile: Int32, k0: Int32):
        """Bring the weights and scales of a tile's first `stages - 1` k-tiles (those `_prefetch_initial` copies
        first, from k-tile k0) into L2, without waiting: one thread a 16-k row of weights, one a row of scales
        (nothing where `prefetches_first_stages` is False)."""
        s = self.s
        if cutlass.const_expr(self.prefetches_first_stages()):
            rows = (s.stages - 1) * s.k_blocks  # 16-k rows, each one weight run and (group 16) one scale run
            if tid < Int32(2 * rows):
                r = tid % Int32(rows)
                row = k0 * Int32(s.k_blocks) + r
                if row < Int32(s.k // 16):
                    if tid < Int32(rows):
                        run = (Int64(s.n * s.k // 32) * Int64(expert) + Int64(row) * Int64(s.n // 2)
                               + Int64(s.b_sh_stride) * Int64(n_tile))
                        I.prefetch_l2_bulk(ops.qweight + run * Int64(16), s.b_sh_stride * 16)
                    else:
                        run = (Int64(s.n * s.k // 256) * Int64(expert) + Int64(row) * Int64(s.n // 16)
                               + Int64(s.s_sh_stride) * Int64(n_tile))
                        I.prefetch_l2_bulk(ops.scales + run * Int64(16), s.s_sh_stride * 16)

    @cute.jit
    def _guessed_first_reads(self, ops, cta: Int32, tokens: Int32):
        """Direct routes: `_first_tile_reads` for the launch's first phase, without its scheduling arithmetic:
        the route block of the CTA's first whole tile (cta / n_tiles; `_persistent` checks it and reads
        again where the CTA's first tile is another), so the reads start right after the prior-grid wait."""
        assert self.direct, "packed routes are read per tile"
        route_blocks = tokens * Int32(self.s.top_k)
        block = cta // Int32(self.s.n_tiles)
        if block >= route_blocks:
            block = Int32(-1)
        expert, pair = self._reads_if_any(ops, block, route_blocks)
        return block, expert, pair

    @cute.jit
    def _aligned_iters(self, iters: Int32) -> Int32:
        """The tail's k-tiles per CTA: `iters` (the fewest that cover it) or more, where the CTAs' ranges then
        meet fewer tiles, each of which costs a tile start and a split-K merge besides its k-tiles
        (runtime/kernels/w4a16/geometry.py `aligned_split_iters`, the same choice in Python, says how);
        the CTAs past the tail's end then have nothing to do.
        """
        k = self.s.k_tiles
        span = Int32(split_span_cost(self.s.tile_k))
        best = iters
        best_cost = iters + span * (iters // Int32(k) + Int32(2))
        for d in split_range_forms(k):  # unrolled: one candidate per divisor of k_tiles
            q = (iters - Int32(d) + Int32(k - 1)) // Int32(k)  # the smallest q with q k + d >= iters
            cost = q * Int32(k) + Int32(d) + span * (q + Int32(1))
            if cost < best_cost:
                best = q * Int32(k) + Int32(d)
                best_cost = cost
        return best

    # ------------------------------------------------------------------ barriers

    @cute.jit
    def _sync(self):
        """A barrier over the threads that compute tiles: the whole CTA here (the producer-warpgroup
        kernel, wgmma_ws.py, leaves its producer out)."""
        cute.arch.sync_threads()

    @cute.jit
    def _sync_count(self, flag: Int32) -> Int32:
        """`_sync` that returns how many of its threads passed a non-zero `flag`."""
        return I.sync_threads_count(flag)

    # ------------------------------------------------------------------ block metadata

    @cute.jit
    def _topk_weight(self, ops, route: Int32, routes: Int32) -> Float32:
        """The route's router weight (route clamped to 0 for padding rows)."""
        safe = route
        if route >= routes:
            safe = Int32(0)
        return I.ld_global_nc_f32(ops.topk_weights + Int64(safe) * Int64(4))

    @cute.jit
    def _weight_pair(self, w: Float32) -> Uint32:
        """A router weight as a dtype pair."""
        if cutlass.const_expr(self.is_fp16):
            return I.f32_to_f16x2_broadcast(w)
        return I.f32_to_bf16x2_broadcast(w)

    @cute.jit
    def _topk_pair(self, ops, route: Int32, routes: Int32) -> Uint32:
        """The route's router weight as a dtype pair (route clamped to 0 for padding rows)."""
        return self._weight_pair(self._topk_weight(ops, route, routes))

    def defers_router_weight(self) -> bool:
        """Packed routes on the mma.sync loop: a block's router weights are loaded with its routes but stored
        to shared memory only once the tile's first copies are issued (`_prefetch_initial`), so the copies do
        not wait for that round trip; the epilogue reads them long after."""
        return not self.direct and self.s.mul_topk_weights and self.s.mainloop is Mainloop.MMA_SYNC

    @cute.jit
    def _block_route(self, ops, tid: Int32, route_block: Int32) -> Int32:
        """Packed routes: thread tid's route index in the block (tid < moe_block_size; 0 elsewhere and for
        direct routes, whose block is its route)."""
        route = Int32(0)
        if cutlass.const_expr(not self.direct):
            assert self.s.moe_block_size <= self.s.threads, "one thread per route of the block"
            if tid < Int32(self.s.moe_block_size):
                route = self._route_word(ops.route_indices, route_block * Int32(self.s.moe_block_size) + tid)
        return route

    @cute.jit
    def _route_word(self, table, index: Int32) -> Int32:
        """Word `index` of a route-packing table (route_indices, block_experts, route_count): from global
        memory, or from the fused kernel's shared-memory packing (`shared_routes`)."""
        if cutlass.const_expr(self.shared_routes):
            return I.ld_shared_i32(table + index * Int32(4))
        return I.ld_global_nc_i32(table + Int64(index) * Int64(4))

    @cute.jit
    def _read_block(self, ops, smem: Int32, tid: Int32, route_block: Int32, route: Int32, tokens: Int32,
                    pair=None) -> Int32:
        """Stage the block's route indices (packed: `route`, this thread's, from `_block_route`), source rows
        and router weights (direct: `pair`, from `_direct_reads`); return its valid row count."""
        s = self.s
        routes = tokens * Int32(s.top_k)
        route_sh = smem + Int32(s.sh_route_off * 16)
        src_sh = smem + Int32(s.sh_rd_route_off * 16)
        topk_sh = smem + Int32(s.sh_topk_off * 16)
        valid = Int32(1)
        if cutlass.const_expr(self.direct):
            if tid == Int32(0):
                idx = route_block
                I.st_shared_i32(route_sh, idx)
                I.st_shared_i32(src_sh, idx // Int32(s.top_k))
                if cutlass.const_expr(s.mul_topk_weights):
                    assert pair is not None, "direct routes: the router weight is read beside the expert"
                    I.st_shared_u32(topk_sh, pair)
            self._sync()
        else:
            # one route per thread, already in a register; the barrier that publishes them also counts
            # the valid ones (bar.red.popc)
            in_block = Int32(0)
            if tid < Int32(s.moe_block_size):
                idx = route
                I.st_shared_i32(route_sh + tid * Int32(4), idx)
                I.st_shared_i32(src_sh + tid * Int32(4), idx // Int32(s.top_k))
                if cutlass.const_expr(s.mul_topk_weights and not self.defers_router_weight()):
                    I.st_shared_u32(topk_sh + tid * Int32(4), self._topk_pair(ops, idx, routes))
                if idx < routes:
                    in_block = Int32(1)
            valid = self._sync_count(in_block)
        return valid

    @cute.jit
    def _source_slab(self, n_tile: Int32, slab: Int32) -> Int32:
        """The weight slab (64 columns) that slab `slab` of tile `n_tile` holds: the tile's own, or for a
        gated epilogue, the tile's first half from the gate half of W13 and its second from the up half."""
        slabs = self.s.tile_n // 64
        if cutlass.const_expr(self.s.epilogue.is_gated):
            half = slabs // 2
            return n_tile * Int32(half) + slab % Int32(half) + (slab // Int32(half)) * Int32(self.s.n // 128)
        return n_tile * Int32(slabs) + slab

    @cute.jit
    def _slab_column(self, n_tile: Int32, col: Int32, per_slab: int) -> Int32:
        """Column `col` of tile `n_tile` in a weight-side array with `per_slab` entries per 64-column
        slab (int4 of a packed or NF3 row, scale int4, stored rows), read from the slab `_source_slab`
        names."""
        return self._source_slab(n_tile, col // Int32(per_slab)) * Int32(per_slab) + col % Int32(per_slab)

    @cute.jit
    def _split_scale_index(self, expert: Int32, slab: Int32) -> Int64:
        """split_global_scale: the (E, 2) [gate, up] global scale of weight slab `slab` (64 columns)."""
        return Int64(expert) * Int64(2) + Int64((slab * Int32(64)) // Int32(self.s.n // 2))

    @cute.jit
    def _stored_row(self, n_tile: Int32, r: Int32) -> Int32:
        """modelopt: the stored weight row of tile row r (its slab as `_source_slab` says, W13 stored up
        rows first rotated by n_rotation)."""
        row = self._slab_column(n_tile, r, 64)
        if cutlass.const_expr(self.s.n_rotation is not None):
            row = (row + Int32(self.s.n_rotation)) % Int32(self.s.n)
        return row

    @cute.jit
    def _bias_row(self, ops, expert: Int32) -> Int64:
        """Address of the expert's bias row (its 16-byte chunk c at + 16 c); unused without bias."""
        return ops.bias + Int64(expert) * Int64(self.s.bias_width * 2)

    # ------------------------------------------------------------------ one tile

    @cute.jit
    def _plan_modelopt_reads(self, t, smem: Int32, expert: Int32, n_tile: Int32, warp: Int32, lane: Int32):
        """modelopt: the tile's first stored weight row, and this lane's shared-memory read addresses.

        Warp (wr = warp_row, wn) consumes the 32-k slice wr (chunk wr of each stored row) of columns
        64 wn ..: ldmatrix matrix j = lane // 8 of column half kk reads rows 64 wn + 32 kk + 8 j + lane % 8,
        so lane (g, t) receives bytes 4t .. 4t + 3 (k = 8t .. 8t + 7 of the slice) of column 8b + g.
        Its codes lie in 16-k group 2 wr + t // 2 of the stage: that byte of each column's scale word."""
        s = self.s
        t.expert = expert
        first = n_tile * Int32(s.tile_n)
        if cutlass.const_expr(s.n_rotation is not None):
            first = (first + Int32(s.n_rotation)) % Int32(s.n)
        t.src_n0 = first
        wn = warp % Int32(s.n_warps)
        wr = warp // Int32(s.n_warps)
        g = lane // Int32(4)
        quad = lane % Int32(4)
        row = Int32(64) * wn + Int32(8) * (lane // Int32(8)) + lane % Int32(8)
        t.b_rd = smem + (Int32(s.sh_b_off) + row * Int32(s.modelopt_chunks) + (wr ^ self._modelopt_b_swizzle(row))) * Int32(16)
        group = Int32(2) * wr + quad // Int32(2)
        scale_bytes = s.tile_k // 16  # per stored row and stage
        t.s_rd = (smem + Int32(s.sh_s_off * 16) + (Int32(64) * wn + g) * Int32(scale_bytes)
                  + Int32(4) * (group // Int32(4)))
        t.s_sel = I.e4m3_pairs_selector(group % Int32(4))
        t.a_mo = smem + self._a_swizzle(g * Int32(s.a_sh_stride) + Int32(4) * wr + quad) * Int32(16)

    @cute.jit
    def _tile(self, ops, smem: Int32, tid: Int32, tokens: Int32, route_block: Int32, expert: Int32, route: Int32,
              n_tile: Int32, k_start: Int32, k_count: Int32, slice_count: Int32, slice_idx: Int32, lock_slot: Int32,
              pair=None, before_epilogue=None, record=None):
        """One output tile over k-tiles [k_start, k_start + k_count): main loop, fold, split-K merge, epilogue.

        `before_epilogue` (the micro kernel: its first FC2 loads): called once the main loop is done, before the
        accumulators are folded and stored; _tile returns what it returns.  `record`: the tile's number in
        this CTA's schedule (ablate.TRACE, which only the warpgroup-MMA tile records)."""
        s = self.s
        scale_index = Int64(expert)
        if cutlass.const_expr(bool(s.split_global_scale) and s.epilogue.is_gated):
            # (E, 2): [gate, up], by the half this warp's 64 columns come from (the warps that stage them)
            slab = self._source_slab(n_tile, (tid // Int32(32)) % Int32(s.n_warps))
            scale_index = self._split_scale_index(expert, slab)
        elif cutlass.const_expr(s.split_global_scale):  # (E, 2): [gate, up], by the half of the tile's first slab
            scale_index = self._split_scale_index(expert, n_tile * Int32(s.tile_n // 64))
        global_scale = I.ld_global_nc_f32(ops.global_scale + scale_index * Int64(4))
        valid_rows = self._read_block(ops, smem, tid, route_block, route, tokens, pair)
        self._stamp(ops, tid, 0)

        warp = tid // Int32(32)
        lane = tid & Int32(31)
        a_row = tid // Int32(s.a_sh_stride)
        lanes_per_row = 8 if self.m8 else 16
        if cutlass.const_expr(s.nf3 and s.epilogue.is_gated):  # the expert's first 32-k row (slabs: _plan_staging)
            b_gl_rd = Int64(s.nf3_expert_int4) * Int64(expert)
        elif cutlass.const_expr(s.nf3):  # the tile's slice of the expert's first 32-k row (int4)
            b_gl_rd = Int64(s.nf3_expert_int4) * Int64(expert) + Int64(s.nf3_tile_row_int4) * Int64(n_tile)
        elif cutlass.const_expr(s.epilogue.is_gated):
            # the int4 column of this thread's copies (32 per 64-column slab) in its source slab
            b_gl_rd = (Int64(s.n * s.k // 32) * Int64(expert)
                       + Int64((tid // Int32(s.b_sh_stride)) * Int32(s.n // 2)
                               + self._slab_column(n_tile, tid % Int32(s.b_sh_stride), 32)))
        else:
            b_gl_rd = (Int64(s.n * s.k // 32) * Int64(expert) + Int64(s.b_sh_stride) * Int64(n_tile)
                       + Int64((tid // Int32(s.b_sh_stride)) * Int32(s.n // 2) + tid % Int32(s.b_sh_stride)))
        t = _Tile(
            n_tile=n_tile,
            a_gl_rd_row=a_row,
            a_gl_rd_col0=tid - a_row * Int32(s.a_sh_stride),
            a_sh_wr=Int32(s.a_sh_stride) * a_row + (tid - a_row * Int32(s.a_sh_stride)),
            b_gl_rd=b_gl_rd,
            scales_base=Int64(s.n * s.k // (16 * self.scale_group)) * Int64(expert),
        )
        if cutlass.const_expr(self.defers_router_weight()):  # this thread's route's weight, for _prefetch_initial
            mine = tid < Int32(s.moe_block_size)
            weight = Float32(0.0)
            if mine:
                weight = self._topk_weight(ops, route, tokens * Int32(s.top_k))
            t.router_weight_mine = mine
            t.router_weight = weight
            t.router_weight_sh = smem + Int32(s.sh_topk_off * 16) + tid * Int32(4)
        # Shared-memory read addresses of this thread, hoisted out of the main loop (stage, row and
        # MMA row block only add constants to them): B words, scale pairs, swizzled A rows.
        warp_row = warp // Int32(s.n_warps)  # which K slice of the tile this warp consumes
        b_sh_rd = tid + (tid // Int32(s.b_sh_stride)) * Int32(s.b_sh_stride * (s.b_sh_wr_iters - 1))
        s_sh_rd = Int32(8) * (warp % Int32(s.n_warps)) + lane // Int32(4)
        a_sh_rd = (Int32(s.a_sh_stride) * (lane % Int32(lanes_per_row)) + lane // Int32(lanes_per_row)
                   + Int32(2 * s.b_sh_wr_iters) * warp_row)
        if cutlass.const_expr(s.modelopt):
            self._plan_modelopt_reads(t, smem, expert, n_tile, warp, lane)
        elif cutlass.const_expr(s.nf3):
            # this warp's slab of its 32-k row: lane words (x0, x1) of row kk at + 256 kk + 8 lane,
            # x2 at + 512 + 128 kk + 4 lane (runtime/nf3.py); one scale row per 32-k row
            slab = (smem + Int32(s.sh_b_off * 16) + warp_row * Int32(s.nf3_tile_row_int4 * 16)
                    + (warp % Int32(s.n_warps)) * Int32(NF3_SLAB_ROW_BYTES))
            t.b_rd = slab + lane * Int32(8)
            t.b_rd2 = slab + Int32(4 * X2_BASE) + lane * Int32(4)
            t.s_rd = smem + Int32(s.sh_s_off * 16) + (s_sh_rd + Int32(2 * s.s_sh_stride) * warp_row) * Int32(8)
        else:
            t.b_rd = smem + b_sh_rd * Int32(16)
            t.s_rd = (smem + Int32(s.sh_s_off * 16)
                      + (s_sh_rd + Int32(s.b_sh_wr_iters * 2 * s.s_sh_stride) * warp_row) * Int32(8))
        t.a_rd = [smem + self._a_swizzle(Int32(2 * kk) + a_sh_rd) * Int32(16) for kk in range(s.b_sh_wr_iters)]
        if cutlass.const_expr(self.m8):
            acc = cute.make_rmem_tensor((4, 4), Float32)
        else:
            acc = cute.make_rmem_tensor((s.m_blocks, 4, 2, 4), Float32)
        acc.fill(0.0)
        self._mainloop(ops, t, smem, tid, acc, k_start, k_count, valid_rows)
        self._stamp(ops, tid, 2)
        early = None
        if cutlass.const_expr(before_epilogue is not None):
            early = before_epilogue()
        self._fold_partials(acc, smem, tid)
        if slice_count > Int32(1):
            self._merge_split_k(ops, acc, tid, valid_rows, lock_slot, slice_idx, slice_count)
        if cutlass.const_expr("epilogue" in self.ablate):
            values = ([acc[jj, i] for jj in range(4) for i in range(4)] if self.m8 else
                      [acc[mb, jj, h, i] for mb in range(s.m_blocks) for jj in range(4) for h in range(2)
                       for i in range(4)])
            self._keep_alive(ops, tid, values)
        elif slice_idx == slice_count - Int32(1):
            self._store_tile(ops, acc, smem, tid, n_tile, valid_rows, global_scale, self._bias_row(ops, expert))
        self._stamp(ops, tid, 3)
        return early

    @cute.jit
    def _keep_alive(self, ops, tid: Int32, values: list):
        """ablate "epilogue": the accumulators' sum feeds a store no finite sum takes, so every MMA stays live."""
        total = Float32(0.0)
        for v in values:
            total = total + v
        if total == Float32(-1.0e38):
            I.st_global_v4_f32(ops.c_tmp + Int64(tid) * Int64(16), total, total, total, total)

    @cute.jit
    def _trace(self, ops, tid: Int32, record: Int32, point: cutlass.Constexpr[int]):
        """ablate.TRACE: thread 0 stores both clocks at `point` (0-3) of tile record `record`, and at point 0
        its SM."""
        if cutlass.const_expr(ablate.TRACE):
            if tid == Int32(0) and record < Int32(ablate.TRACE_TILES):
                cta, _, _ = cute.arch.block_idx()
                phase = 1 if self.s.mul_topk_weights else 0
                index = (Int64(phase * ablate.TRACE_CTAS) + Int64(cta)) * Int64(ablate.TRACE_TILES) + Int64(record)
                at = ops.c_tmp + Int64(ablate.TRACE_OFFSET) + index * Int64(16 * ablate.TRACE_SLOTS)
                if cutlass.const_expr(point == 0):
                    I.st_global_v2_i64(at, *I.read_sm_ids())
                I.st_global_v2_i64(at + Int64(16 * (point + 1)), *I.read_timers())

    @cute.jit
    def _stamp(self, ops, tid: Int32, event: cutlass.Constexpr[int]):
        """fused.TIMELINE: thread 0 stores both clocks in slot timeline_slot + event of its CTA's record in c_tmp
        (decode plans only: their whole tiles leave c_tmp unused)."""
        if cutlass.const_expr(self.timeline_slot is not None):
            if tid == Int32(0):
                store_clocks(ops.c_tmp, self.timeline_slot + event, I.read_timers())
