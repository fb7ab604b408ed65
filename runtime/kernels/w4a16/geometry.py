"""Geometry of the W4A16 kernels: facts the build and the runtime share.

Tile shapes, route-block sizes, pipeline depth, shared-memory footprints, split-K
scratch and lock sizes, and a pure-Python replay of the persistent kernel's work
partition.  These describe what a compiled kernel *is* (its spec's derived
properties and buffer sizes); what to compile for a problem and M is decided by
the planners in `cuteaot.codegen.kernels.w4a16`, at build time only, and written
into the manifest's resolution table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from ...errors import BadInputError
from ...types import fc1_width
# the route-pack kernel's contract: the block sizes it packs, and its buffers
from ..route_pack import ALLOWED_BLOCK_SIZES as PACKED_BLOCK_SIZES, max_packed_route_slots

# M rows one route block holds; 8 is the small-M (m16n8k16 with half the rows) path.
ALLOWED_MOE_BLOCK_SIZES = (8, 16, 32, 48, 64)

STAGES = 4  # cp.async pipeline depth of the kernel's main loop

PACK_FACTOR = 8  # 4-bit weights per 32-bit word

MMA_M = 16  # rows of one m16n8k16 MMA; a CTA's M extent is a whole number of these

class ScaleFormat(str, Enum):
    """How weight scales are stored; only the K group size matters to planning."""

    E4M3_K16 = "e4m3_k16"  # NVFP4: one e4m3 scale per 16 weights along K
    E8M0_K32 = "e8m0_k32"  # MXFP4: one e8m0 scale per 32 weights along K
    E4M3_K32 = "e4m3_k32"  # NF3: one e4m3 scale per 32 weights along K

    @property
    def group_size(self) -> int:
        return 16 if self is ScaleFormat.E4M3_K16 else 32

@dataclass(frozen=True)
class TileConfig:
    """A CTA's tile of the output (tile_n) and of the reduction (tile_k).

    The kernel derives its thread count as tile_n * tile_k / 64 (each thread owns
    64 weight elements of a K-tile) and only implements 128 and 256 threads, so
    the thread count is a property rather than a third, possibly inconsistent field.
    """

    tile_k: int
    tile_n: int

    def __post_init__(self):
        for name in ("tile_k", "tile_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % MMA_M:
                raise BadInputError(f"TileConfig.{name} must be a positive multiple of 16, got {value!r}")
        if self.threads not in (128, 256):
            raise BadInputError(
                f"TileConfig(tile_k={self.tile_k}, tile_n={self.tile_n}) gives "
                f"{self.threads} threads (tile_n * tile_k / 64); the kernel supports 128 or 256"
            )

    @property
    def threads(self) -> int:
        return self.tile_n * self.tile_k // 64

    @property
    def n_blocks(self) -> int:
        return self.tile_n // 16

    @property
    def k_blocks(self) -> int:
        return self.tile_k // 16

# wgmma tiles, widest first: four (or two) m64 instructions per 16-k row cover 256 (or 128)
# weight rows; the k-tile is one 128-byte swizzle row of bf16 activations.
WGMMA_TILES = (TileConfig(64, 256), TileConfig(64, 128))

# 64-row blocks, 128-row blocks (N = 128 per wgmma: half the weight decode per MAC) once
# the average expert fills them (routes >= 128 * experts), and 256-row blocks (N = 256: half again)
# for the standalone GEMM where the average expert fills those.  The short blocks (16, 32, 48 rows:
# wgmma N = the block) run the same loop too, on sm_90a where the planner's rule says so
# (planning.WGMMA_SHORT).
WGMMA_SHORT_BLOCKS = (16, 32, 48)
WGMMA_BLOCK_SIZES = WGMMA_SHORT_BLOCKS + (64, 128, 256)

WGMMA_TALL_BLOCK = 128

# 256-row blocks: two warpgroups per CTA share each staged activation tile, each computing 64 of
# the tile's 128 weight rows for all 256 tokens (accumulators: 128 floats per thread, as the
# 128-row block's one warpgroup over 128 weight rows).  128-row blocks on the 256-wide tile take two
# warpgroups too, each computing 128 of its weight rows for the 128 tokens.
WGMMA_WIDE_BLOCK = 256

WGMMA_THREADS = 128  # one warpgroup
# accumulator floats per thread a warpgroup holds at most (tile_n / 64 wgmma of N = B tokens: B / 2 each)
WGMMA_ACC_FLOATS = 128


def wgmma_threads(moe_block_size: int, tile: TileConfig) -> int:
    """Threads of a wgmma CTA: as many warpgroups as keep each thread's accumulators within
    WGMMA_ACC_FLOATS (one; two for the 256-row block and for the 128-row block on the 256-wide tile)."""
    acc = tile.tile_n // 64 * moe_block_size // 2
    return WGMMA_THREADS * max(1, acc // WGMMA_ACC_FLOATS)

WGMMA_SMEM_ALIGN = 1024  # a 128B-swizzle atom (8 rows x 128 bytes) starts 1024-aligned

def check_moe_block_size(moe_block_size: int) -> None:
    """Every route block a kernel takes is one the route-pack kernel packs."""
    if moe_block_size not in PACKED_BLOCK_SIZES:
        raise BadInputError(f"moe_block_size must be one of {PACKED_BLOCK_SIZES}, got {moe_block_size!r}")

def check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadInputError(f"{name} must be a positive int, got {value!r}")

@functools.cache
def cta_m_blocks(moe_block_size: int) -> int:
    """MMA row blocks (16 rows each) a CTA spans; block size 8 still uses one."""
    check_moe_block_size(moe_block_size)
    return -(-moe_block_size // MMA_M)

@functools.cache
def shared_memory_footprint(moe_block_size: int, tile: TileConfig, scale_format: ScaleFormat) -> int:
    """Bytes of shared memory the seed budgets for one CTA (its planning estimate).

    A stages of bf16 activations, B stages of packed weights (the split-K reduction
    buffer and bias reuse B's space once the main loop is done), scale stages, and
    16 bytes of route metadata per row.
    """
    cta_m = cta_m_blocks(moe_block_size) * MMA_M
    meta = cta_m * 16
    a_stages = STAGES * cta_m * tile.tile_k * 2
    b_stages = STAGES * (tile.tile_k * tile.tile_n // PACK_FACTOR) * 4
    reduction = cta_m * (tile.tile_n + 8) * 2
    bias = tile.tile_n * 2
    reused = max(b_stages, reduction, min(b_stages, reduction) + bias)
    scale_groups = -(-tile.tile_k // scale_format.group_size)
    scale_stages = scale_groups * tile.tile_n * 2 * STAGES
    return reused + a_stages + scale_stages + meta

@functools.cache
def route_metadata_bytes(moe_block_size: int) -> int:
    """Shared bytes the kernels keep per block for route indices, source rows, router weights, count."""
    check_moe_block_size(moe_block_size)
    return 16 * (moe_block_size // 2 + moe_block_size // 2 + 1)

def wgmma_stage_parts(moe_block_size: int, tile: TileConfig) -> tuple[int, int, int]:
    """Bytes of one wgmma pipeline stage: (bf16 activations, packed weights, e4m3 scales)."""
    return (moe_block_size * tile.tile_k * 2, tile.tile_n * tile.tile_k // PACK_FACTOR * 4,
            tile.tile_n * tile.tile_k // ScaleFormat.E4M3_K16.group_size)

def wgmma_stage_bytes(moe_block_size: int, tile: TileConfig) -> int:
    """One pipeline stage of the wgmma loop."""
    return sum(wgmma_stage_parts(moe_block_size, tile))

@functools.cache
def wgmma_shared_memory_footprint(moe_block_size: int, tile: TileConfig, stages: int = STAGES) -> int:
    """Exact dynamic shared bytes of the wgmma kernel (GemmSpec.shared_bytes uses this)."""
    return (route_metadata_bytes(moe_block_size) + WGMMA_SMEM_ALIGN
            + stages * wgmma_stage_bytes(moe_block_size, tile))

# The producer-warpgroup form of the wgmma GEMM (codegen/kernels/w4a16/wgmma_ws.py): the compute
# warpgroup(s) only decode, multiply and store; one more warpgroup streams every stage with cp.async,
# across tile boundaries, through a ring of full / empty mbarriers, and the epilogue stages its output in
# a region of its own.  For the large-M blocks, with the ring depth each CTA count per SM leaves room for.
WGMMA_WS_BLOCKS = (WGMMA_TALL_BLOCK, WGMMA_WIDE_BLOCK)
WGMMA_WS_STAGES = {WGMMA_TALL_BLOCK: 3, WGMMA_WIDE_BLOCK: 4}
# The producer is a whole warpgroup (setmaxnreg works per warpgroup, and ptxas budgets registers for
# whole warpgroups anyway): it gives registers back down to PRODUCER_REGISTERS and the compute
# warpgroups take what that frees (`wgmma_ws_compute_registers`).
PRODUCER_THREADS = 128
PRODUCER_REGISTERS = 56


def tile_count(size: int, tile: int) -> int:
    """Tiles of `tile` that cover `size`; the last one may end past it (a masked tile, runtime/weights.py)."""
    return -(-size // tile)


def wgmma_out_row_bytes(tile: TileConfig) -> int:
    """Bytes per output row the wgmma epilogue stages in shared memory (+16 against bank conflicts)."""
    return tile.tile_n * 2 + 16


@dataclass(frozen=True)
class WgmmaWsLayout:
    """Byte offsets of the producer-warpgroup kernel's shared memory (from the dynamic base, which is
    16-aligned): route metadata as the other kernels, the two roles' ring counters, full[stages] and
    empty[stages] mbarriers, the producer's source row per block row, then (aligned at run time) the
    stages and the epilogue's output tile."""

    rings: int
    full: int
    empty: int
    rows: int
    stages_at: int
    footprint: int


