"""Launch planning for the W4A16 grouped MoE GEMM, in plain Python.

The build (which tile configs and blocks-per-SM to compile for) and the server
(grid size, route-buffer capacities, split-K scratch) both call this module, so
the two can never disagree.  It depends on a :class:`DeviceProfile`, never on a
live GPU: an AOT build plans for a target it may not have.

Where the numbers come from
---------------------------
* Tile candidates, the shared-memory footprint, the fit check, the blocks-per-SM
  rule and the tile choice follow the seed's host planning (the W4A16 JIT kernel
  file, ``_select_tile_config`` and helpers).  Only the exact case is kept: N and
  K must be multiples of the tile and K of the scale group (the seed's "logical
  tail" for native E8M0 weights is not ported).
* The register counts are the seed's table measured on SM121; they are only an
  *estimate* on other targets (sm_90a differs), so every planning call accepts
  the real count read from the built cubin.
* Route-block sizing and slot bounds come from the standard Marlin-MoE recipe
  (see :func:`select_route_block_size` and :func:`max_packed_route_slots`).
* :func:`simulate_partition` replays, in Python, how the persistent kernel splits
  (route block, N tile, K tile) work over its grid; the lock-slot and split-K
  scratch bounds are derived from it and checked against it by the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from .devices import DeviceProfile
from .errors import BadInputError

__all__ = [
    "ALLOWED_MOE_BLOCK_SIZES",
    "LARGE_BATCH_TILE_CONFIGS",
    "MAX_DIRECT_TOPK_ROUTE_M",
    "PACKED_M8_TILE",
    "PACK_FACTOR",
    "REGISTER_ESTIMATES_SM121",
    "SMALL_BATCH_TILE_CONFIGS",
    "STAGES",
    "GemmPlan",
    "RegisterKey",
    "ScaleFormat",
    "TileConfig",
    "WGMMA_TILES",
    "WorkItem",
    "blocks_per_sm",
    "cta_m_blocks",
    "estimated_registers",
    "lock_slots",
    "max_packed_route_slots",
    "max_route_blocks",
    "plan_gemm",
    "select_route_block_size",
    "select_tile",
    "shared_memory_footprint",
    "simulate_partition",
    "splitk_scratch_floats",
    "tile_misfit",
    "wgmma_shared_memory_footprint",
    "wgmma_tile",
    "wgmma_tiles",
]

# M rows one route block holds; 8 is the small-M (m16n8k16 with half the rows) path.
ALLOWED_MOE_BLOCK_SIZES = (8, 16, 32, 48, 64)
STAGES = 4  # cp.async pipeline depth of the kernel's main loop
PACK_FACTOR = 8  # 4-bit weights per 32-bit word
MMA_M = 16  # rows of one m16n8k16 MMA; a CTA's M extent is a whole number of these
# Up to this many tokens every (token, k) route is its own block (no route packing).
MAX_DIRECT_TOPK_ROUTE_M = 6
# Marlin-MoE block-size rule: grow the block while the average routes per expert
# would fill less than 90% of it (expressed as the exact ratio 9/10).
_ROUTE_FILL_NUM, _ROUTE_FILL_DEN = 9, 10

# Shared-memory margins kept from the seed.  The fit check leaves 512 bytes of the
# opt-in limit unused and co-residency charges 1536 bytes per block on top of the
# footprint (the hardware reserves 1 KiB per block; the rest is slack for the
# footprint being an estimate of the kernel's 1024-aligned storage struct).
_FIT_SHARED_MEMORY_MARGIN = 512
_RESIDENT_SHARED_MEMORY_PER_BLOCK = 1536
# Registers: the hardware gives a warp its registers in units of 256 (8 per
# thread), and no thread may hold more than 255.
_REGISTER_UNIT_PER_THREAD = 8
_MAX_REGISTERS_PER_THREAD = 255
# Persistent CTAs per SM: the seed caps 1-MMA-row tiles at 4 and larger ones at 2.
M8_BLOCKS_PER_SM = 2  # measured on the H200, see blocks_per_sm
_MAX_BLOCKS_PER_SM_ONE_M_BLOCK = 4
_MAX_BLOCKS_PER_SM_MULTI_M_BLOCK = 2
# Packed 8-row blocks (about 7..100 tokens): 128-thread 128x64 tiles, 4 CTAs per SM.  Measured
# with benchmarks/tune_gemm.py on the H200 (docs/benchmarks.md) against the 256-thread 128x128
# tile at 2/SM, after the ALU-pipe decode: Qwen3-30B FC2 at M = 64 44.1 vs 51.8 us, FC1 73.6 vs
# 79.8 us; gpt-oss FC2 (K = 2944 stored) 46.5 vs 49.8 us at M = 8 and 174.8 vs 175.9 at M = 64;
# but Qwen3-235B FC1 (K = 4096) 298.9 vs 279.8 us at M = 64.  The fused kernel uses it for every
# shape; the standalone GEMM up to K = PACKED_M8_MAX_K, where long K loops favour the deeper
# 128-k tile.
PACKED_M8_BLOCKS_PER_SM = 4
PACKED_M8_MAX_K = 3072
PACKED_M8_MEASURED_ARCHS = ("sm_90a",)  # the standalone GEMM keeps the seed's tiles elsewhere
# The seed's "enough work" rule charges 4 CTAs per (n tile, route) pair.
_WORK_CTAS_PER_TILE_ROUTE = 4


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


# Candidates in the seed's order; on equal blocks-per-SM the earlier one wins.
# One-MMA-row blocks (moe_block_size 8 or 16) favour deep K; taller blocks wide N.
SMALL_BATCH_TILE_CONFIGS = (TileConfig(128, 128), TileConfig(64, 128), TileConfig(128, 64))
LARGE_BATCH_TILE_CONFIGS = (TileConfig(64, 256), TileConfig(64, 128), TileConfig(128, 64))
PACKED_M8_TILE = TileConfig(64, 128)
# wgmma tiles, widest first: four (or two) m64 instructions per 16-k row cover 256 (or 128)
# weight rows; the k-tile is one 128-byte swizzle row of bf16 activations.
WGMMA_TILES = (TileConfig(64, 256), TileConfig(64, 128))


class RegisterKey(NamedTuple):
    """The seed's register-table key (a plain tuple compares equal to it)."""

    threads: int
    cta_m_blocks: int
    cta_n_blocks: int
    cta_k_blocks: int
    uses_m_block_8: bool


