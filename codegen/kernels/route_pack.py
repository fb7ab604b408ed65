"""CuTeDSL route-pack kernels: group the top-k routes by expert, deterministically.

The contract (outputs, sentinel, order) is documented in
`cuteaot.runtime.kernels.route_pack`.  The seed imported this step from a Triton
kernel of its origin project; this is our own design.

Ownership.  CTA c owns the routes [c * chunk, (c + 1) * chunk) (the single stage:
all of them).  Inside a CTA, warp w owns a contiguous segment of the chunk and
walks it 32 routes (one step) at a time, in order:

    chunk c:   | warp 0 segment | warp 1 segment | ... | warp 15 segment |
    warp w, step i:  lane l holds route seg_start + 32 i + l

A warp loads BATCH steps' expert ids before it processes them, so their memory
latencies overlap (the single stage loads its only batch once and reuses it for
counting and scattering).

Counting without atomics.  In each step one ballot per bit of the expert id gives
every lane the mask of lanes holding the same expert (a warp "multisplit"); the
lowest of them (no equal lane below it) adds the popcount to the warp's private
row `hist[w, e]` in shared memory.  Steps in which no lane holds a route are skipped.  Only one
lane of one warp ever writes a given entry, so plain loads/stores suffice.

Slot assignment.  A scan turns the counts into cursors: the first slot of
(warp w of chunk c, expert e) is

    start[e] + sum_{c' < c} count[c', e] + sum_{w' < w} count_c[w', e]

with start[e] the exclusive prefix of the experts' padded sizes.  The multi stage
publishes each chunk's counts, meets every CTA at a grid barrier (`common.grid_barrier`,
on the workspace's first word), and then every CTA reads all chunks' counts of
its experts (one round of loads) to form its own cursors and the starts.  Scattering
then repeats the walk: a lane's slot is its cursor plus the number of equal lanes
below it, and the lowest lane advances the cursor.  So routes of one expert land
in increasing route index however the hardware schedules warps or CTAs.

Blocks and padding (slots that never receive a route, so no ordering with the
scatter is needed; each kind of store is spread so that a warp's stores coalesce):
    block_expert_ids[j]  thread per block: binary search of the block's first slot
                         in the expert ends (shared memory); -1 past the count;
    expert tails         warp per expert: slots [fill[e], end[e]) get the sentinel;
    past the count       thread per slot: [count, capacity) gets the sentinel.
On the multi-CTA path CTA c takes every ctas-th share of each.

Out-of-range ids (outside [0, num_experts), before or after the expert map) are
dropped; every global store is bounds-checked against the capacities given.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import Int32, Int64, T, dsl_user_op
from cutlass.memory import SmemAllocator

from cuteaot.runtime.kernels.route_pack import (
    BARRIER_WORDS,
    MAX_EXPERTS,
    MULTI_MAX_CHUNKS,
    SINGLE_CTA_MAX_ROUTES,
    SMEM_BYTES,
    THREADS,
    WARPS,
    IdsDType,
    RoutePackSpec,
    RouteStage,
)

from .. import intrinsics as I
from .common import after_prior_grids, fake_arguments, grid_barrier

__all__ = ["RoutePackKernel", "build", "SMEM_BYTES", "ld_global_if_i32", "same_id_lanes",
           "warp_inclusive_sum"]  # SMEM_BYTES: the build records it per kernel

BATCH = 8  # steps (32 routes) a warp loads per batch; the single stage's routes fit in one
SEARCH_STEPS = MAX_EXPERTS.bit_length() - 1  # binary search over the expert ends
assert THREADS == MAX_EXPERTS, "the scan gives each thread one expert"
assert MAX_EXPERTS == 1 << SEARCH_STEPS, "the binary search halves a power of two"
assert SINGLE_CTA_MAX_ROUTES <= BATCH * THREADS, "the single stage holds all its routes in one batch"


@dsl_user_op
def ld_global_if_i32(address: Int64, pred: Int32, fallback: Int32, *, l2_only: bool = False, loc=None,
                     ip=None) -> Int32:
    """`@p ld.global.b32`: the value at `address` where pred != 0, else `fallback`; with `l2_only`,
    `ld.global.cg` (data other CTAs of this launch wrote: never from this SM's L1).

    Predicated instead of branched so that a batch of loads is issued back to back;
    emitted with side effects because LLVM otherwise sinks a load into the branch
    of its only use, which serialises the latencies again.
    """
    op = "ld.global.cg" if l2_only else "ld.global"
    ptx = "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\nmov.b32 $0, $3;\n@p " + op + ".b32 $0, [$1];\n}"
    args = [Int64(address).ir_value(loc=loc, ip=ip), Int32(pred).ir_value(loc=loc, ip=ip),
            Int32(fallback).ir_value(loc=loc, ip=ip)]
    return Int32(llvm.inline_asm(T.i32(), args, ptx, "=r,l,r,r", has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def ld_global_if_i64(address: Int64, pred: Int32, fallback: Int64, *, loc=None, ip=None) -> Int64:
    """`@p ld.global.b64`; see `ld_global_if_i32`."""
    ptx = "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\nmov.b64 $0, $3;\n@p ld.global.b64 $0, [$1];\n}"
    args = [Int64(address).ir_value(loc=loc, ip=ip), Int32(pred).ir_value(loc=loc, ip=ip),
            Int64(fallback).ir_value(loc=loc, ip=ip)]
    return Int64(llvm.inline_asm(T.i64(), args, ptx, "=l,l,r,l", has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def same_id_lanes(e: Int32, valid: Int32, bits: cutlass.Constexpr[int]) -> Int32:
    """Mask of the lanes holding the same id as this lane (a "multisplit"; meaningful for e >= 0, ids
    below 2**bits), among `valid` (the lanes with e >= 0): one ballot per bit of the id, narrowing `valid`.

    This replaces `match.any.sync`, whose latency grows with the number of distinct values
    in the warp: on the H200, 512 tokens x top-8 of 128 experts pack in 8.9 us
    instead of 11.9 us, 65536 x 8 of 256 in 24.5 us instead of 34.5 us (only
    routing onto very few experts, e.g. 8, is faster with `match.any`).
    """
    peers = valid
    for bit in cutlass.range_constexpr(bits):
        mine = (e >> bit) & Int32(1)
        ones = cute.arch.vote_ballot_sync(mine != Int32(0))
        peers = peers & ~(ones ^ -mine)  # lanes whose bit equals mine
    return peers


@cute.jit
def warp_inclusive_sum(v: Int32, lane: Int32) -> Int32:
    """The sum of `v` over this lane and the lanes below it (five shuffles up); the block scans of this
    kernel and of the fused kernel's in-kernel packing build on it."""
    x = v
    for d in cutlass.range_constexpr(5):
        y = cute.arch.shuffle_sync_up(x, 1 << d)
        if lane >= Int32(1 << d):
            x = x + y
    return x


class _Operands:
    """The kernel's global tensors and scalars, grouped so helpers take one argument."""

    def __init__(self, ids_address, emap_address, ids, emap, packed, block_ids, count, ws, routes, num_experts,
                 has_map, block_size, cap_slots, cap_blocks, chunk_routes, num_chunks):
        self.ids_address, self.emap_address = ids_address, emap_address  # Int64, for predicated loads
        self.ids, self.emap, self.packed, self.block_ids, self.count, self.ws = ids, emap, packed, block_ids, count, ws
        self.routes, self.num_experts, self.has_map, self.block_size = routes, num_experts, has_map, block_size
        self.cap_slots, self.cap_blocks, self.chunk_routes, self.num_chunks = cap_slots, cap_blocks, chunk_routes, num_chunks

    def counts_at(self, chunk):  # workspace offset of a chunk's counts, after the barrier words
        return Int32(BARRIER_WORDS) + chunk * self.num_experts


class _Shared:
    """Shared-memory tables (SMEM_BYTES in all): per-warp counts / cursors, expert ends and fills."""

    def __init__(self):
        smem = SmemAllocator()
        self.hist = smem.allocate_tensor(Int32, cute.make_layout(WARPS * MAX_EXPERTS), byte_alignment=16)
        self.ends = smem.allocate_tensor(Int32, cute.make_layout(MAX_EXPERTS), byte_alignment=16)
        self.fills = smem.allocate_tensor(Int32, cute.make_layout(MAX_EXPERTS), byte_alignment=16)
        self.sums = smem.allocate_tensor(Int32, cute.make_layout(WARPS), byte_alignment=16)


class RoutePackKernel:
    """Compile-time facts in __init__; __call__ launches; `kernel` is device code."""

    def __init__(self, spec: RoutePackSpec):
        self.stage = spec.stage
        self.ids_type = Int64 if spec.ids_dtype is IdsDType.INT64 else Int32

    @cute.jit
    def __call__(
        self,
        topk_ids: cute.Pointer,
        expert_map: cute.Pointer,
        packed_route_indices: cute.Pointer,
        block_expert_ids: cute.Pointer,
        packed_route_count: cute.Pointer,
        workspace: cute.Pointer,
        routes: Int32,
        num_experts: Int32,
        has_expert_map: Int32,
        block_size: Int32,
        capacity_slots: Int32,
        capacity_blocks: Int32,
        chunk_routes: Int32,
        num_chunks: Int32,
        stream,
    ):
        self.kernel(
            topk_ids, expert_map, packed_route_indices, block_expert_ids, packed_route_count, workspace,
            routes, num_experts, has_expert_map, block_size, capacity_slots, capacity_blocks, chunk_routes, num_chunks,
        ).launch(grid=(1, 1, 1), block=[THREADS, 1, 1], stream=stream)

    # -- walking a warp's segment ---------------------------------------------------------

    @cute.jit
    def _segment(self, op: _Operands, cta: Int32):
        """This warp's routes [lo, hi) and its step count (the same for every warp)."""
        seg = (op.chunk_routes + Int32(THREADS - 1)) // Int32(THREADS) * Int32(32)
        chunk_hi = cutlass.min(cta * op.chunk_routes + op.chunk_routes, op.routes)
        lo = cta * op.chunk_routes + cute.arch.warp_idx() * seg
        return lo, cutlass.min(lo + seg, chunk_hi), seg // Int32(32)

    @cute.jit
    def _load_batch(self, op: _Operands, experts, lo: Int32, hi: Int32, first_step: Int32):
        """experts[u] := local expert of route lo + 32 (first_step + u) + lane; < 0 when dropped.

        The loads are predicated, not branched, so a batch's loads are all in flight
        together: two memory latencies per batch (ids, then the map), not per step.
        """
        lane = cute.arch.lane_idx()
        wide = cutlass.const_expr(self.ids_type is Int64)
        raw = cute.make_rmem_tensor(BATCH, self.ids_type)
        for u in cutlass.range_constexpr(BATCH):
            r = lo + (first_step + Int32(u)) * Int32(32) + lane
            address = op.ids_address + Int64(r) * Int64(self.ids_type.width // 8)
            if cutlass.const_expr(wide):
                raw[u] = ld_global_if_i64(address, Int32(r < hi), Int64(-1))
            else:
                raw[u] = ld_global_if_i32(address, Int32(r < hi), Int32(-1))
        for u in cutlass.range_constexpr(BATCH):
            v = raw[u]
            e = Int32(-1)
            if v >= self.ids_type(0) and v < self.ids_type(op.num_experts):
                e = Int32(v)
            experts[u] = e
        if op.has_map != Int32(0):
            for u in cutlass.range_constexpr(BATCH):
                e = experts[u]
                address = op.emap_address + Int64(cutlass.max(e, Int32(0))) * Int64(4)
                experts[u] = ld_global_if_i32(address, Int32(e >= Int32(0)), Int32(-1))  # -1: not on this GPU
            for u in cutlass.range_constexpr(BATCH):
                if experts[u] >= op.num_experts:
                    experts[u] = Int32(-1)

    @cute.jit
    def _process_batch(self, op: _Operands, hist, experts, lo: Int32, first_step: Int32, scatter: cutlass.Constexpr):
        """Count the batch into this warp's row of hist, or scatter it from the cursors there."""
        lane = cute.arch.lane_idx()
        row = cute.arch.warp_idx() * Int32(MAX_EXPERTS)
        below_mask = Int32(cute.arch.lanemask_lt())
        packed = op.packed  # stores go through locals: the DSL cannot carry `op` through `if`
        for u in cutlass.range_constexpr(BATCH):
            e = experts[u]
            valid = cute.arch.vote_ballot_sync(e >= Int32(0))
            if valid != Int32(0):  # warp-uniform: skips the segment's tail and all-dropped steps
                peers = same_id_lanes(e, valid, SEARCH_STEPS)
                rank = Int32(cute.arch.popc(peers & below_mask))
                cursor = Int32(0)
                if e >= Int32(0):
                    cursor = hist[row + e]
                    if cutlass.const_expr(scatter):
                        slot = cursor + rank
                        if slot < op.cap_slots:
                            packed[slot] = lo + (first_step + Int32(u)) * Int32(32) + lane
                cute.arch.sync_warp()  # every equal lane has read the cursor before the leader moves it
                if e >= Int32(0) and rank == Int32(0):
                    hist[row + e] = cursor + Int32(cute.arch.popc(peers))
                cute.arch.sync_warp()

    @cute.jit
    def _walk(self, op: _Operands, hist, cta: Int32, scatter: cutlass.Constexpr):
        lo, hi, steps = self._segment(op, cta)
        experts = cute.make_rmem_tensor(BATCH, Int32)
        for first in range(0, steps, BATCH):
            self._load_batch(op, experts, lo, hi, first)
            self._process_batch(op, hist, experts, lo, first, scatter)

    # -- scans ------------------------------------------------------------------------

    @cute.jit
    def _zero_hist(self, hist):
        tid, _, _ = cute.arch.thread_idx()
        for w in cutlass.range_constexpr(WARPS):
            hist[w * MAX_EXPERTS + tid] = Int32(0)

    @cute.jit
    def _warp_counts_to_cursors(self, hist, e: Int32, base: Int32) -> Int32:
        """hist[:, e] := base + exclusive prefix over warps; returns the CTA's total for e."""
        running = Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            c = hist[w * MAX_EXPERTS + e]
            hist[w * MAX_EXPERTS + e] = base + running
            running = running + c
        return running

    @cute.jit
    def _exclusive_scan(self, sums, v: Int32) -> Int32:
        """Block-wide exclusive prefix sum of one value per thread."""
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        x = warp_inclusive_sum(v, lane)
        if lane == Int32(31):
            sums[warp] = x
        cute.arch.sync_threads()
        prefix = Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            s = sums[w]
            if Int32(w) < warp:
                prefix = prefix + s
        return prefix + x - v

    @cute.jit
    def _publish_expert(self, op: _Operands, sh: _Shared, e: Int32, total: Int32) -> Int32:
        """Scan the padded sizes; store expert e's end and fill mark in shared memory; returns its start."""
        padded = Int32(0)
        if e < op.num_experts:
            padded = (total + op.block_size - Int32(1)) // op.block_size * op.block_size
        start = self._exclusive_scan(sh.sums, padded)
        ends, fills = sh.ends, sh.fills
        if e < op.num_experts:
            ends[e] = start + padded
            fills[e] = start + total
        return start

    @cute.jit
    def _chunk_counts(self, op: _Operands, e: Int32, cta: Int32):
        """(routes of expert e in the chunks before `cta`, in all chunks), from the published counts:
        every chunk's count of e loaded at once (predicated loads: one memory latency)."""
        before = Int32(0)
        total = Int32(0)
        experts, chunks = op.num_experts, op.num_chunks
        first = op.ws.iterator.toint() + Int64(op.counts_at(Int32(0)) + e) * Int64(4)  # chunk 0's count of e
        if e < experts:
            vals = cute.make_rmem_tensor(MULTI_MAX_CHUNKS, Int32)
            for c in cutlass.range_constexpr(MULTI_MAX_CHUNKS):
                address = first + Int64(c) * Int64(experts) * Int64(4)
                vals[c] = ld_global_if_i32(address, Int32(Int32(c) < chunks), Int32(0), l2_only=True)
            for c in cutlass.range_constexpr(MULTI_MAX_CHUNKS):
                if Int32(c) < cta:
                    before = before + vals[c]
                total = total + vals[c]
        return before, total

    # -- blocks and padding -------------------------------------------------------------

    @cute.jit
    def _fill(self, op: _Operands, sh: _Shared, cta: Int32, ctas: Int32):
        """block_expert_ids, expert tails and the slots past the count (see the module doc)."""
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        packed_total = sh.ends[op.num_experts - Int32(1)]
        first, stride = cta * Int32(THREADS) + tid, ctas * Int32(THREADS)
        packed, block_ids = op.packed, op.block_ids
        for j in range(first, op.cap_blocks, stride):
            s0 = j * op.block_size
            expert = Int32(-1)
            if s0 < packed_total:
                # first expert whose end is past s0 (an empty expert shares its neighbour's end)
                expert = Int32(0)
                for k in cutlass.range_constexpr(SEARCH_STEPS):
                    probe = expert + Int32(MAX_EXPERTS >> (k + 1))
                    if probe <= op.num_experts:
                        if sh.ends[probe - Int32(1)] <= s0:
                            expert = probe
            block_ids[j] = expert
        gwarp = cta * Int32(WARPS) + cute.arch.warp_idx()
        for e in range(gwarp, op.num_experts, ctas * Int32(WARPS)):
            for s in range(sh.fills[e] + lane, sh.ends[e], 32):
                if s < op.cap_slots:
                    packed[s] = op.routes
        for s in range(packed_total + first, op.cap_slots, stride):
            packed[s] = op.routes

    # -- the kernel -------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        topk_ids: cute.Pointer,
        expert_map: cute.Pointer,
        packed_route_indices: cute.Pointer,
        block_expert_ids: cute.Pointer,
        packed_route_count: cute.Pointer,
        workspace: cute.Pointer,
        routes: Int32,
        num_experts: Int32,
        has_expert_map: Int32,
        block_size: Int32,
        capacity_slots: Int32,
        capacity_blocks: Int32,
        chunk_routes: Int32,
        num_chunks: Int32,
    ):
        after_prior_grids()
        tid, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        cta = Int32(bidx)
        flat = cute.make_layout(1 << 30)  # global arrays: every index is bounds-checked before use
        op = _Operands(
            topk_ids.toint(), expert_map.toint(), cute.make_tensor(topk_ids, flat), cute.make_tensor(expert_map, flat),
            cute.make_tensor(packed_route_indices, flat), cute.make_tensor(block_expert_ids, flat),
            cute.make_tensor(packed_route_count, cute.make_layout(1)), cute.make_tensor(workspace, flat),
            routes, num_experts, has_expert_map, block_size, capacity_slots, capacity_blocks, chunk_routes, num_chunks,
        )
        sh = _Shared()
        e = Int32(tid)  # the expert this thread scans

        if cutlass.const_expr(self.stage is RouteStage.SINGLE):
            self._single(op, sh, e)
        else:
            self._multi(op, sh, e, cta, I.gmem_address(workspace), Int32(tid))

    @cute.jit
    def _single(self, op: _Operands, sh: _Shared, e: Int32):
        """One CTA: load every route once, count, scan, fill, scatter."""
        self._zero_hist(sh.hist)
        lo, hi, _ = self._segment(op, Int32(0))
        experts = cute.make_rmem_tensor(BATCH, Int32)
        self._load_batch(op, experts, lo, hi, Int32(0))
        cute.arch.sync_threads()
        self._process_batch(op, sh.hist, experts, lo, Int32(0), False)
        cute.arch.sync_threads()
        total = self._warp_counts_to_cursors(sh.hist, e, Int32(0))
        start = self._publish_expert(op, sh, e, total)
        hist, count = sh.hist, op.count
        if e < op.num_experts:
            for w in cutlass.range_constexpr(WARPS):
                hist[w * MAX_EXPERTS + e] = hist[w * MAX_EXPERTS + e] + start
        if e == op.num_experts - Int32(1):
            count[0] = sh.ends[e]
        cute.arch.sync_threads()
        self._fill(op, sh, Int32(0), Int32(1))
        self._process_batch(op, sh.hist, experts, lo, Int32(0), True)

    @cute.jit
    def _multi(self, op: _Operands, sh: _Shared, e: Int32, cta: Int32, barrier, tid: Int32):
        """One CTA per chunk: count the chunk per warp and publish its counts; after the grid barrier,
        this chunk's first slots from every chunk's counts, the starts, fill its share, scatter."""
        self._zero_hist(sh.hist)
        cute.arch.sync_threads()
        self._walk(op, sh.hist, cta, False)
        cute.arch.sync_threads()
        chunk_total = self._warp_counts_to_cursors(sh.hist, e, Int32(0))  # per-warp cursors within the chunk
        ws, experts, chunk_at = op.ws, op.num_experts, op.counts_at(cta) + e
        if e < experts:
            ws[chunk_at] = chunk_total
        grid_barrier(barrier, tid, op.num_chunks)
        before, total = self._chunk_counts(op, e, cta)
        start = self._publish_expert(op, sh, e, total)
        hist, count, ends = sh.hist, op.count, sh.ends
        first = start + before  # this chunk's first slot of expert e
        if e < experts:
            for w in cutlass.range_constexpr(WARPS):
                hist[w * MAX_EXPERTS + e] = hist[w * MAX_EXPERTS + e] + first
        if cta == Int32(0) and e == experts - Int32(1):
            count[0] = ends[e]
        cute.arch.sync_threads()
        self._fill(op, sh, cta, op.num_chunks)
        self._walk(op, sh.hist, cta, True)


def build(spec: RoutePackSpec):
    """The kernel object and fake arguments for `cute.compile` (pointers are 4/8-byte aligned)."""
    return RoutePackKernel(spec), fake_arguments(spec)