# the producer form runs the 128-wide tile only
WGMMA_WS_TILE = TileConfig(64, 128)


def wgmma_ws_launch_registers(moe_block_size: int, blocks_per_sm: int, registers_per_sm: int = 65536) -> int:
    """Registers per thread of the producer-warpgroup kernel at launch: what blocks_per_sm CTAs of its
    threads leave each, in multiples of 8 (ptxas compiles it to this count: min blocks per SM)."""
    threads = wgmma_threads(moe_block_size, WGMMA_WS_TILE) + PRODUCER_THREADS
    return registers_per_sm // (blocks_per_sm * threads) // 8 * 8


def wgmma_ws_compute_registers(moe_block_size: int, blocks_per_sm: int, registers_per_sm: int = 65536) -> int:
    """Registers per compute thread after setmaxnreg: what the CTA holds at launch less the producer's
    PRODUCER_REGISTERS."""
    compute = wgmma_threads(moe_block_size, WGMMA_WS_TILE)
    at_launch = wgmma_ws_launch_registers(moe_block_size, blocks_per_sm, registers_per_sm)
    return min(((compute + PRODUCER_THREADS) * at_launch - PRODUCER_THREADS * PRODUCER_REGISTERS) // compute // 8 * 8,
               256)


@functools.cache
def wgmma_ws_layout(moe_block_size: int, tile: TileConfig, stages: int) -> WgmmaWsLayout:
    rings = route_metadata_bytes(moe_block_size)
    full = rings + 16
    empty = full + 8 * stages
    rows = empty + 8 * stages
    stages_at = rows + 4 * moe_block_size
    out_tile = moe_block_size * wgmma_out_row_bytes(tile)
    return WgmmaWsLayout(rings, full, empty, rows, stages_at,
                         stages_at + WGMMA_SMEM_ALIGN + stages * wgmma_stage_bytes(moe_block_size, tile) + out_tile)


