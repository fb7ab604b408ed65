"""Build-time planning of the fused W4A16 MoE kernel (FC1 -> activation -> FC2 in one launch).

Runs only in the build: for every token count it decides the kernel, grid and buffer
capacities that the manifest's resolution table records and the runtime serves.  It
builds on planning.py beside it: both
GEMMs use one route block size (they read the same packed routes), one CTA
size (one kernel) and one blocks-per-SM count (one persistent grid).

Two regimes, as in the seed:

* decode (M <= DECODE_MAX_M = 2, or up to DECODE_MEASURED_MAX_M where planning.MEASURED_BLOCKS
  measured it faster for the layer's shape; no expert_map, no amax calibration): every route is
  its own 8-row block read straight from topk_ids (no route packing); FC2 adds
  each route's row into its token's output row with red.add, so the top-k sum
  is folded into the kernel and the output is zeroed in its prologue.  Where one
  wave of whole-K tiles covers both GEMMs, the grid is right-sized to FC1's tiles and
  each CTA owns one whole tile (no split-K); where either GEMM would need a second
  wave, K is split over every co-resident CTA instead (measured 0.76-0.94x on the
  H200, see DECODE_ONE_WAVE).  Wide N tiles are chosen where they save a wave.  Where
  planning.MEASURED_BLOCKS measured it faster (knob "micro"; "microstored" for weights read as
  stored), a decode launch runs the
  barrier-free micro kernel instead (FusedSpec.micro: one CTA per route and FC1 tile, FC2
  over that tile's slice of K, float32 sums in the lock words; `_micro_plan`).
* packed: routes grouped by expert (pack_routes), FC2 writes route rows, a
  separate top-k sum kernel combines them; the grid is every co-resident CTA.
  Where planning.MEASURED_BLOCKS measured it faster (knob "topksum"), a packed
  plan's FC2 adds its rows into the output instead, as decode does; where the
  layer runs as two GEMMs (split_layer) the knob is "splitsum" (the runtime
  zeroes the output first).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cuteaot.runtime.devices import DeviceProfile
from cuteaot.runtime.errors import BadInputError
from cuteaot.runtime.kernels.w4a16.fused_spec import MICRO_SUMS_WORD, PACK_MAX_EXPERTS, PACK_MAX_ROUTES, FusedSpec
from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec, Mainloop, modelopt_scale_exponent, stored_w13_facts
from cuteaot.runtime.resolution import MoeLayerFacts
from cuteaot.runtime.types import WeightFormat
from cuteaot.runtime.weights import stored_dims
from cuteaot.runtime.kernels.w4a16.geometry import (
    ALLOWED_MOE_BLOCK_SIZES,
    BARRIER_WORDS,
    WGMMA_BLOCK_SIZES,
    WGMMA_TALL_BLOCK,
    ScaleFormat,
    TileConfig,
    cta_m_blocks,
    fused_gemm_dims,
    max_packed_route_slots,
    splitk_scratch_floats,
    tile_count,
    wgmma_tiles,
)

from .planning import (
    GemmPlan,
    gemm_spec_for,
    plan_for,
    LARGE_BATCH_TILE_CONFIGS,
    small_block_tile,
    SMALL_BATCH_TILE_CONFIGS,
    WGMMA_ARCHS,
    WGMMA_MIXED_MAX_ROUTES,
    WGMMA_REGISTERS_SM90,
    WGMMA_WIDE_MIN_ROUTES,
    _MAX_BLOCKS_PER_SM_MULTI_M_BLOCK,
    _MAX_BLOCKS_PER_SM_ONE_M_BLOCK,
    _RESIDENT_SHARED_MEMORY_PER_BLOCK,
    blocks_per_sm,
    estimated_registers,
    layer_rules,
    measured_choice,
    on_wgmma,
    packed_m8_blocks_per_sm,
    promoted_block,
    select_route_block_size,
    select_tile,
    tile_misfit,
    wgmma_blocks_per_sm,
    wgmma_tall_block,
    wgmma_tile,
    wide_by_k,
)

# Tokens up to which the decode regime (direct routes, fused top-k sum) is used.  The seed used it
# up to 8; a decode-vs-packed sweep on the H200 (docs/benchmarks.md, "Decode or packed at small M";
# the tool, benchmarks/tune_moe.py, patched this constant at serve time and went with frozen
# resolution; deterministic=True layers now time the packed path at M <= 2) found it faster than the packed
# path only at M <= 2 (Qwen3-30B M = 1: 22.7 vs 36.2 us) and slower from M = 3 (M = 8: 81.0 vs
# 75.3 us; gpt-oss-120b 208.3 vs 171.1 us): one route per block re-reads shared experts and its
# whole-tile waves quantise badly.
DECODE_MAX_M = 2
# The largest M a measured table (planning.MEASURED_BLOCKS, knob "decode") may give the decode regime:
# the seed's bound, and what benchmarks/tune_blocks.py's "always" candidate plans.
DECODE_MEASURED_MAX_M = 8
# Packed plans with at most PACK_MAX_ROUTES routes pack them inside the fused kernel
# (FusedSpec.pack_experts: every CTA groups the topk_ids by expert into its shared memory before FC1) instead
# of a route-pack launch before it (~6 us of a layer call at M = 8-64 on the H200, docs/benchmarks.md "Route
# packing's share of a layer call").  A/B on the H200 (compare_layer, 2026-12-04, every shipped shape, M = 3-128):
# 0.95-0.99x the time where it packs (Qwen3-30B-A3B M = 8: 57.6 -> 54.6 us), nothing slower past noise (<= 1.004x).
PACK_IN_KERNEL = True
# Decode keeps whole-K tiles on a right-sized grid only while one wave of them covers FC1 and FC2;
# otherwise K is split over every co-resident CTA.  A/B on the H200 (benchmarks/compare_layer.py,
# docs/benchmarks.md "Decode: split K over the grid"): splitting took 0.76-0.94x the time wherever
# the whole-tile plan needed a second wave (GLM-4.5-Air, Qwen3-235B, gpt-oss-120b M = 2, Mixtral,
# Nemotron M = 2) and 1.05-1.12x where one wave sufficed (Qwen3-30B and gpt-oss-120b at M = 1).
DECODE_ONE_WAVE = "whole tiles while one wave covers both GEMMs"
# The fused kernel's mma.sync loop with 64-row route blocks needs 255 registers and spills
# 256-288 B of stack on sm_100a / sm_120a / sm_121a (every such kernel of specs/moe-models.yaml,
# compiled 2026-12-01); 48-row blocks fit in 194-196 registers without spilling.  On sm_90a large
# blocks take the wgmma loop instead.
FUSED_MMA_SYNC_MAX_BLOCK = 48
# CTAs per SM of the fused kernel's packed mma.sync loop by arch and route block, replacing the
# register estimate and the seed's cap (2 for blocks of two MMA rows).  sm_90a: ptxas fits 16-row
# blocks in 126 registers at 4/SM and 32-row blocks in 162 at 3/SM without spilling; A/B on the
# H200 (benchmarks/compare_layer.py, docs/benchmarks.md "One more CTA per SM"): 0.93-0.95x the time
# at M = 256-384 on Qwen3-30B, Qwen3-235B, GLM-4.5-Air and Nemotron, no slower elsewhere (<= 1.005).
# Not on sm_100a: there the same launch bounds spill (168 registers + 32-40 B of stack).
FUSED_PACKED_BLOCKS_PER_SM = {"sm_90a": {16: 4, 32: 3}}
WIDE_TILE = TileConfig(64, 256)  # decode's wide-N tile (256 threads like the default 128x128)
# modelopt FC1 tiles of a gated layer: at most this wide where a wider one would straddle gate | up
MODELOPT_HALF_TILE_N = 128
# modelopt decode plans keep their 128-deep tiles (64-byte pieces of each stored row a stage) where packed ones widen
# to WIDE_TILE (64 deep: 32-byte pieces).  A/B on the H200 (compare_layer --weights modelopt, docs/benchmarks.md
# "twelfth session"): widening took 1.16x the time of not widening at GLM-4.5-Air M = 1, 1.08x at M = 2 and
# 1.23x at Qwen3-30B M = 2.
MODELOPT_DECODE_WIDE = False
# modelopt layers: at most this many CTAs per SM for 16- and 32-row blocks, below the packed caps (4, 3).
# Its first decode needed 144 and 195 registers there on sm_90a (the packed caps' 128 and 168 spilled);
# with the (j, j + 4) pairing 32-row blocks still spill 8 B at 168 while 16-row ones fit 128 in the
# shape checked (H 512, I 384).  4 CTAs for 16-row blocks (128 registers, no spills) measured 0.99-1.03x the
# time of 3 on the H200 (compare_layer --weights modelopt, four shapes at M = 128-256,
# docs/results/ab-modelopt-b16-4ctas-2026-12-02.json): not taken.
MODELOPT_BLOCKS_PER_SM = {16: 3, 32: 2}
# modelopt layers split into wgmma GEMMs: 128-row blocks from this many routes per expert on average
# (packed: WGMMA_TALL_MIN_ROUTES or the measured choice), and 256-row blocks wherever the average
# expert fills them, whatever K (packed: the K rule or the measured choice).  The stored layout's
# decode costs ~3x the packed one per weight, and taller blocks decode each weight for more rows.
# A/B on the H200 (benchmarks/compare_layer.py --weights modelopt, docs/results/ab-modelopt-tall-*):
# Qwen3-30B 0.87x the time at M = 1024, 0.93x at 4096, 0.90x at 8192; Qwen3-235B tp4 (FC2 K = 384)
# 0.90x / 0.96x / 0.92x; GLM-4.5-Air (plans unchanged) and M = 2048 within 1 %.
MODELOPT_TALL_MIN_ROUTES = 64
MODELOPT_WIDE_ANY_K = True


@dataclass(frozen=True)
class FusedPlan:
    """One fused launch: kernel facts (tiles, block, blocks/SM) and launch facts (grid)."""

    m: int
    decode: bool
    moe_block_size: int
    fc1_tile: TileConfig
    fc2_tile: TileConfig
    blocks_per_sm: int
    grid_x: int
    max_grid_x: int  # sm_count * blocks_per_sm: co-residency bound, sizes locks and scratch
    max_route_slots: int
    max_route_blocks: int
    mainloop: str = "mma_sync"  # "wgmma": both GEMMs run the sm_90a warpgroup-MMA loop
    # 8-row blocks take one whole-K tile per CTA when the tiles fit the grid (the seed's fused
    # choice); multi-wave decode plans split K over the grid instead
    whole_tiles_m8: bool = False
    # packed routes: FC2 adds each route's row into the output (FusedSpec.topk_sum)
    topk_sum: bool = False
    # packed routes: the kernel packs them itself, no route-pack launch before it (FusedSpec.pack_experts)
    pack_routes: bool = False
    # decode on the barrier-free micro kernel (FusedSpec.micro), and its (M, H) float32 output sums (in `locks`)
    micro: bool = False
    micro_sums: int = 0

    @property
    def lock_words(self) -> int:
        """The barrier words and a split-K lock slot per co-resident CTA; micro: its counter and output sums."""
        return max(BARRIER_WORDS + self.max_grid_x, MICRO_SUMS_WORD + self.micro_sums)

    @property
    def c_tmp_floats(self) -> int:
        """Split-K scratch shared by both GEMMs (FC2 starts after a grid barrier)."""
        return max(splitk_scratch_floats(self.max_grid_x, self.moe_block_size, t.tile_n)
                   for t in (self.fc1_tile, self.fc2_tile))


def plan_fused(
    m: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    top_k: int,
    gated: bool,
    profile: DeviceProfile,
    *,
    expert_map: bool = False,
    collect_amax: bool = False,
    deterministic: bool = False,
    scale_format: ScaleFormat = ScaleFormat.E4M3_K16,
    tall: bool | None = None,
    decode: bool | None = None,
    short: bool | None = None,
    promote: bool | None = None,
    onewave: bool | None = None,
    topk_sum: bool | None = None,
    stored_as_is: bool = False,
    splitk: bool | None = None,
) -> FusedPlan:
    """Plan the fused MoE launch for m tokens (num_experts = the routing's expert count).

    `deterministic` rules out the decode regime, whose top-k sum adds rows with bf16 atomics
    in no fixed order; every other step sums in a fixed order.  `scale_format` is the weights'
    (NF3: e4m3_k32, which only the mma.sync loop decodes).  `tall`: 128-row wgmma blocks or not
    (planning.wgmma_tall_block; None: the average-routes rule).  `decode`: the decode regime up to
    DECODE_MEASURED_MAX_M tokens (None: up to DECODE_MAX_M).  `short`: 16- to 48-row blocks on the wgmma
    loop (None: planning.WGMMA_SHORT).  `promote`: 16-row wgmma blocks where the rule packs 8-row ones.
    `onewave`: a decode grid sized to the larger GEMM's whole tiles (None: to FC1's, `_decode_grid`).
    `splitk`: a decode launch splits K over every co-resident CTA even where one wave of whole tiles fits
    (None: the rule, `_decode_grid`; takes precedence over `onewave`).
    `topk_sum`: packed plans whose FC2 adds the routes' rows into the output (bf16 red.add, no fixed
    order: not with `deterministic`; not with expert_map or calibration) instead of a top-k sum kernel.
    `stored_as_is`: weights read as ModelOpt stores them (the modelopt layout): the mma.sync loop only (its
    wgmma plans are `split_layer`'s), and FC1 tiles that do not straddle the gate | up boundary (each half has
    its own global scale).
    """
    scale = ScaleFormat(scale_format)
    for name, v in (("m", m), ("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                    ("num_experts", num_experts), ("top_k", top_k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise BadInputError(f"{name} must be a positive int, got {v!r}")
    if top_k > num_experts:
        raise BadInputError(f"top_k={top_k} exceeds num_experts={num_experts}")
    dims = fused_gemm_dims(hidden_size, intermediate_size, gated, nf3=scale is ScaleFormat.E4M3_K32)
    (n1, k1), (n2, k2) = dims
    tall, promote = layer_rules(m, top_k, num_experts, (n1, n2), profile, tall, promote)
    direct = m <= DECODE_MAX_M if decode is None else decode and m <= DECODE_MEASURED_MAX_M
    decode = direct and not expert_map and not collect_amax and not deterministic
    layout = "modelopt" if stored_as_is else "packed"
    block = 8 if decode else select_route_block_size(m, top_k, num_experts)
    if not decode:
        block = promoted_block(block, dims, scale, profile, layout, promote, short)
    if block == ALLOWED_MOE_BLOCK_SIZES[-1] and profile.arch not in WGMMA_ARCHS:
        block = FUSED_MMA_SYNC_MAX_BLOCK  # 64-row blocks spill there (see the constant)
    routes = m * top_k

    t1, _ = select_tile(m, n1, k1, top_k, block, scale, profile, layout=layout)
    t2, _ = select_tile(m, n2, k2, top_k, block, scale, profile, layout=layout)
    if t1.threads != t2.threads:
        threads = min(t1.threads, t2.threads)
        t1, _ = select_tile(m, n1, k1, top_k, block, scale, profile, threads=threads, layout=layout)
        t2, _ = select_tile(m, n2, k2, top_k, block, scale, profile, threads=threads, layout=layout)
    if decode:
        t1, t2 = _decode_wide_tiles(routes, n1, k1, n2, k2, t1, t2, profile, scale, bool(onewave), layout)
    if stored_as_is and gated and intermediate_size % t1.tile_n:
        t1 = TileConfig(t1.tile_k * t1.tile_n // MODELOPT_HALF_TILE_N, MODELOPT_HALF_TILE_N)  # same threads

    summed = bool(topk_sum) and not decode and not expert_map and not collect_amax and not deterministic
    wg = None if decode or stored_as_is else _wgmma_plan(m, top_k, num_experts, block, (n1, k1), (n2, k2), profile,
                                                          scale, tall, short)
    if wg is not None:
        block, t1, t2, bps = wg
        cap = profile.sm_count * bps
        slots = max_packed_route_slots(routes, block, num_experts)
        return FusedPlan(m=m, decode=False, moe_block_size=block, fc1_tile=t1, fc2_tile=t2, blocks_per_sm=bps,
                         grid_x=cap, max_grid_x=cap, max_route_slots=slots, max_route_blocks=slots // block,
                         mainloop="wgmma", whole_tiles_m8=False, topk_sum=summed,
                         pack_routes=_packs_in_kernel(routes, num_experts, expert_map, collect_amax))

    def per_sm(n: int, tile: TileConfig) -> int:
        cap = None if decode else FUSED_PACKED_BLOCKS_PER_SM.get(profile.arch, {}).get(block)
        count = blocks_per_sm(m, n, top_k, block, tile, scale, profile, estimated_registers(tile, block), cap)
        return min(count, MODELOPT_BLOCKS_PER_SM.get(block, count)) if stored_as_is else count

    bps = min(per_sm(n1, t1), per_sm(n2, t2))
    chosen = None if decode else [small_block_tile(n, k, block, scale, profile, layout) for n, k in dims]
    if chosen and block > 8:  # taller blocks: a GEMM the deep tile does not fit keeps its general tile
        chosen = [c or t for c, t in zip(chosen, (t1, t2))]
    if chosen and None not in chosen and chosen[0].threads == chosen[1].threads:  # one CTA size for both GEMMs
        t1, t2 = chosen
        bps = (min(packed_m8_blocks_per_sm(profile, t) for t in chosen) if block == 8
               else min(per_sm(n1, t1), per_sm(n2, t2)))
    cap = profile.sm_count * bps
    grid_x, whole_tiles = cap, block == 8
    if decode:
        grid_x, whole_tiles = _decode_grid(routes * tile_count(n1, t1.tile_n), routes * tile_count(n2, t2.tile_n), cap,
                                           bool(onewave), bool(splitk))
        slots, blocks = routes * block, routes
    else:
        slots = max_packed_route_slots(routes, block, num_experts)
        blocks = slots // block
    return FusedPlan(
        m=m, decode=decode, moe_block_size=block, fc1_tile=t1, fc2_tile=t2, blocks_per_sm=bps,
        grid_x=grid_x, max_grid_x=cap, max_route_slots=slots, max_route_blocks=blocks, whole_tiles_m8=whole_tiles,
        topk_sum=summed,
        pack_routes=not decode and _packs_in_kernel(routes, num_experts, expert_map, collect_amax),
    )


# The micro kernel's work item is one FC1 tile of one route: with MICRO_FC1_128, its FC1 tiles are 128 columns
# wide (as deep as the decode plan's CTA size makes them), the narrowest a gated epilogue takes, so that the items
# are as many as they can be (the decode plan widens them to 256 where that saves a wave, or takes 64 where its
# CTA is 128 threads).  With MICRO_ONE_CTA_PER_SM, a launch whose items fit one per SM runs one CTA an SM
# (blocks_per_sm 1: the whole register file for the FC2 slice's loads in flight).
MICRO_FC1_128 = True
MICRO_ONE_CTA_PER_SM = True


def _micro_plan(plan: FusedPlan, facts: MoeLayerFacts, profile: DeviceProfile) -> FusedPlan:
    """A decode plan on the micro kernel, where FusedSpec.micro can serve the layer (else the plan as it is):
    one CTA per work item (a route's FC1 tile) up to the co-resident grid, whole-K FC1 tiles."""
    fc1 = plan.fc1_tile
    if MICRO_FC1_128 and fc1.tile_n != 128:
        fc1 = TileConfig(fc1.tile_k * fc1.tile_n // 128, 128)  # the same threads
    items = plan.m * facts.top_k * tile_count(facts.activation.fc1_width(facts.intermediate_size), fc1.tile_n)
    per_sm = 1 if MICRO_ONE_CTA_PER_SM and items <= profile.sm_count else plan.blocks_per_sm
    cap = profile.sm_count * per_sm
    micro = replace(plan, micro=True, micro_sums=plan.m * facts.hidden_size, fc1_tile=fc1, blocks_per_sm=per_sm,
                    grid_x=min(items, cap), max_grid_x=cap, whole_tiles_m8=True)
    try:
        fused_spec_for(micro, facts)
    except BadInputError:
        return plan
    return micro


def _packs_in_kernel(routes: int, num_experts: int, expert_map: bool, collect_amax: bool) -> bool:
    """Whether a packed plan packs its routes in the fused kernel (PACK_IN_KERNEL): its tables hold them."""
    return (PACK_IN_KERNEL and not (expert_map or collect_amax) and routes <= PACK_MAX_ROUTES
            and num_experts <= PACK_MAX_EXPERTS)


def _decode_grid(fc1_tiles: int, fc2_tiles: int, cap: int, onewave: bool = False,
                 splitk: bool = False) -> tuple[int, bool]:
    """(grid, whole tiles) of a decode launch: one whole tile per CTA while one wave covers both GEMMs
    (the grid right-sized to FC1's tiles), else split K over all `cap` co-resident CTAs (DECODE_ONE_WAVE).

    `onewave` (the measured knob): the grid is right-sized to the larger GEMM's tiles wherever both fit
    in one wave of co-resident CTAs, so a GEMM with more tiles than FC1 is not split (CTAs past a
    GEMM's tile count sit that phase out).  `splitk` (the measured knob): split K over all `cap` CTAs
    always, so that every SM streams an equal share of both GEMMs' k-tiles."""
    if splitk:
        return cap, False
    if onewave and max(fc1_tiles, fc2_tiles) <= cap:
        return max(fc1_tiles, fc2_tiles), True
    waves = -(-fc1_tiles // cap)
    grid = fc1_tiles // waves if fc1_tiles % waves == 0 else cap
    if max(-(-fc1_tiles // grid), -(-fc2_tiles // grid)) > 1:
        return cap, False
    return grid, True


def _wgmma_plan(m, top_k, num_experts, block, fc1_dims, fc2_dims, profile, scale_format, tall, short):
    """(block, FC1 tile, FC2 tile, CTAs/SM) when both GEMMs can run the wgmma loop, else None.

    The same rule as the standalone GEMM (planning.py `plan_gemm`): 64-row blocks take the
    warpgroup-MMA loop on sm_90a, and 128-row blocks once the average expert fills them.  One
    kernel runs both phases, so the grid is what both phases' register and shared-memory use let
    co-reside.
    """
    block = wgmma_tall_block(m, top_k, num_experts, block, (fc1_dims, fc2_dims), scale_format, profile, tall)
    if not on_wgmma(block, short):
        return None
    tiles = [wgmma_tile(n, k, block, scale_format, profile)[0] for n, k in (fc1_dims, fc2_dims)]
    if None in tiles:
        return None
    per_sm = min(wgmma_blocks_per_sm(m, n, top_k, block, t, profile, WGMMA_REGISTERS_SM90[(block, t.tile_n)])
                 for (n, _), t in zip((fc1_dims, fc2_dims), tiles))
    return block, tiles[0], tiles[1], per_sm


def _decode_wide_tiles(routes, n1, k1, n2, k2, t1, t2, profile, scale_format,
                       onewave: bool = False, layout: str = "packed") -> tuple[TileConfig, TileConfig]:
    """The seed's decode overrides: 256-wide N tiles where they remove a persistent wave.

    FC1 widens only when the default tile needs two waves of SMs and the wide one
    fits one; FC2 (usually twice FC1's tiles) widens whenever it fits, so it runs in
    FC1's waves.  Both keep 256 threads (the fused kernel's one CTA size).  The
    seed's further 512x32 FC2 tile is not ported (tiles here are multiples of 64).
    `onewave` (the grid covers both GEMMs' tiles, `_decode_grid`): FC2 keeps its default tile where
    both GEMMs' default tiles fit one CTA per SM, so it spreads over twice the CTAs.
    The stored layout keeps its tiles (MODELOPT_DECODE_WIDE).
    """
    if layout == "modelopt" and not MODELOPT_DECODE_WIDE:
        return t1, t2

    def fits(n, k):
        return tile_misfit(n, k, 8, WIDE_TILE, scale_format, profile, layout) is None

    sms = profile.sm_count
    default_tiles = routes * tile_count(n1, t1.tile_n)
    if (t1 == TileConfig(128, 128) and sms < default_tiles <= 2 * sms and default_tiles // 2 <= sms
            and fits(n1, k1)):
        t1 = WIDE_TILE
    if (t2 == TileConfig(128, 128) and t1.threads == WIDE_TILE.threads and fits(n2, k2)
            and not (onewave and max(default_tiles, routes * tile_count(n2, t2.tile_n)) <= sms)):
        t2 = WIDE_TILE
    return t1, t2


def workspace_bounds(max_tokens: int, top_k: int, num_experts: int, profile: DeviceProfile) -> dict[str, int]:
    """Upper bounds of every buffer a fused launch with m <= max_tokens can need on `profile`.

    Exact per-plan sizes depend on m; a layer preallocates these bounds once so that
    every bucket (and CUDA-graph capture) runs without allocating.
    """
    routes = max_tokens * top_k
    tiles = {t.tile_n for t in SMALL_BATCH_TILE_CONFIGS + LARGE_BATCH_TILE_CONFIGS} | {WIDE_TILE.tile_n}

    def grid(block: int) -> int:  # blocks_per_sm's caps: 4 CTAs/SM for one-MMA-row tiles, 2 for taller
        per_sm = _MAX_BLOCKS_PER_SM_ONE_M_BLOCK if cta_m_blocks(block) == 1 else _MAX_BLOCKS_PER_SM_MULTI_M_BLOCK
        if block in WGMMA_BLOCK_SIZES:  # ... and what the wgmma loop's registers and shared memory allow
            per_sm = max([per_sm] + [wgmma_blocks_per_sm(max_tokens, 1 << 20, top_k, block, t, profile,
                                                         WGMMA_REGISTERS_SM90[(block, t.tile_n)])
                                     for t in wgmma_tiles(block)])
        return profile.sm_count * per_sm

    blocks = ALLOWED_MOE_BLOCK_SIZES + (WGMMA_TALL_BLOCK,)
    c_tmp = max(splitk_scratch_floats(grid(b), b, n) for b in blocks for n in tiles)
    slots = max([routes * 8] + [max_packed_route_slots(routes, b, num_experts) for b in blocks])
    return {
        "c_tmp_floats": c_tmp,
        "lock_words": BARRIER_WORDS + max(grid(b) for b in blocks),
        "route_slots": slots,
        "route_blocks": max(routes, max(max_packed_route_slots(routes, b, num_experts) // b for b in blocks)),
    }


def fused_spec_for(plan: FusedPlan, facts: MoeLayerFacts, amax_experts: int = 0) -> FusedSpec:
    """The kernel a plan selects for a layer with these (normalised) facts.

    amax_experts: rows of the calibration table (the weights' expert count) when
    facts.calibration, else unused.
    """
    return FusedSpec(
        dtype=facts.dtype, hidden_size=facts.hidden_size, intermediate_size=facts.intermediate_size,
        top_k=facts.top_k, activation=facts.activation,
        fc1_tile_n=plan.fc1_tile.tile_n, fc1_tile_k=plan.fc1_tile.tile_k,
        fc2_tile_n=plan.fc2_tile.tile_n, fc2_tile_k=plan.fc2_tile.tile_k,
        moe_block_size=plan.moe_block_size, blocks_per_sm=plan.blocks_per_sm, decode=plan.decode,
        router_weight_on_input=facts.router_weight_on_input, expert_map=facts.expert_map,
        collect_amax=facts.calibration, fast_math=facts.fast_math, swiglu_alpha=facts.swiglu_alpha,
        swiglu_beta=facts.swiglu_beta, swiglu_limit=facts.swiglu_limit, whole_tiles_m8=plan.whole_tiles_m8,
        amax_experts=(amax_experts or facts.num_experts) if facts.calibration else 0,
        mainloop=Mainloop(plan.mainloop), bias=facts.bias, weights=facts.weights,
        scale_exponent=_scale_exponent(facts), gated_epilogue=True if fused_gated_epilogue(plan, facts) else None,
        topk_sum=True if plan.topk_sum else None,
        pack_experts=facts.num_experts if plan.pack_routes else None, micro=True if plan.micro else None,
    )


# The fused kernel's FC1 applies a gated activation in its epilogue (gate and up columns of one
# output staged in one tile) instead of an activation pass between two grid barriers, wherever its
# GemmSpec allows it (unpadded FC1 N, 128-column multiples of tiles).  Measured on the H200
# (compare_layer, docs/benchmarks.md 2026-12-02): 0.90-0.99x the time for NVFP4 (packed and read as
# stored) at every fused M; NF3 gained at 8-row blocks (0.94-0.98x) but took 1.05x at 32-row ones
# (Qwen3-30B M = 256), so NF3 keeps the pass above NF3_GATED_MAX_BLOCK rows.
FUSED_GATED_EPILOGUE = True
NF3_GATED_MAX_BLOCK = 16


def fused_gated_epilogue(plan: FusedPlan, facts: MoeLayerFacts) -> bool:
    """Whether the fused kernel of this plan activates in FC1's epilogue (FUSED_GATED_EPILOGUE's rule)."""
    if not (FUSED_GATED_EPILOGUE and facts.gated) or plan.fc1_tile.tile_n % 128:
        return False
    if facts.weights is WeightFormat.NF3 and plan.moe_block_size > NF3_GATED_MAX_BLOCK:
        return False  # measured slower (above)
    return whole_gate_up_slabs(facts)


def whole_gate_up_slabs(facts: MoeLayerFacts) -> bool:
    """Each half of FC1's N = 2I is whole 64-column slabs (I a multiple of 64: stored unpadded, N a multiple
    of 128), so every slab lies in the gate or the up half: what a gated epilogue (GemmSpec) needs to
    stage gate and up columns in one tile."""
    return facts.gated and facts.intermediate_size % 64 == 0


def _scale_exponent(facts: MoeLayerFacts) -> int | None:
    """The scale_exponent key fact of the layer's kernels: the stored layout's decode exponent, else None."""
    return modelopt_scale_exponent(facts.dtype) if facts.weights.layout == "modelopt" else None


def layer_choice(knob: str, m: int, facts: MoeLayerFacts, profile: DeviceProfile) -> bool | None:
    """The measured choice of `knob` for this layer shape at m tokens (None: the rule decides);
    "decode" only up to DECODE_MEASURED_MAX_M."""
    if knob == "decode" and m > DECODE_MEASURED_MAX_M:
        return None
    return measured_choice(knob, m, facts.hidden_size, facts.intermediate_size, facts.num_experts, facts.top_k,
                           facts.gated, profile)


def plan_layer(m: int, facts: MoeLayerFacts, profile: DeviceProfile) -> FusedPlan:
    """plan_fused for a layer described by its facts; a plan whose in-kernel route packing would not leave
    its CTAs per SM co-resident (the tables cost shared memory: sm_120's 100 KiB per SM) packs before it."""
    plan = plan_fused(m, facts.hidden_size, facts.intermediate_size, facts.num_experts, facts.top_k, facts.gated,
                      profile, expert_map=facts.expert_map, collect_amax=facts.calibration,
                      deterministic=facts.deterministic, scale_format=ScaleFormat(facts.weights.scale_format),
                      tall=layer_choice("tall", m, facts, profile), decode=layer_choice("decode", m, facts, profile),
                      promote=layer_choice("promote", m, facts, profile),
                      onewave=layer_choice("onewave", m, facts, profile),
                      topk_sum=layer_choice("topksum", m, facts, profile),
                      stored_as_is=facts.weights.layout == "modelopt",
                      splitk=layer_choice("splitk", m, facts, profile))
    if plan.decode and layer_choice("microstored" if facts.weights.layout == "modelopt" else "micro", m, facts,
                                    profile):
        plan = _micro_plan(plan, facts, profile)
    if plan.pack_routes:
        shared = fused_spec_for(plan, facts).shared_bytes
        if (shared > profile.max_shared_memory_per_block_optin
                or (shared + _RESIDENT_SHARED_MEMORY_PER_BLOCK) * plan.blocks_per_sm > profile.shared_memory_per_sm):
            plan = replace(plan, pack_routes=False)
    return plan


# Where FC1 runs as its own grouped GEMM (split_layer) on a gated layer, its epilogue applies the
# activation (gate and up columns of one output in one tile: GemmSpec's gated epilogues) instead of a
# separate activation kernel, unless N is zero-padded (no whole gate | up slabs).
GATED_FC1_EPILOGUE = True


@dataclass(frozen=True)
class GemmPhase:
    """One GEMM launch of a layer run as two: its plan and the kernel it selects."""

    plan: GemmPlan
    spec: GemmSpec


def split_layer(m: int, facts: MoeLayerFacts, profile: DeviceProfile) -> tuple[GemmPhase, GemmPhase] | None:
    """FC1 and FC2 as two grouped-GEMM launches where that beats the fused kernel, else None.

    Measured on the H200 (benchmarks/large_m.py, docs/benchmarks.md "Large-M study"): where both
    GEMMs run the warpgroup-MMA loop, the two launches (intermediate through HBM, no grid
    barrier, each GEMM on its own best grid) take 0.92-0.99x the fused kernel's time on
    Qwen3-30B, gpt-oss-120b and GLM-4.5-Air; on the mma.sync loop they do not win reliably.
    Both GEMMs read one packing of the routes: the same block, or FC2 128-row blocks of FC1's
    256-row packing (WGMMA_MIXED_MAX_ROUTES).  Expert maps and
    calibration keep the fused kernel (it zeroes remote experts' rows and collects amax).
    NVFP4 read as stored (modelopt) splits where packed NVFP4 does: the wgmma loop reads it too.
    The measured "fusepack" choice keeps the fused kernel where it packs the routes itself.
    """
    if facts.expert_map or facts.calibration or facts.weights is WeightFormat.NF3:
        return None  # (NF3 has no wgmma loop, the split's reason to exist)
    fc1_n = facts.activation.fc1_width(facts.intermediate_size)
    if layer_choice("decode", m, facts, profile):
        return None  # the fused decode regime serves this M
    if layer_choice("fusepack", m, facts, profile) and plan_layer(m, facts, profile).pack_routes:
        return None  # measured: the fused kernel, packing its routes itself, beats two launches and a packing
    (n1_stored, k1_stored), (n2_stored, k2_stored) = (stored_dims(fc1_n, facts.hidden_size),
                                                      stored_dims(facts.hidden_size, facts.intermediate_size))
    tall = layer_choice("tall", m, facts, profile)
    # 256-row blocks: both GEMMs or neither (one packing of the routes); measured, else the K rule on both
    wide = layer_choice("wide", m, facts, profile)
    promote = layer_choice("promote", m, facts, profile)
    producer = layer_choice("producer", m, facts, profile)
    tall_wide = layer_choice("tallwide", m, facts, profile)
    if facts.weights.layout == "modelopt":
        if tall is None and m * facts.top_k >= MODELOPT_TALL_MIN_ROUTES * facts.num_experts:
            tall = True
        if wide is None and MODELOPT_WIDE_ANY_K:
            wide = True
    # the layer rules where nothing was measured, over both GEMMs' tiles (one packing serves both)
    tall, promote = layer_rules(m, facts.top_k, facts.num_experts, (n1_stored, n2_stored), profile, tall, promote)
    # FC1 alone on 256-row blocks, FC2 reading them as 128-row ones (WGMMA_MIXED_MAX_ROUTES), where only
    # FC2's K keeps the layer off them and nothing was measured
    mixed = (wide is None and not wide_by_k(k1_stored, k2_stored) and wide_by_k(k1_stored)
             and WGMMA_WIDE_MIN_ROUTES * facts.num_experts <= m * facts.top_k
             < WGMMA_MIXED_MAX_ROUTES * facts.num_experts)
    if wide is None:
        wide = wide_by_k(k1_stored, k2_stored)
    if layer_choice("narrow", m, facts, profile):
        wide = mixed = False  # measured: 128-row blocks beat the 256-row ones the rule or "wide" would take
    p1 = plan_for(m, fc1_n, facts.hidden_size, facts.top_k, facts.num_experts, profile, tall, wide or mixed,
                  facts.weights.layout, promote, producer, tall_wide)
    p2 = plan_for(m, facts.hidden_size, facts.intermediate_size, facts.top_k, facts.num_experts, profile, tall, wide,
                  facts.weights.layout, promote, producer, tall_wide)
    if not p1.mainloop == p2.mainloop == Mainloop.WGMMA.value:
        return None
    packing_block = None
    if p1.moe_block_size != p2.moe_block_size:
        if not (mixed and (p1.moe_block_size, p2.moe_block_size) == (2 * WGMMA_TALL_BLOCK, WGMMA_TALL_BLOCK)):
            return None
        packing_block = p1.moe_block_size  # FC2 reads FC1's packing
    on_input = facts.router_weight_on_input
    if not facts.gated:
        fc1_epilogue, activation = "relu2", {}
    elif GATED_FC1_EPILOGUE and whole_gate_up_slabs(facts):
        fc1_epilogue = facts.activation.value  # FC1 writes the activation (gate and up in one tile)
        activation = dict(fast_math=facts.fast_math, swiglu_alpha=facts.swiglu_alpha, swiglu_beta=facts.swiglu_beta,
                          swiglu_limit=facts.swiglu_limit)
    else:
        fc1_epilogue, activation = "none", {}  # the activation kernel runs between the GEMMs
    layout = dict(layout=facts.weights.layout, scale_format=facts.weights.scale_format,
                  scale_exponent=_scale_exponent(facts))
    s1 = gemm_spec_for(p1, facts.dtype, fc1_n, facts.hidden_size, facts.top_k, a_per_route=False,
                       mul_topk_weights=on_input, epilogue=fc1_epilogue, bias=facts.bias, **layout,
                       **stored_w13_facts(facts.weights, facts.intermediate_size, facts.gated), **activation)
    # the measured "splitsum" choice: FC2 adds its rows into the (M, H) output (zeroed by the runtime first)
    summed = bool(layer_choice("splitsum", m, facts, profile)) and not facts.deterministic
    s2 = gemm_spec_for(p2, facts.dtype, facts.hidden_size, facts.intermediate_size, facts.top_k, a_per_route=True,
                       mul_topk_weights=not on_input, epilogue="none", bias=facts.bias,
                       sum_topk=facts.top_k if summed else 0, packing_block=packing_block, **layout)
    return GemmPhase(p1, s1), GemmPhase(p2, s2)