# Registers per thread the seed measured from its SM121 JIT output.  On any other
# target (and after any kernel change) these are estimates: good enough to rank
# candidates at build time, not to promise co-residency.  Pass the real count
# (from the cubin) as ``registers=`` wherever a launch depends on it.
REGISTER_ESTIMATES_SM121: dict[RegisterKey, int] = {
    RegisterKey(256, 1, 8, 8, True): 118,
    RegisterKey(256, 1, 16, 4, True): 118,
    RegisterKey(256, 1, 16, 8, True): 118,
    RegisterKey(256, 1, 32, 2, True): 118,
    RegisterKey(128, 1, 4, 8, True): 118,
    RegisterKey(128, 1, 8, 4, True): 120,
    RegisterKey(256, 1, 8, 8, False): 158,
    RegisterKey(128, 1, 4, 8, False): 154,
    RegisterKey(128, 1, 8, 4, False): 143,
    RegisterKey(256, 2, 16, 4, False): 212,
    RegisterKey(128, 2, 4, 8, False): 215,
    RegisterKey(128, 2, 8, 4, False): 214,
    RegisterKey(256, 3, 16, 4, False): 249,
    RegisterKey(128, 3, 4, 8, False): 249,
    RegisterKey(128, 3, 8, 4, False): 250,
    RegisterKey(256, 4, 16, 4, False): 255,
    RegisterKey(128, 4, 4, 8, False): 255,
    RegisterKey(128, 4, 8, 4, False): 255,
}