@functools.cache
def wgmma_tiles(moe_block_size: int) -> tuple[TileConfig, ...]:
    """The wgmma tiles a block size can use, widest first.

    The accumulators are tile_n / 64 * B / 2 floats per warpgroup thread, at most WGMMA_ACC_FLOATS:
    128-row blocks take the 256-wide tile on two warpgroups (`wgmma_threads`), 256-row blocks the
    128-wide one on two.
    """
    if moe_block_size == WGMMA_WIDE_BLOCK:
        return WGMMA_TILES[1:]
    return WGMMA_TILES if moe_block_size in WGMMA_BLOCK_SIZES else ()

def max_route_blocks(routes: int, block_size: int, num_experts: int) -> int:
    """Worst-case route blocks: :func:`max_packed_route_slots` / block_size."""
    return max_packed_route_slots(routes, block_size, num_experts) // block_size

@dataclass(frozen=True)
class WorkItem:
    """One (route block, N tile) output tile's K range as one CTA processes it.

    A tile split over several CTAs ("split-K") has slice_count > 1: its slices
    meet in the float32 scratch slot `lock_slot`, taking turns in slice_idx order,
    and the slice with slice_idx == slice_count - 1 writes the output.  The seed
    numbers slices from the *highest* K range down (slice 0 is the CTA for which
    the tile is its first work, so it never waits).  lock_slot is None for an
    unsplit tile: the kernel then touches no lock and no scratch.
    """

    cta: int
    route_block: int
    n_tile: int
    k_start: int
    k_count: int
    slice_idx: int
    slice_count: int
    lock_slot: int | None

class _Partition(NamedTuple):
    mn_tiles: int  # route_blocks * n_tiles
    tail_mn_tiles: int  # tiles shared along K by the whole grid
    full_grid_mn_iters: int  # rounds in which every CTA owns whole tiles
    iters: int  # K iterations per CTA in the tail

# What one more tile in a CTA's split-K tail range costs the mma.sync loop, in 64-deep k-tiles of its main
# loop: a tile start (route reads, the first stage's round trip) and a split-K merge, ~3.2 us against ~0.5 us a
# k-tile (Nsight warp samples of the Qwen3-30B fused kernel at M = 8, docs/benchmarks.md, fifteenth session).
SPLIT_SPAN_COST_K64 = 6


def split_span_cost(tile_k: int) -> int:
    """SPLIT_SPAN_COST_K64 in k-tiles of `tile_k` (a 128-deep k-tile moves twice the bytes)."""
    return max(1, SPLIT_SPAN_COST_K64 * 64 // tile_k)


def split_range_forms(k_tiles: int) -> tuple[int, ...]:
    """The remainders d (ascending, k_tiles last) of the range lengths q k_tiles + d that meet one tile fewer
    than others: the divisors of k_tiles (`aligned_split_iters`; the kernel unrolls one candidate each)."""
    return tuple(d for d in range(1, k_tiles + 1) if k_tiles % d == 0)


def aligned_split_iters(iters: int, k_tiles: int, span_cost: int) -> int:
    """The tail's K iterations per CTA when a CTA's every tile costs `span_cost` iterations besides its own.

    CTA c's range [iters c, iters c + iters) of the tail's tiles laid end to end meets at most q + 2 tiles for
    iters = q k_tiles + d, or q + 1 where d divides k_tiles (every range then starts at a multiple of d; d = 0:
    whole tiles, no split-K merge).  The answer is `iters` or the smallest larger count of such a form, whichever
    has the lowest iterations + span_cost x tiles met (the first on a tie).  The mma.sync kernel's scheduler
    (codegen/kernels/w4a16/gemm.py `_aligned_iters`) computes the same on the GPU.
    """
    best, best_cost = iters, iters + span_cost * (iters // k_tiles + 2)
    for d in split_range_forms(k_tiles):
        q = (iters - d + k_tiles - 1) // k_tiles  # the smallest q with q k_tiles + d >= iters
        cost = q * k_tiles + d + span_cost * (q + 1)
        if cost < best_cost:
            best, best_cost = q * k_tiles + d, cost
    return best

def _partition(route_blocks: int, n_tiles: int, k_tiles: int, grid_x: int, uses_m_block_8: bool,
               span_cost: int | None = None) -> _Partition:
    """The seed's split of the mn tiles into whole-tile rounds and a split-K tail.

    Whole rounds give each CTA one full tile; the remaining tiles' K iterations are
    cut into grid_x equal contiguous ranges.  A small remainder (at most a third of
    the grid) is merged with one whole round so the tail is never mostly idle.
    Block size 8 with no more tiles than CTAs gives one whole tile per CTA instead.
    With span_cost (the mma.sync loop) the ranges may be longer (`aligned_split_iters`).
    """
    mn_tiles = route_blocks * n_tiles
    tail, full = mn_tiles, 0
    if uses_m_block_8 and mn_tiles <= grid_x:
        tail, full = 0, 1
    elif mn_tiles > grid_x:
        tail = mn_tiles % grid_x
        if tail * 3 <= grid_x:
            tail += grid_x
        full = (mn_tiles - tail) // grid_x
    iters = (k_tiles * tail + grid_x - 1) // grid_x
    if span_cost is not None and iters > 0:
        iters = aligned_split_iters(iters, k_tiles, span_cost)
    return _Partition(mn_tiles, tail, full, iters)

def _slice_of(tile: int, cta: int, k_tiles: int, iters: int) -> tuple[int, int]:
    """(slice_count, slice_idx) of tail tile `tile` for `cta`, ported from the seed.

    CTA ranges start at multiples of `iters` in the flattened (tile, k) order;
    each range start inside the tile opens a new slice.  Slices are numbered from
    the last K range (0) to the first (slice_count - 1).
    """
    tile_start = k_tiles * tile
    first_boundary = iters * ((tile_start + iters - 1) // iters)
    if first_boundary > tile_start + k_tiles:
        return 1, 0
    offset = first_boundary - tile_start
    count = (k_tiles - offset + iters - 1) // iters + (1 if offset > 0 else 0)
    delta = iters * cta - first_boundary
    if delta < 0 or (offset == 0 and delta == 0):
        return count, count - 1
    return count, count - 1 - delta // iters - (1 if offset > 0 else 0)

def _cta_items(cta: int, route_blocks: int, n_tiles: int, k_tiles: int, grid_x: int, p: _Partition) -> list[WorkItem]:
    """The work one CTA does, in order: whole-tile rounds, then its tail K range."""
    items = []
    for round_idx in range(p.full_grid_mn_iters):
        route_block, n_tile = divmod(cta + round_idx * grid_x, n_tiles)
        if route_block < route_blocks:
            items.append(WorkItem(cta, route_block, n_tile, 0, k_tiles, 0, 1, None))
    if p.iters == 0:
        return items
    start = p.iters * cta
    tile, k_start = divmod(start, k_tiles)
    # The seed's running lock slot: CTA index when the tail is at least a grid
    # wide (bumped after a split tile whose first slice is here), else the tile.
    lock = cta if p.tail_mn_tiles >= grid_x else start // k_tiles - 1
    tail_base = p.mn_tiles - p.tail_mn_tiles
    while tile < p.tail_mn_tiles:
        count = min(max(p.iters * (cta + 1) - (k_tiles * tile + k_start), 0), k_tiles - k_start)
        if count <= 0:
            break
        slice_count, slice_idx = _slice_of(tile, cta, k_tiles, p.iters)
        if p.tail_mn_tiles < grid_x or (slice_count > 1 and slice_idx == slice_count - 1):
            lock += 1
        route_block, n_tile = divmod(tail_base + tile, n_tiles)
        slot = lock if slice_count > 1 else None
        items.append(WorkItem(cta, route_block, n_tile, k_start, count, slice_idx, slice_count, slot))
        tile, k_start = tile + 1, 0
    return items

def simulate_partition(
    route_blocks: int, n_tiles: int, k_tiles: int, grid_x: int, uses_m_block_8: bool,
    span_cost: int | None = None,
) -> list[WorkItem]:
    """Every work item of the persistent GEMM, CTA by CTA, as the kernel schedules it (span_cost: the
    mma.sync loop's, `split_span_cost`; None: the wgmma loop's, the seed's split).

    A pure-Python replay of the kernel's persistent loop, used to prove coverage
    and lock-slot bounds in tests and to size scratch; nothing here is launched.
    """
    check_positive(n_tiles=n_tiles, k_tiles=k_tiles, grid_x=grid_x)
    if not isinstance(route_blocks, int) or route_blocks < 0:
        raise BadInputError(f"route_blocks must be a non-negative int, got {route_blocks!r}")
    p = _partition(route_blocks, n_tiles, k_tiles, grid_x, uses_m_block_8, span_cost)
    items = []
    for cta in range(grid_x):
        items.extend(_cta_items(cta, route_blocks, n_tiles, k_tiles, grid_x, p))
    return items

def lock_slots(grid_x: int) -> int:
    """Lock (and split-K scratch) slots a grid of grid_x CTAs can use: grid_x.

    From the partition: with a tail narrower than the grid each split tile uses its
    tail index (< grid_x - 1); otherwise a tile split between CTAs c and c + 1 uses
    slot c + 1 (<= grid_x - 1).  The bound is reached for every grid_x >= 3 and
    does not depend on the problem size; the tests check it against the simulation.
    """
    check_positive(grid_x=grid_x)
    return grid_x

def splitk_scratch_floats(grid_x: int, moe_block_size: int, tile_n: int) -> int:
    """float32 elements of split-K scratch: one (16 * cta_m_blocks) x tile_n partial per lock slot.

    The kernel addresses the partial of slot s at s * cta_m * tile_n floats, even for
    block size 8 (which writes fewer rows), so the stride is the full CTA height.
    """
    check_positive(tile_n=tile_n)
    return lock_slots(grid_x) * MMA_M * cta_m_blocks(moe_block_size) * tile_n


# Grid-barrier words at the start of the fused kernel's `locks` (the barrier's word, padding); the
# split-K lock slots follow them.
BARRIER_WORDS = 4


def fused_gemm_dims(hidden_size: int, intermediate_size: int, gated: bool,
                    nf3: bool = False) -> tuple[tuple[int, int], tuple[int, int]]:
    """Stored (N, K) of FC1 and FC2 (sizes zero-padded, runtime/weights.py `stored_dims`; NF3's N to 128)."""
    from ...nf3 import NF3_STORED_N_MULTIPLE  # weights and nf3 import this module's constants
    from ...weights import STORED_N_MULTIPLE, stored_dims

    multiple = NF3_STORED_N_MULTIPLE if nf3 else STORED_N_MULTIPLE
    fc1_n = fc1_width(intermediate_size, gated)
    return stored_dims(fc1_n, hidden_size, multiple), stored_dims(hidden_size, intermediate_size, multiple)