# The sm_90a large-M loop (warpgroup MMA, codegen/kernels/w4a16_wgmma.py): one warpgroup per
# CTA over 64-row route blocks (the wgmma N), tiles WGMMA_TILES (defined below TileConfig).
WGMMA_ARCHS = ("sm_90a",)
# 64-row blocks, and 128-row blocks (N = 128 per wgmma: half the weight decode per MAC) once
# the average expert fills them (routes >= 128 * experts).
WGMMA_BLOCK_SIZES = (64, 128)
WGMMA_TALL_BLOCK = 128
WGMMA_THREADS = 128
WGMMA_SMEM_ALIGN = 1024  # a 128B-swizzle atom (8 rows x 128 bytes) starts 1024-aligned
# Registers per thread of the built sm_90a cubins by (block, tile_n) (`cuteaot inspect`); the
# runtime re-checks co-residency with the real count, this only sizes the planned grid.
WGMMA_REGISTERS_SM90 = {(64, 256): 220, (64, 128): 136, (128, 128): 228}


def _check_moe_block_size(moe_block_size: int) -> None:
    sizes = ALLOWED_MOE_BLOCK_SIZES + (WGMMA_TALL_BLOCK,)
    if moe_block_size not in sizes:
        raise BadInputError(f"moe_block_size must be one of {sizes}, got {moe_block_size!r}")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadInputError(f"{name} must be a positive int, got {value!r}")


def cta_m_blocks(moe_block_size: int) -> int:
    """MMA row blocks (16 rows each) a CTA spans; block size 8 still uses one."""
    _check_moe_block_size(moe_block_size)
    return -(-moe_block_size // MMA_M)


def estimated_registers(tile: TileConfig, moe_block_size: int) -> int:
    """The SM121 register estimate for this specialization; a missing key is an error.

    Guessing a number here could plan a grid that is not co-resident (the split-K
    waits and the fused kernel's grid barrier then deadlock), so there is no fallback.
    """
    key = RegisterKey(tile.threads, cta_m_blocks(moe_block_size), tile.n_blocks, tile.k_blocks, moe_block_size == 8)
    try:
        return REGISTER_ESTIMATES_SM121[key]
    except KeyError:
        raise BadInputError(
            f"no register estimate for tile (tile_k={tile.tile_k}, tile_n={tile.tile_n}, "
            f"threads={tile.threads}) with moe_block_size={moe_block_size} (key {tuple(key)}); "
            "pass registers= with the count read from the built cubin"
        ) from None


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


def route_metadata_bytes(moe_block_size: int) -> int:
    """Shared bytes the kernels keep per block for route indices, source rows, router weights, count."""
    _check_moe_block_size(moe_block_size)
    return 16 * (moe_block_size // 2 + moe_block_size // 2 + 1)


def wgmma_stage_parts(moe_block_size: int, tile: TileConfig) -> tuple[int, int, int]:
    """Bytes of one wgmma pipeline stage: (bf16 activations, packed weights, e4m3 scales)."""
    return (moe_block_size * tile.tile_k * 2, tile.tile_n * tile.tile_k // PACK_FACTOR * 4,
            tile.tile_n * tile.tile_k // ScaleFormat.E4M3_K16.group_size)


def wgmma_stage_bytes(moe_block_size: int, tile: TileConfig) -> int:
    """One pipeline stage of the wgmma loop."""
    return sum(wgmma_stage_parts(moe_block_size, tile))


def wgmma_shared_memory_footprint(moe_block_size: int, tile: TileConfig, stages: int = STAGES) -> int:
    """Exact dynamic shared bytes of the wgmma kernel (GemmSpec.shared_bytes uses this)."""
    return (route_metadata_bytes(moe_block_size) + WGMMA_SMEM_ALIGN
            + stages * wgmma_stage_bytes(moe_block_size, tile))


def wgmma_tiles(moe_block_size: int) -> tuple[TileConfig, ...]:
    """The wgmma tiles a block size can use, widest first.

    The accumulators are tile_n / 64 * B / 2 floats per thread: 128-row blocks keep them at
    128 with the 128-wide tile (256 would need 256 registers for them alone).
    """
    if moe_block_size == WGMMA_TALL_BLOCK:
        return WGMMA_TILES[1:]
    return WGMMA_TILES if moe_block_size in WGMMA_BLOCK_SIZES else ()


def wgmma_tile(n: int, k: int, moe_block_size: int, scale_format: "ScaleFormat",
               profile: DeviceProfile) -> tuple[TileConfig | None, str | None]:
    """The widest wgmma tile that runs this GEMM on `profile`, or (None, why not)."""
    if profile.arch not in WGMMA_ARCHS:
        return None, f"{profile.name} ({profile.arch}) has no warpgroup MMA"
    if moe_block_size not in WGMMA_BLOCK_SIZES:
        return None, f"the wgmma loop takes {WGMMA_BLOCK_SIZES}-row route blocks, the plan has {moe_block_size}"
    if scale_format is not ScaleFormat.E4M3_K16:
        return None, f"the wgmma loop decodes e4m3_k16 scales, not {scale_format.value}"
    limit = profile.max_shared_memory_per_block_optin - _FIT_SHARED_MEMORY_MARGIN
    tiles = wgmma_tiles(moe_block_size)
    for tile in tiles:
        if (n % tile.tile_n == 0 and k % tile.tile_k == 0
                and wgmma_shared_memory_footprint(moe_block_size, tile) <= limit):
            return tile, None
    return None, f"N={n} and K={k} are not multiples of a wgmma tile ({', '.join(f'{t.tile_n}x{t.tile_k}' for t in tiles)})"


def wgmma_blocks_per_sm(m: int, n: int, top_k: int, moe_block_size: int, tile: TileConfig, profile: DeviceProfile,
                        registers: int) -> int:
    """Co-resident wgmma CTAs per SM (registers, shared memory, threads), lowered for small problems."""
    unit = _REGISTER_UNIT_PER_THREAD
    per_block = -(-registers // unit) * unit * WGMMA_THREADS
    smem = wgmma_shared_memory_footprint(moe_block_size, tile) + _RESIDENT_SHARED_MEMORY_PER_BLOCK
    limit = max(min(profile.registers_per_sm // per_block, profile.shared_memory_per_sm // smem,
                    profile.max_threads_per_sm // WGMMA_THREADS), 1)
    work_ctas = (n // tile.tile_n) * m * top_k * _WORK_CTAS_PER_TILE_ROUTE
    if work_ctas < profile.sm_count * limit:
        limit = max(work_ctas // profile.sm_count, 1)
    return limit


def tile_misfit(
    n: int, k: int, moe_block_size: int, tile: TileConfig, scale_format: ScaleFormat, profile: DeviceProfile
) -> str | None:
    """Why `tile` cannot run an (N, K) GEMM on `profile`, or None if it can.

    Only exact tiling is supported: every N tile, K tile and scale group is whole.
    """
    group = scale_format.group_size
    if n % tile.tile_n:
        return f"N={n} is not a multiple of tile_n={tile.tile_n}"
    if k % tile.tile_k:
        return f"K={k} is not a multiple of tile_k={tile.tile_k}"
    if k % group or tile.tile_k % group:
        return f"K={k} and tile_k={tile.tile_k} must be multiples of the {scale_format.value} scale group {group}"
    if tile.tile_n < 64 or tile.tile_k < 64 or tile.threads < 128:
        return "tile_n and tile_k must be at least 64 with at least 128 threads"
    smem = shared_memory_footprint(moe_block_size, tile, scale_format)
    limit = profile.max_shared_memory_per_block_optin - _FIT_SHARED_MEMORY_MARGIN
    if smem > limit:
        return f"needs {smem} bytes of shared memory, {profile.name} allows {limit} (opt-in minus 512)"
    return None


def blocks_per_sm(
    m: int,
    n: int,
    top_k: int,
    moe_block_size: int,
    tile: TileConfig,
    scale_format: ScaleFormat,
    profile: DeviceProfile,
    registers: int,
) -> int:
    """Persistent CTAs per SM: what registers, shared memory and threads allow, then the seed's caps.

    Block size 8 (the decode path) runs M8_BLOCKS_PER_SM CTAs per SM whatever the
    register estimate says: the kernel's launch bound makes ptxas fit the registers
    (128 per thread at 256 threads), and on the H200 two CTAs per SM were 10-25 %
    faster than the seed's one for Qwen3 shapes at M = 8..64 (benchmarks/tune_gemm.py,
    docs/benchmarks.md).  The seed pinned one because in its fused kernel every CTA
    is a grid-barrier participant; the fused path can pin it again.  One-MMA-row
    tiles go up to 4, taller ones up to 2.  When
    the problem is small (fewer than 4 CTAs of work per (N tile, route)), the count
    drops so the grid is not mostly idle.
    """
    valid = isinstance(registers, int) and not isinstance(registers, bool)
    if not valid or not 1 <= registers <= _MAX_REGISTERS_PER_THREAD:
        raise BadInputError(f"registers must be in [1, {_MAX_REGISTERS_PER_THREAD}] per thread, got {registers!r}")
    unit = _REGISTER_UNIT_PER_THREAD
    registers_per_block = -(-registers // unit) * unit * tile.threads
    smem = shared_memory_footprint(moe_block_size, tile, scale_format)
    smem_limit = profile.max_shared_memory_per_block_optin // (smem + _RESIDENT_SHARED_MEMORY_PER_BLOCK)
    threads_limit = profile.max_threads_per_sm // tile.threads
    limit = min(profile.registers_per_sm // registers_per_block, smem_limit, threads_limit)
    if moe_block_size == 8:
        limit = max(min(M8_BLOCKS_PER_SM, smem_limit, threads_limit), 1)
    elif cta_m_blocks(moe_block_size) == 1:
        limit = max(min(limit, _MAX_BLOCKS_PER_SM_ONE_M_BLOCK), 1)
    else:
        limit = max(min(limit, _MAX_BLOCKS_PER_SM_MULTI_M_BLOCK), 1)
    work_ctas = (n // tile.tile_n) * m * top_k * _WORK_CTAS_PER_TILE_ROUTE
    if work_ctas < profile.sm_count * limit:
        limit = max(work_ctas // profile.sm_count, 1)
    return limit


def packed_m8_blocks_per_sm(profile: DeviceProfile) -> int:
    """CTAs per SM of PACKED_M8_TILE: PACKED_M8_BLOCKS_PER_SM where shared memory and threads allow."""
    smem = shared_memory_footprint(8, PACKED_M8_TILE, ScaleFormat.E4M3_K16) + _RESIDENT_SHARED_MEMORY_PER_BLOCK
    resident = min(profile.max_shared_memory_per_block_optin // smem, profile.max_threads_per_sm // PACKED_M8_TILE.threads)
    return max(1, min(PACKED_M8_BLOCKS_PER_SM, resident))


def select_tile(
    m: int, n: int, k: int, top_k: int, moe_block_size: int, scale_format: ScaleFormat, profile: DeviceProfile,
    *, threads: int | None = None,
) -> tuple[TileConfig, int]:
    """The candidate tile with the most blocks per SM (earliest on ties), and that count.

    threads restricts the candidates to one CTA size (the fused kernel runs FC1 and FC2
    with the same threads).

    Raises BadInputError naming every candidate and why it does not fit when none does.
    """
    candidates = SMALL_BATCH_TILE_CONFIGS if cta_m_blocks(moe_block_size) == 1 else LARGE_BATCH_TILE_CONFIGS
    best: tuple[TileConfig, int] | None = None
    reasons = []
    for tile in candidates:
        if threads is not None and tile.threads != threads:
            reasons.append(f"(tile_k={tile.tile_k}, tile_n={tile.tile_n}): not {threads} threads")
            continue
        reason = tile_misfit(n, k, moe_block_size, tile, scale_format, profile)
        if reason is not None:
            reasons.append(f"(tile_k={tile.tile_k}, tile_n={tile.tile_n}): {reason}")
            continue
        registers = estimated_registers(tile, moe_block_size)
        count = blocks_per_sm(m, n, top_k, moe_block_size, tile, scale_format, profile, registers)
        if best is None or count > best[1]:
            best = (tile, count)
    if best is None:
        raise BadInputError(
            f"no W4A16 tile config fits N={n}, K={k}, moe_block_size={moe_block_size}, "
            f"{scale_format.value} on {profile.name}: "
            + "; ".join(reasons)
            + ". Pad N to a multiple of 128 and K to a multiple of 64 so that (tile_k=64, tile_n=128) fits."
        )
    return best


def select_route_block_size(m: int, top_k: int, num_experts: int) -> int:
    """Rows per route block for packing m * top_k routes by expert.

    The Marlin-MoE rule: with routes spread evenly, an expert gets
    m * top_k / num_experts of them; take the smallest allowed block that this
    average fills to less than 90%, so padding waste stays small while large
    batches get tall blocks (more weight reuse per CTA).  Exact integer arithmetic.
    """
    _check_positive(m=m, top_k=top_k, num_experts=num_experts)
    routes = m * top_k
    for block in ALLOWED_MOE_BLOCK_SIZES:
        if routes * _ROUTE_FILL_DEN < _ROUTE_FILL_NUM * num_experts * block:
            return block
    return ALLOWED_MOE_BLOCK_SIZES[-1]


def max_packed_route_slots(routes: int, block_size: int, num_experts: int) -> int:
    """Worst-case slots after grouping `routes` routes by expert and padding each group.

    At most min(num_experts, routes) groups are non-empty and each pads by at most
    block_size - 1, so routes + groups * (block_size - 1) slots, rounded up to a
    whole block.  (The true maximum is a multiple of block_size below that sum, so
    rounding up is conservative by at most one block; buffers sized by it suffice.)
    """
    if not isinstance(routes, int) or routes < 0:
        raise BadInputError(f"routes must be a non-negative int, got {routes!r}")
    _check_positive(block_size=block_size, num_experts=num_experts)
    bound = routes + min(num_experts, routes) * (block_size - 1)
    return -(-bound // block_size) * block_size


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


def _partition(route_blocks: int, n_tiles: int, k_tiles: int, grid_x: int, uses_m_block_8: bool) -> _Partition:
    """The seed's split of the mn tiles into whole-tile rounds and a split-K tail.

    Whole rounds give each CTA one full tile; the remaining tiles' K iterations are
    cut into grid_x equal contiguous ranges.  A small remainder (at most a third of
    the grid) is merged with one whole round so the tail is never mostly idle.
    Block size 8 with no more tiles than CTAs gives one whole tile per CTA instead.
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
    route_blocks: int, n_tiles: int, k_tiles: int, grid_x: int, uses_m_block_8: bool
) -> list[WorkItem]:
    """Every work item of the persistent GEMM, CTA by CTA, as the seed's kernel schedules it.

    A pure-Python replay of the kernel's persistent loop, used to prove coverage
    and lock-slot bounds in tests and to size scratch; nothing here is launched.
    """
    _check_positive(n_tiles=n_tiles, k_tiles=k_tiles, grid_x=grid_x)
    if not isinstance(route_blocks, int) or route_blocks < 0:
        raise BadInputError(f"route_blocks must be a non-negative int, got {route_blocks!r}")
    p = _partition(route_blocks, n_tiles, k_tiles, grid_x, uses_m_block_8)
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
    _check_positive(grid_x=grid_x)
    return grid_x


def splitk_scratch_floats(grid_x: int, moe_block_size: int, tile_n: int) -> int:
    """float32 elements of split-K scratch: one (16 * cta_m_blocks) x tile_n partial per lock slot.

    The kernel addresses the partial of slot s at s * cta_m * tile_n floats, even for
    block size 8 (which writes fewer rows), so the stride is the full CTA height.
    """
    _check_positive(tile_n=tile_n)
    return lock_slots(grid_x) * MMA_M * cta_m_blocks(moe_block_size) * tile_n


@dataclass(frozen=True)
class GemmPlan:
    """Everything one grouped-GEMM launch needs, for one problem, token count and device.

    direct_topk_routes: each of the m * top_k routes is its own block of 8 rows
    (no route packing); max_route_slots/blocks are the capacities the route
    buffers need (for direct routes: m * top_k blocks of 8 slots).
    """

    moe_block_size: int
    direct_topk_routes: bool
    tile: TileConfig
    registers: int  # per thread: the SM121 estimate unless the real count was given
    shared_memory_bytes: int  # the planning footprint estimate
    blocks_per_sm: int
    grid_x: int
    n_tiles: int
    k_tiles: int
    max_route_slots: int
    max_route_blocks: int
    lock_slots: int
    splitk_scratch_floats: int
    whole_tiles_m8: bool = False  # 8-row blocks: one whole-K tile per CTA when they all fit (no split-K)
    mainloop: str = "mma_sync"  # "wgmma": the sm_90a warpgroup-MMA loop (64-row blocks, WGMMA_TILES)

    @property
    def cta_m_blocks(self) -> int:
        return cta_m_blocks(self.moe_block_size)

    @property
    def uses_m_block_8(self) -> bool:
        return self.moe_block_size == 8


def plan_gemm(
    m: int,
    n: int,
    k: int,
    top_k: int,
    num_experts: int,
    profile: DeviceProfile,
    *,
    scale_format: ScaleFormat,
    pinned_tile: TileConfig | None = None,
    registers: int | None = None,
) -> GemmPlan:
    """Plan the grouped GEMM of m tokens x top_k routes against (N, K) expert weights.

    For FC2 of a fused MoE pass the same m and top_k as FC1 (the seed passes
    m * top_k rows with top_k = 1; only the product enters planning).
    pinned_tile replaces the automatic choice and must pass the same fit check.
    registers is the real per-thread count of the built cubin for that tile: it
    needs pinned_tile, and is what the runtime uses to re-check blocks per SM,
    since a grid larger than what is co-resident deadlocks in the split-K waits.
    """
    _check_positive(m=m, n=n, k=k, top_k=top_k, num_experts=num_experts)
    if top_k > num_experts:
        raise BadInputError(f"top_k={top_k} exceeds num_experts={num_experts}")
    if not isinstance(profile, DeviceProfile):
        raise BadInputError(f"profile must be a DeviceProfile, got {type(profile).__name__}")
    scale_format = _coerce_scale_format(scale_format)
    if registers is not None and pinned_tile is None:
        raise BadInputError("registers= describes one compiled tile: pass it together with pinned_tile=")
    direct = m <= MAX_DIRECT_TOPK_ROUTE_M
    # select_route_block_size gives 8 here anyway (m * top_k <= 6 * num_experts).
    block = 8 if direct else select_route_block_size(m, top_k, num_experts)
    if (block == ALLOWED_MOE_BLOCK_SIZES[-1] and pinned_tile is None and m * top_k >= WGMMA_TALL_BLOCK * num_experts
            and wgmma_tile(n, k, WGMMA_TALL_BLOCK, scale_format, profile)[0] is not None):
        block = WGMMA_TALL_BLOCK  # the average expert fills 128-row blocks: the wgmma loop's tallest
    mainloop = "mma_sync"
    wg_tile = wgmma_tile(n, k, block, scale_format, profile)[0] if pinned_tile is None else None
    if wg_tile is not None:
        # 64-row blocks on sm_90a: the warpgroup-MMA loop (the mma.sync loop is issue-bound there)
        mainloop, tile, used_registers = "wgmma", wg_tile, WGMMA_REGISTERS_SM90[(block, wg_tile.tile_n)]
        per_sm = wgmma_blocks_per_sm(m, n, top_k, block, tile, profile, used_registers)
    elif (pinned_tile is None and block == 8 and not direct and k <= PACKED_M8_MAX_K
          and profile.arch in PACKED_M8_MEASURED_ARCHS
          and tile_misfit(n, k, block, PACKED_M8_TILE, scale_format, profile) is None):
        tile, per_sm = PACKED_M8_TILE, packed_m8_blocks_per_sm(profile)
        used_registers = estimated_registers(tile, block)
    elif pinned_tile is None:
        tile, per_sm = select_tile(m, n, k, top_k, block, scale_format, profile)
        used_registers = estimated_registers(tile, block)
    else:
        tile, used_registers, per_sm = _check_pinned(
            m, n, k, top_k, block, scale_format, profile, pinned_tile, registers
        )
    routes = m * top_k
    whole_tiles = block == 8 and per_sm == 1
    if direct and routes * (n // tile.tile_n) <= profile.sm_count:
        # Every output tile fits on its own SM: one whole-K tile per CTA, one CTA per SM. Two per SM
        # would stack pairs of tiles on half the SMs (measured on the H200: Qwen3-30B FC1 at M = 1
        # 11.4 us at 1/SM vs 17.9 us at 2/SM).
        per_sm, whole_tiles = 1, True
    grid_x = profile.sm_count * per_sm
    if direct:
        slots, blocks = routes * block, routes
    else:
        slots = max_packed_route_slots(routes, block, num_experts)
        blocks = slots // block
    return GemmPlan(
        moe_block_size=block,
        direct_topk_routes=direct,
        tile=tile,
        registers=used_registers,
        shared_memory_bytes=(wgmma_shared_memory_footprint(block, tile) if mainloop == "wgmma"
                             else shared_memory_footprint(block, tile, scale_format)),
        blocks_per_sm=per_sm,
        grid_x=grid_x,
        n_tiles=n // tile.tile_n,
        k_tiles=k // tile.tile_k,
        max_route_slots=slots,
        max_route_blocks=blocks,
        lock_slots=lock_slots(grid_x),
        splitk_scratch_floats=splitk_scratch_floats(grid_x, block, tile.tile_n),
        whole_tiles_m8=whole_tiles,
        mainloop=mainloop,
    )


def _coerce_scale_format(scale_format) -> ScaleFormat:
    try:
        return ScaleFormat(scale_format)
    except ValueError:
        allowed = ", ".join(f.value for f in ScaleFormat)
        raise BadInputError(f"scale_format must be one of {allowed}, got {scale_format!r}") from None


def _check_pinned(m, n, k, top_k, block, scale_format, profile, tile, registers) -> tuple[TileConfig, int, int]:
    """Validate a pinned tile with the automatic choice's fit check; its registers and blocks per SM."""
    if not isinstance(tile, TileConfig):
        raise BadInputError(f"pinned_tile must be a TileConfig, got {type(tile).__name__}")
    reason = tile_misfit(n, k, block, tile, scale_format, profile)
    if reason is not None:
        raise BadInputError(
            f"pinned tile (tile_k={tile.tile_k}, tile_n={tile.tile_n}, threads={tile.threads}) "
            f"does not fit N={n}, K={k}, moe_block_size={block} on {profile.name}: {reason}"
        )
    used = estimated_registers(tile, block) if registers is None else registers
    return tile, used, blocks_per_sm(m, n, top_k, block, tile, scale_format, profile, used)
