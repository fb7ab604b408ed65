"""W4A16 grouped-GEMM planning: hand-worked plans, partition properties, bounds.

Expected plans are written as literals with the seed's arithmetic beside them, so
a change in the planner shows up as a disagreement with a worked example, not as
a silently updated number.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict

import pytest
from cuteaot.runtime import PROFILES, BadInputError
from cuteaot.codegen.kernels.w4a16.planning import (
    LARGE_BATCH_TILE_CONFIGS,
    REGISTER_ESTIMATES_SM121,
    SMALL_BATCH_TILE_CONFIGS,
    WGMMA_WIDE_MIN_K,
    estimated_registers,
    plan_gemm,
    select_route_block_size,
)
from cuteaot.runtime.kernels.w4a16.geometry import (
    ScaleFormat,
    TileConfig,
    aligned_split_iters,
    lock_slots,
    max_packed_route_slots,
    max_route_blocks,
    shared_memory_footprint,
    simulate_partition,
    split_range_forms,
    split_span_cost,
    splitk_scratch_floats,
)

H200, GB10 = PROFILES["h200"], PROFILES["gb10"]
K16, K32 = ScaleFormat.E4M3_K16, ScaleFormat.E8M0_K32


# --------------------------------------------------------------------------- tiles


def test_tile_candidates_are_the_seeds():
    # seed: small (128,128,256) (64,128,128) (128,64,128); large (64,256,256) (64,128,128) (128,64,128)
    assert [(t.tile_k, t.tile_n, t.threads) for t in SMALL_BATCH_TILE_CONFIGS] == [
        (128, 128, 256), (64, 128, 128), (128, 64, 128)]
    assert [(t.tile_k, t.tile_n, t.threads) for t in LARGE_BATCH_TILE_CONFIGS] == [
        (64, 256, 256), (64, 128, 128), (128, 64, 128)]
    # every candidate at every block size has a register estimate (no guessing needed)
    for block in (8, 16, 32, 48, 64):
        for tile in SMALL_BATCH_TILE_CONFIGS if block <= 16 else LARGE_BATCH_TILE_CONFIGS:
            estimated_registers(tile, block)


def test_tile_config_validation():
    with pytest.raises(BadInputError, match="multiple of 16"):
        TileConfig(100, 128)
    with pytest.raises(BadInputError, match="512 threads"):
        TileConfig(128, 256)  # 256 * 128 / 64 = 512 threads


@pytest.mark.parametrize(
    "block, tile, fmt, expected",
    [
        # cta_m = 16: meta 16*16=256; A 4*16*128*2=16384; B 4*(128*128/8)*4=32768;
        # red 16*136*2=4352 (+bias 256 < B) -> 32768; S ceil(128/16)*128*2*4=8192
        (8, TileConfig(128, 128), K16, 32768 + 16384 + 8192 + 256),  # 57600
        (16, TileConfig(64, 128), K16, 16384 + 8192 + 4096 + 256),  # 28928
        (16, TileConfig(64, 128), K32, 16384 + 8192 + 2048 + 256),  # 26880: half the scale rows
        (16, TileConfig(128, 64), K16, 16384 + 16384 + 4096 + 256),  # 37120
        # cta_m = 64: red 64*264*2=33792 > B 32768 -> 33792; A 4*64*64*2=32768; S 4*256*2*4=8192
        (64, TileConfig(64, 256), K16, 33792 + 32768 + 8192 + 1024),  # 75776
        # cta_m = 48: B 16384 > red 48*136*2=13056; A 4*48*64*2=24576; S 2*128*2*4=2048
        (48, TileConfig(64, 128), K32, 16384 + 24576 + 2048 + 768),  # 43776
        (64, TileConfig(64, 128), K32, 17408 + 32768 + 2048 + 1024),  # 53248: red 64*136*2=17408
    ],
)
def test_shared_memory_footprint_hand_worked(block, tile, fmt, expected):
    assert shared_memory_footprint(block, tile, fmt) == expected


# --------------------------------------------------------------- route blocks and slots


@pytest.mark.parametrize(
    "top_k, boundaries",
    [
        # E=128, top 8: m*8/128/b < 0.9  <=>  m < 14.4 b  ->  last m for b = 8,16,32,48: 115,230,460,691
        (8, [(115, 8), (116, 16), (230, 16), (231, 32), (460, 32), (461, 48), (691, 48), (692, 64)]),
        # E=128, top 4: m < 28.8 b  ->  230, 460, 921, 1382
        (4, [(230, 8), (231, 16), (460, 16), (461, 32), (921, 32), (922, 48), (1382, 48), (1383, 64)]),
    ],
)
def test_route_block_size_boundaries(top_k, boundaries):
    for m, block in boundaries:
        assert select_route_block_size(m, top_k, 128) == block, m


def test_route_block_size_matches_the_float_rule():
    for m, top_k, experts in itertools.product((1, 3, 7, 50, 333, 1000, 9000), (1, 2, 4, 8), (8, 64, 128, 256)):
        expected = next((b for b in (8, 16, 32, 48, 64) if m * top_k / experts / b < 0.9), 64)
        assert select_route_block_size(m, top_k, experts) == expected
    with pytest.raises(BadInputError, match="num_experts must be a positive int"):
        select_route_block_size(4, 8, 0)


def test_slot_bounds_hand_worked():
    # m=1 top 8: 8 + min(128, 8)*7 = 64 -> 8 blocks of 8
    assert (max_packed_route_slots(8, 8, 128), max_route_blocks(8, 8, 128)) == (64, 8)
    # m=4096 top 8, block 64: 32768 + 128*63 = 40832 = 638 * 64
    assert (max_packed_route_slots(32768, 64, 128), max_route_blocks(32768, 64, 128)) == (40832, 638)
    # 10 + 3*15 = 55 -> rounded up to 64 (the true worst case is 48: three partial groups)
    assert max_packed_route_slots(10, 16, 3) == 64
    assert max_packed_route_slots(0, 16, 3) == 0


def _worst_padded_slots(routes: int, block: int, experts: int) -> int:
    """Brute force: the most slots any split of `routes` over `experts` pads to."""
    best = 0
    for split in itertools.product(range(routes + 1), repeat=experts):
        if sum(split) == routes:
            best = max(best, sum(-(-c // block) * block for c in split))
    return best


def test_slot_bound_covers_every_routing():
    for routes, block, experts in itertools.product(range(11), (8, 16), (1, 2, 3, 4)):
        worst = _worst_padded_slots(routes, block, experts)
        bound = max_packed_route_slots(routes, block, experts)
        assert worst <= bound < worst + 2 * block, (routes, block, experts)
        assert bound % block == 0


# ------------------------------------------------------------------ partition


def _check_partition(route_blocks, n_tiles, k_tiles, grid_x, m8, span_cost=None):
    """Assert the split-K contract of one simulated launch; return max(lock_slot) + 1."""
    items = simulate_partition(route_blocks, n_tiles, k_tiles, grid_x, m8, span_cost)
    coverage = defaultdict(int)
    by_tile = defaultdict(list)
    for it in items:
        assert 0 <= it.cta < grid_x and it.k_count > 0
        for kt in range(it.k_start, it.k_start + it.k_count):
            coverage[(it.route_block, it.n_tile, kt)] += 1
        by_tile[(it.route_block, it.n_tile)].append(it)
    case = (route_blocks, n_tiles, k_tiles, grid_x, m8, span_cost)
    # every (route block, n tile, k tile) exactly once
    assert len(coverage) == route_blocks * n_tiles * k_tiles, case
    assert set(coverage.values()) <= {1}, case
    assert all(0 <= rb < route_blocks and 0 <= nt < n_tiles for rb, nt in by_tile), case
    used_slots = {}
    for key, slices in by_tile.items():
        slices.sort(key=lambda it: it.k_start)
        count = slices[0].slice_count
        assert len(slices) == count and all(it.slice_count == count for it in slices), case
        # slices are numbered from the highest K range down, and the CTA index falls
        # as the index rises: a CTA only ever waits for a higher-numbered CTA (no cycle)
        assert [it.slice_idx for it in slices] == list(range(count - 1, -1, -1)), case
        ctas = [it.cta for it in slices]
        assert ctas == sorted(set(ctas)), case
        slots = {it.lock_slot for it in slices}
        if count == 1:
            assert slots == {None}, case
            continue
        assert len(slots) == 1, case
        (slot,) = slots
        assert 0 <= slot < lock_slots(grid_x), case
        assert slot not in used_slots, (case, key, used_slots.get(slot))
        used_slots[slot] = key
    return max(used_slots, default=-1) + 1


def test_partition_exhaustive_small():
    # route_blocks * n_tiles is all that shapes the schedule; cover it densely
    for grid_x, mn, k_tiles, m8 in itertools.product(range(1, 14), range(31), range(1, 10), (False, True)):
        _check_partition(mn, 1, k_tiles, grid_x, m8)
        _check_partition(mn, 1, k_tiles, grid_x, m8, span_cost=3)
    for route_blocks, n_tiles, grid_x in itertools.product(range(7), range(1, 5), (1, 3, 5, 8, 13)):
        _check_partition(route_blocks, n_tiles, 7, grid_x, False)


def test_partition_random():
    rng = random.Random(20261129)
    for _ in range(250):
        case = (rng.randint(0, 48), rng.randint(1, 20), rng.randint(1, 48), rng.randint(1, 400), rng.random() < 0.3)
        _check_partition(*case)
        _check_partition(*case, span_cost=rng.choice((1, 3, 6)))


def test_aligned_split_iters_hand_worked():
    assert (split_span_cost(64), split_span_cost(128)) == (6, 3)
    # Qwen3-30B FC1 at M = 8: 600 tiles x 32 k-tiles over 528 CTAs, 37 each: 12.5 % of the ranges meet three
    # tiles (cost 37 + 6 * 3 = 55); 40 = 32 + 8 meets two (52)
    assert aligned_split_iters(37, 32, 6) == 40
    assert aligned_split_iters(30, 32, 6) == 32  # whole tiles: 32 + 6 against 30 + 12
    assert aligned_split_iters(26, 45, 6) == 26  # the next form, 45, costs more than it saves
    assert aligned_split_iters(59, 45, 6) == 60  # 45 + 15
    assert aligned_split_iters(8, 16, 3) == 8 and aligned_split_iters(16, 16, 3) == 16  # already aligned
    assert split_range_forms(32) == (1, 2, 4, 8, 16, 32) and split_range_forms(45) == (1, 3, 5, 9, 15, 45)
    for k_tiles, span in itertools.product(range(1, 40), (1, 3, 6)):
        for iters in range(1, 3 * k_tiles + 2):
            chosen = aligned_split_iters(iters, k_tiles, span)
            d = chosen % k_tiles
            assert chosen == iters or d == 0 or k_tiles % d == 0, (iters, k_tiles, span)
            assert iters <= chosen < iters + k_tiles + span, (iters, k_tiles, span)


def test_aligned_partition_meets_fewer_tiles():
    # realistic tails (Qwen3-30B FC1 at M = 8 and 64, gpt-oss-120b FC2 at M = 8, a 128-deep decode GEMM):
    # with the span cost the partition keeps its contract and no CTA's range meets more tiles than before
    def tiles_met(items):
        per_cta = defaultdict(int)
        for it in items:
            per_cta[it.cta] += 1
        return max(per_cta.values())

    for mn, k_tiles, grid_x, tile_k in ((600, 32, 528, 64), (690, 45, 528, 64), (480, 32, 528, 64),
                                        (96, 16, 264, 128)):
        span = split_span_cost(tile_k)
        _check_partition(mn, 1, k_tiles, grid_x, True, span)
        before = simulate_partition(mn, 1, k_tiles, grid_x, True)
        after = simulate_partition(mn, 1, k_tiles, grid_x, True, span)
        assert tiles_met(after) <= tiles_met(before), (mn, k_tiles, grid_x)
    # the M = 8 case: 40 k-tiles a CTA, none meets three tiles (37 each met up to three)
    assert tiles_met(simulate_partition(600, 1, 32, 528, True)) == 3
    assert tiles_met(simulate_partition(600, 1, 32, 528, True, 6)) == 2


def test_partition_realistic_launches():
    # Qwen3-30B FC1 on H200 at m=200: 220 route blocks x 12 n tiles x 32 k tiles over 396 CTAs
    _check_partition(220, 12, 32, 396, False)
    # decode: 8 direct route blocks x 12 n tiles, 132 CTAs, block size 8 -> one whole tile per CTA
    items = simulate_partition(8, 12, 16, 132, True)
    assert len(items) == 96 and all(it.slice_count == 1 and it.k_count == 16 for it in items)
    # without the block-8 rule the same launch is split along K
    assert _check_partition(8, 12, 16, 132, False) > 0


def test_lock_slots_bound_is_grid_x_and_tight():
    # max(lock_slot) + 1 over all inputs: 0 for grid 1, 1 for grid 2, grid_x from 3 on.
    for grid_x in range(1, 40):
        worst = max(_check_partition(mn, 1, k, grid_x, False) for mn in range(2 * grid_x + 2) for k in (1, 2, 3, 5))
        assert worst <= lock_slots(grid_x) == grid_x
        if grid_x >= 3:
            # grid_x + 1 tiles of grid_x k tiles: the tail is merged with one whole round and
            # the tile split between the last two CTAs takes slot grid_x - 1
            assert _check_partition(grid_x + 1, 1, grid_x, grid_x, False) == grid_x


def test_splitk_scratch_floats_covers_simulated_slots():
    # 132 slots x (16*1 rows) x 128 columns; 264 slots x (16*4 rows) x 128 columns
    assert splitk_scratch_floats(132, 8, 128) == 132 * 16 * 128 == 270336
    assert splitk_scratch_floats(264, 64, 128) == 264 * 64 * 128 == 2162688
    assert splitk_scratch_floats(264, 48, 128) == 264 * 48 * 128
    rng = random.Random(7)
    for _ in range(60):
        grid_x, block, tile_n = rng.randint(1, 300), rng.choice((8, 16, 32, 48, 64)), rng.choice((64, 128, 256))
        slots_used = _check_partition(rng.randint(0, 40), rng.randint(1, 12), rng.randint(1, 40), grid_x, block == 8)
        rows = 16 * -(-block // 16)
        assert slots_used * rows * tile_n <= splitk_scratch_floats(grid_x, block, tile_n)


# ------------------------------------------------------------------- model plans

QWEN30_FC1, QWEN30_FC2 = (1536, 2048), (2048, 768)  # (N, K): N = 2 * 768, K = hidden 2048
QWEN235_FC1, QWEN235_FC2 = (3072, 4096), (4096, 1536)
GPTOSS_FC1, GPTOSS_FC2 = (5760, 2880), (2880, 2880)

# Per (profile, m) for both Qwen3 models (top 8 of 128, NVFP4 e4m3_k16): every candidate
# fits all four Qwen (N, K) and the work rule never binds, so the plan is shape-independent.
# blocks_per_sm = min(regs, smem) then capped; regs = 65536 // (ceil8(r) * threads),
# smem = optin // (footprint + 1536); H200 optin 232448, GB10 101376.
QWEN_EXPECTED = {
    # m=1: direct (m <= 6), block 8: min(M8_BLOCKS_PER_SM=2, smem, threads), registers ignored.
    # H200: (128,128) min(2, 232448//59136=3, 2048//256=8) = 2, ties -> first, (128, 128).
    # GB10: (128,128) min(2, 101376//59136=1) = 1; (64,128) min(2, 101376//30464=3) = 2 -> (64, 128)
    ("h200", 1): (8, True, (128, 128), 2, 264),
    ("gb10", 1): (8, True, (64, 128), 2, 96),
    # m=64: 64*8/128/8 = 0.5 < 0.9 -> block 8, packed; same counts
    ("h200", 64): (8, False, (128, 128), 2, 264),
    ("gb10", 64): (8, False, (64, 128), 2, 96),
    # m=200: block 16 (one MMA row).  H200: (128,128) regs 65536//(160*256)=1;
    # (64,128) min(65536//(144*128)=3, 232448//30464=7)=3; (128,64) min(3, 6)=3 -> tie, first: (64,128)
    ("h200", 200): (16, False, (64, 128), 3, 396),
    # GB10: (128,128) min(1, 101376//59136=1)=1; (64,128) min(3, 101376//30464=3)=3; (128,64) min(3, 2)=2
    ("gb10", 200): (16, False, (64, 128), 3, 144),
    # m=512: 512/16/32 = 1.0, 512/16/48 = 0.67 -> block 48 (3 MMA rows), cap 2.
    # H200: (64,256) regs 65536//(256*256)=1; (64,128) 65536//(256*128)=2 -> 2
    ("h200", 512): (48, False, (64, 128), 2, 264),
    # GB10: (64,128) min(2, 101376//47360=2)=2; (128,64) min(2, 101376//71936=1)=1
    ("gb10", 512): (48, False, (64, 128), 2, 96),
    # m=4096: block 64 by the Marlin rule; H200 (sm_90a) runs the wgmma loop, and 32768 routes
    # >= 160 * 128 experts (WGMMA_WIDE_MIN_ROUTES) take 256-row blocks: 128x64 tile, two warpgroups (256 threads),
    # min(65536//(232*256)=1, 233472//(154640+1536)=1, 2048//256=8) = 1
    ("h200", 4096): (256, False, (64, 128), 1, 132),
    # m=2048: 16384 routes >= 128 * 128 fill 128-row blocks: one warpgroup,
    # min(65536//(232*128)=2, 233472//(87056+1536)=2, 2048//128=16) = 2
    ("h200", 2048): (128, False, (64, 128), 2, 264),
    # GB10: (64,256) 1, (64,128) min(2, 101376//56832=1)=1, (128,64) 1 -> first, (64,256)
    ("gb10", 4096): (64, False, (64, 256), 1, 48),
}


@pytest.mark.parametrize("shape", [QWEN30_FC1, QWEN30_FC2, QWEN235_FC1, QWEN235_FC2])
@pytest.mark.parametrize("profile_name, m", sorted(QWEN_EXPECTED))
def test_qwen3_plans(shape, profile_name, m):
    n, k = shape
    # (short=False: the mma.sync loop's tiles for 16- to 48-row blocks, which H200 runs on the wgmma loop)
    plan = plan_gemm(m, n, k, 8, 128, PROFILES[profile_name], scale_format=K16, short=False)
    block, direct, (tile_k, tile_n), per_sm, grid_x = QWEN_EXPECTED[(profile_name, m)]
    if direct and 8 * (n // tile_n) <= PROFILES[profile_name].sm_count:
        # direct routes whose 8 * N/tile_n whole tiles fit one per SM: 1 CTA/SM, no split-K
        # (H200: Qwen3-30B FC1 8 * 12 = 96 and FC2 8 * 16 = 128 <= 132; 235B 192 / 256 do not)
        per_sm, grid_x = 1, grid_x // 2
    if profile_name == "h200" and block == 8 and not direct and k <= 3072:
        # packed 8-row blocks on sm_90a with K <= PACKED_M8_MAX_K: 128x64 tiles at 4/SM
        (tile_k, tile_n), per_sm, grid_x = (64, 128), 4, 528
    if block == 256 and k < WGMMA_WIDE_MIN_K:
        # Qwen3-30B FC2 (K = 768): the standalone GEMM keeps the 128-row plan of M = 2048
        block, (tile_k, tile_n), per_sm, grid_x = 128, (64, 128), 2, 264
    assert plan.whole_tiles_m8 == (block == 8 and per_sm == 1)
    assert (plan.moe_block_size, plan.direct_topk_routes) == (block, direct)
    assert (plan.tile.tile_k, plan.tile.tile_n, plan.blocks_per_sm, plan.grid_x) == (tile_k, tile_n, per_sm, grid_x)
    assert plan.lock_slots == grid_x
    assert plan.splitk_scratch_floats == grid_x * 16 * -(-block // 16) * tile_n
    assert (plan.n_tiles, plan.k_tiles) == (n // tile_n, k // tile_k)
    wgmma = profile_name == "h200" and block in (64, 128, 256)
    assert plan.mainloop == ("wgmma" if wgmma else "mma_sync")


def test_every_planned_block_size_is_one_route_packing_packs():
    from cuteaot.runtime.kernels.route_pack import ALLOWED_BLOCK_SIZES
    from cuteaot.runtime.kernels.w4a16.geometry import (
        ALLOWED_MOE_BLOCK_SIZES, WGMMA_TALL_BLOCK, WGMMA_WIDE_BLOCK, check_moe_block_size,
    )

    assert ALLOWED_BLOCK_SIZES == ALLOWED_MOE_BLOCK_SIZES + (WGMMA_TALL_BLOCK, WGMMA_WIDE_BLOCK)
    for block in ALLOWED_BLOCK_SIZES:
        check_moe_block_size(block)
    with pytest.raises(BadInputError, match="moe_block_size must be one of"):
        check_moe_block_size(24)


def test_wgmma_is_planned_only_where_it_runs():
    from cuteaot.codegen.kernels.w4a16.planning import wgmma_tile
    from cuteaot.runtime.kernels.w4a16.geometry import WGMMA_TILES, wgmma_shared_memory_footprint

    wide, narrow = WGMMA_TILES
    assert wgmma_tile(1536, 2048, 64, K16, H200) == (wide, None)
    assert wgmma_tile(1536, 2048, 128, K16, H200) == (narrow, None)  # 128-row blocks: 128-wide only
    assert wgmma_tile(5760, 2944, 64, K16, H200) == (narrow, None)  # gpt-oss FC1: 5760 % 256 = 128
    assert "warpgroup" in wgmma_tile(1536, 2048, 64, K16, PROFILES["b200"])[1]  # sm_100a: no wgmma
    assert "row route blocks" in wgmma_tile(1536, 2048, 8, K16, H200)[1]
    for short in (16, 32, 48):  # the short blocks: the 128-wide tile; read as stored, 32 and 48 rows (measured)
        assert wgmma_tile(1536, 2048, short, K16, H200) == (narrow, None)
        stored = wgmma_tile(1536, 2048, short, K16, H200, "modelopt")
        assert stored == (narrow, None) if short > 16 else "MODELOPT_WGMMA_SHORT_BLOCKS" in stored[1]
    # 16 routes an expert: 32-row blocks, on the wgmma loop unless asked not to
    short = plan_gemm(256, 1536, 2048, 8, 128, H200, scale_format=K16)
    assert (short.mainloop, short.moe_block_size, short.tile) == ("wgmma", 32, narrow)
    assert plan_gemm(256, 1536, 2048, 8, 128, H200, scale_format=K16, short=False).mainloop == "mma_sync"
    assert plan_gemm(256, 1536, 2048, 8, 128, PROFILES["b200"], scale_format=K16).mainloop == "mma_sync"
    assert "multiples" in wgmma_tile(1536 + 32, 2048, 64, K16, H200)[1]
    # N = 64 (mod 128): the 128-wide tile with its last tile half past N (256 wide: a quarter, refused)
    assert wgmma_tile(1536 + 64, 2048, 64, K16, H200) == (narrow, None)
    assert wgmma_tile(1536 + 64 + 128, 2048, 64, K16, H200) == (wide, None)  # 1728 = 6.75 256-wide tiles
    assert "e4m3_k16" in wgmma_tile(1536, 2048, 64, ScaleFormat.E8M0_K32, H200)[1]
    # a pinned tile keeps the mma.sync loop and its 64-row blocks
    pinned = plan_gemm(4096, 1536, 2048, 8, 128, H200, scale_format=K16, pinned_tile=TileConfig(64, 128))
    assert pinned.mainloop == "mma_sync" and pinned.moe_block_size == 64
    # 128-row blocks once the average expert fills them (routes >= 128 * experts), else 64
    assert plan_gemm(2047, 1536, 2048, 8, 128, H200, scale_format=K16).moe_block_size == 64
    assert plan_gemm(2048, 1536, 2048, 8, 128, H200, scale_format=K16).moe_block_size == 128
    # 256-row blocks (two warpgroups) once the average expert has 160 routes (WGMMA_WIDE_MIN_ROUTES,
    # measured): an expert's 129-256 routes then share one decode of its weights
    assert wgmma_tile(1536, 2048, 256, K16, H200) == (narrow, None)
    assert plan_gemm(2559, 1536, 2048, 8, 128, H200, scale_format=K16).moe_block_size == 128
    wide_plan = plan_gemm(2560, 1536, 2048, 8, 128, H200, scale_format=K16)
    assert (wide_plan.moe_block_size, wide_plan.mainloop, wide_plan.blocks_per_sm) == (256, "wgmma", 1)
    # ... in the standalone GEMM only: the fused kernel keeps one warpgroup and 128-row blocks
    from cuteaot.codegen.kernels.w4a16.fused_planning import plan_fused
    assert plan_fused(16384, 2048, 768, 128, 8, True, H200).moe_block_size == 128
    assert plan_gemm(4096, 1536, 2048, 8, 128, PROFILES["b200"], scale_format=K16).moe_block_size == 64
    gpt_oss = plan_gemm(2048, 5760, 2944, 4, 128, H200, scale_format=K16)
    assert (gpt_oss.mainloop, gpt_oss.moe_block_size, gpt_oss.tile) == ("wgmma", 64, narrow)
    # route metadata + 1024 alignment slack + 4 stages of (activations + weights + scales)
    assert wgmma_shared_memory_footprint(64, wide) == 1040 + 1024 + 4 * (8192 + 8192 + 1024)
    assert wgmma_shared_memory_footprint(64, narrow) == 1040 + 1024 + 4 * (8192 + 4096 + 512)
    assert wgmma_shared_memory_footprint(128, narrow) == 2064 + 1024 + 4 * (16384 + 4096 + 512)
    plan = plan_gemm(1024, 1536, 2048, 8, 128, H200, scale_format=K16)
    assert plan.tile == wide and plan.shared_memory_bytes == wgmma_shared_memory_footprint(64, wide)


@pytest.mark.parametrize(
    "m, slots, blocks",
    [
        (1, 64, 8),  # direct: 1*8 routes, each its own block of 8 slots
        (64, 1408, 176),  # 512 + 128*7 = 1408 = 176 * 8
        (200, 3520, 220),  # 1600 + 128*15 = 3520 = 220 * 16
        (512, 10128, 211),  # 4096 + 128*47 = 10112 -> 211 * 48 = 10128
        (2048, 32640, 255),  # H200 wgmma, block 128: 16384 + 128*127 = 32640 = 255 * 128
        (4096, 65536, 256),  # H200 wgmma, block 256: 32768 + 128*255 = 65408 -> 256 * 256 = 65536
    ],
)
def test_qwen3_route_capacities(m, slots, blocks):
    plan = plan_gemm(m, *QWEN30_FC1, 8, 128, H200, scale_format=K16)
    assert (plan.max_route_slots, plan.max_route_blocks) == (slots, blocks)


def test_qwen3_decode_plan_details():
    plan = plan_gemm(1, *QWEN30_FC1, 8, 128, H200, scale_format=K16)
    # (256 threads, 1 m block, 8 n blocks, 8 k blocks, block 8) -> 118 in the SM121 table
    assert plan.registers == 118 and plan.shared_memory_bytes == 57600
    assert plan.splitk_scratch_floats == 270336  # 96 whole tiles fit: 1/SM, 132 lock slots * 16 * 128
    assert plan.whole_tiles_m8 and plan.blocks_per_sm == 1


# gpt-oss-120b: MXFP4 (e8m0_k32), top 4 of 128.  FC1 N=5760 K=2880: 2880 % 128 = 64 and
# 5760 % 256 = 128, so only (tile_k 64, tile_n 128) fits (footprints: g32 column above).
GPTOSS_FC1_EXPECTED = {
    # (profile, m): (block, direct, blocks_per_sm, grid_x, slots, route_blocks)
    ("h200", 1): (8, True, 2, 264, 32, 4),  # 4 routes, each a block of 8; block 8 -> 2 CTAs/SM
    ("gb10", 1): (8, True, 2, 96, 32, 4),
    # 200*4/128/8 = 0.78; 800 + 128*7 = 1696; packed 8-row blocks, K = 2880 <= PACKED_M8_MAX_K: 4/SM
    ("h200", 200): (8, False, 4, 528, 1696, 212),
    ("h200", 400): (16, False, 3, 396, 3520, 220),  # min(3, 232448//28416=8) = 3; 1600 + 128*15
    ("gb10", 400): (16, False, 3, 144, 3520, 220),  # min(3, 101376//28416=3) = 3
    ("h200", 1000): (48, False, 2, 264, 10032, 209),  # 4000 + 128*47 = 10016 -> 209 * 48
    ("gb10", 1000): (48, False, 2, 96, 10032, 209),  # min(2, 101376//45312=2)
    ("h200", 4096): (64, False, 2, 264, 24448, 382),  # 16384 + 128*63 = 24448 = 382 * 64
    ("gb10", 4096): (64, False, 1, 48, 24448, 382),  # min(2, 101376//54784=1)
}


@pytest.mark.parametrize("profile_name, m", sorted(GPTOSS_FC1_EXPECTED))
def test_gpt_oss_fc1_plans(profile_name, m):
    plan = plan_gemm(m, *GPTOSS_FC1, 4, 128, PROFILES[profile_name], scale_format=K32)
    block, direct, per_sm, grid_x, slots, route_blocks = GPTOSS_FC1_EXPECTED[(profile_name, m)]
    assert (plan.tile.tile_k, plan.tile.tile_n) == (64, 128)
    assert (plan.moe_block_size, plan.direct_topk_routes, plan.blocks_per_sm, plan.grid_x) == (
        block, direct, per_sm, grid_x)
    assert (plan.max_route_slots, plan.max_route_blocks) == (slots, route_blocks)
    assert (plan.n_tiles, plan.k_tiles) == (45, 45)


@pytest.mark.parametrize("m", [1, 400, 4096])
def test_gpt_oss_fc2_has_no_exact_tile(m):
    # N = 2880 = 64 * 45 is not a multiple of 128 or 256, and K = 2880 is not a multiple
    # of 128: no candidate fits (a 64x64 tile would need 64 threads).  The seed fails the
    # same way: its logical-tail escape is only for modelopt E8M0 with I % 32 != 0.
    with pytest.raises(BadInputError, match="no W4A16 tile config fits N=2880, K=2880") as info:
        plan_gemm(m, *GPTOSS_FC2, 4, 128, H200, scale_format=K32)
    assert "N=2880 is not a multiple of tile_n=128" in str(info.value)
    assert "K=2880 is not a multiple of tile_k=128" in str(info.value)


def test_work_rule_lowers_blocks_per_sm():
    # dense-like: m=9, top 1 of 1 expert -> 90 < 9*16*10 -> block 16.  N = K = 1024 on H200:
    # (128,128): 1.  (64,128): 3, but 8 n tiles * 9 * 4 = 288 CTAs of work < 132*3 -> 288//132 = 2.
    # (128,64): 3 and 16 * 9 * 4 = 576 >= 396 -> stays 3 and wins.
    plan = plan_gemm(9, 1024, 1024, 1, 1, H200, scale_format=K16, short=False)  # (the mma.sync loop)
    assert (plan.tile.tile_k, plan.tile.tile_n, plan.blocks_per_sm, plan.grid_x) == (128, 64, 3, 396)


# ------------------------------------------------------------- pinned tiles, registers


def test_pinned_tile_is_used_and_validated():
    # m=200 would choose (64,128) with 3/SM; pinning (128,128) gives 65536//(160*256) = 1
    plan = plan_gemm(200, *QWEN30_FC1, 8, 128, H200, scale_format=K16, pinned_tile=TileConfig(128, 128))
    assert (plan.tile, plan.blocks_per_sm, plan.grid_x, plan.registers) == (TileConfig(128, 128), 1, 132, 158)
    with pytest.raises(BadInputError, match="pinned tile .* K=2880 is not a multiple of tile_k=128"):
        plan_gemm(400, *GPTOSS_FC1, 4, 128, H200, scale_format=K32, pinned_tile=TileConfig(128, 128))
    # block 64 with (256, 64): A alone is 4*64*256*2 = 131072 bytes -> 173056 > 101376 - 512 on GB10
    with pytest.raises(BadInputError, match="needs 173056 bytes of shared memory, gb10 allows 100864"):
        plan_gemm(4096, *QWEN30_FC1, 8, 128, GB10, scale_format=K16, pinned_tile=TileConfig(256, 64))
    with pytest.raises(BadInputError, match="pinned_tile must be a TileConfig"):
        plan_gemm(4096, *QWEN30_FC1, 8, 128, H200, scale_format=K16, pinned_tile=(64, 128))


def test_registers_override_rechecks_blocks_per_sm():
    pinned = TileConfig(64, 128)
    # the SM121 estimate 143 -> 65536 // (144*128) = 3; a real count of 170 -> 65536 // (176*128) = 2
    assert plan_gemm(200, *QWEN30_FC1, 8, 128, H200, scale_format=K16, pinned_tile=pinned).grid_x == 396
    plan = plan_gemm(200, *QWEN30_FC1, 8, 128, H200, scale_format=K16, pinned_tile=pinned, registers=170)
    assert (plan.registers, plan.blocks_per_sm, plan.grid_x, plan.lock_slots) == (170, 2, 264, 264)
    # a lower real count can raise it: (64,256) at block 64, 128 regs -> 65536 // 32768 = 2 (estimate 255 -> 1)
    wide = plan_gemm(4096, *QWEN30_FC1, 8, 128, H200, scale_format=K16, pinned_tile=TileConfig(64, 256),
                     registers=128)
    assert (wide.blocks_per_sm, wide.grid_x) == (2, 264)
    with pytest.raises(BadInputError, match="together with pinned_tile"):
        plan_gemm(200, *QWEN30_FC1, 8, 128, H200, scale_format=K16, registers=128)
    with pytest.raises(BadInputError, match=r"registers must be in \[1, 255\]"):
        plan_gemm(200, *QWEN30_FC1, 8, 128, H200, scale_format=K16, pinned_tile=pinned, registers=300)


def test_missing_register_estimate_is_an_error():
    tile = TileConfig(256, 64)  # fits H200 at block 64 but was never measured
    key = (256, 4, 4, 16, False)
    assert key not in REGISTER_ESTIMATES_SM121
    with pytest.raises(BadInputError, match=r"no register estimate .* \(256, 4, 4, 16, False\).*registers="):
        plan_gemm(4096, *QWEN30_FC1, 8, 128, H200, scale_format=K16, pinned_tile=tile)
    plan = plan_gemm(4096, *QWEN30_FC1, 8, 128, H200, scale_format=K16, pinned_tile=tile, registers=200)
    assert plan.blocks_per_sm == 1  # 65536 // (200*256) = 1


def test_plan_input_errors():
    with pytest.raises(BadInputError, match="top_k=8 exceeds num_experts=4"):
        plan_gemm(4, 1536, 2048, 8, 4, H200, scale_format=K16)
    with pytest.raises(BadInputError, match="m must be a positive int"):
        plan_gemm(0, 1536, 2048, 8, 128, H200, scale_format=K16)
    with pytest.raises(BadInputError, match="scale_format must be one of"):
        plan_gemm(4, 1536, 2048, 8, 128, H200, scale_format="e2m1")
    assert plan_gemm(4, 1536, 2048, 8, 128, H200, scale_format="e4m3_k16").tile == TileConfig(128, 128)


def test_fit_check_footprint_covers_the_kernels_shared_memory():
    """The planner's (seed) footprint must not under-estimate what the kernel really allocates."""
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

    for block in (8, 16, 32, 48, 64):
        for tile in SMALL_BATCH_TILE_CONFIGS + LARGE_BATCH_TILE_CONFIGS:
            spec = GemmSpec(dtype="bf16", n=4096, k=4096, top_k=8, tile_n=tile.tile_n, tile_k=tile.tile_k,
                            moe_block_size=block, blocks_per_sm=1)
            assert shared_memory_footprint(block, tile, ScaleFormat.E4M3_K16) >= spec.shared_bytes, (block, tile)


def test_producer_warp_is_planned_for_the_tall_blocks_on_full_grids(monkeypatch):
    """producer=True: 128- and 256-row packed blocks take the producer-warpgroup kernel where the grid keeps
    its full CTA count (its register split assumes it); its spec carries the ring depth.  A layer asks
    the "producer" knob, for both GEMMs."""
    from cuteaot.codegen.kernels.w4a16 import planning
    from cuteaot.codegen.kernels.w4a16.fused_planning import split_layer
    from cuteaot.runtime.kernels.w4a16.geometry import WGMMA_WS_STAGES
    from cuteaot.runtime.resolution import MoeLayerFacts

    ws = dict(scale_format=K16, producer=True)
    tall = plan_gemm(2048, 1536, 2048, 8, 128, H200, **ws)
    wide = plan_gemm(4096, 1536, 2048, 8, 128, H200, **ws)
    mid = plan_gemm(1024, 1536, 2048, 8, 128, H200, **ws)
    assert (tall.moe_block_size, tall.producer_warp, tall.blocks_per_sm, tall.registers) == (128, True, 2, 128)
    assert (wide.moe_block_size, wide.producer_warp, wide.blocks_per_sm, wide.registers) == (256, True, 1, 168)
    assert mid.moe_block_size == 64 and not mid.producer_warp
    spec = planning.gemm_spec_for(wide, "bf16", 1536, 2048, 8, a_per_route=False, mul_topk_weights=False,
                                  epilogue="none")
    assert spec.producer_warp and spec.stages == WGMMA_WS_STAGES[256] and spec.shared_bytes == wide.shared_memory_bytes
    # a small problem lowers the grid below the full count: the plain wgmma kernel
    few = plan_gemm(16, 256, 512, 2, 2, H200, tall=True, **ws)
    assert few.moe_block_size == 128 and few.blocks_per_sm == 1 and not few.producer_warp
    assert not plan_gemm(4096, 1536, 2048, 8, 128, H200, layout="modelopt", **ws).producer_warp
    assert not plan_gemm(4096, 1536, 2048, 8, 128, H200, scale_format=K16).producer_warp  # the rule: never
    facts = MoeLayerFacts(dtype="bf16", hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8,
                          activation="silu")
    assert not any(p.plan.producer_warp for p in split_layer(4096, facts, H200))  # nothing recorded
    monkeypatch.setitem(planning.POLICY, "producer", "always")
    assert all(p.plan.producer_warp and p.spec.producer_warp for p in split_layer(4096, facts, H200))


def test_tall_blocks_take_the_256_wide_tile_on_two_warpgroups_where_asked(monkeypatch):
    """The "tallwide" knob: a layer's two GEMMs put their 128-row blocks on the 256-wide tile where N fits it,
    on two warpgroups (each thread's accumulators stay at 128 floats), one CTA an SM; the rule never does,
    the fused kernel's CTA stays one warpgroup, and the producer form refuses that tile."""
    from cuteaot.codegen.kernels.w4a16 import planning
    from cuteaot.codegen.kernels.w4a16.fused_planning import plan_fused, split_layer
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec
    from cuteaot.runtime.kernels.w4a16.geometry import WGMMA_TILES, wgmma_shared_memory_footprint, wgmma_threads
    from cuteaot.runtime.resolution import MoeLayerFacts

    wide, narrow = WGMMA_TILES
    assert [wgmma_threads(b, t) for b, t in ((64, wide), (128, narrow), (128, wide), (256, narrow))] == [128, 128, 256, 256]
    assert planning.wgmma_tile(1536, 2048, 128, K16, H200, tall_wide=True) == (wide, None)
    assert planning.wgmma_tile(1536, 2048, 128, K16, H200) == (narrow, None)
    assert planning.wgmma_tile(5760, 2944, 128, K16, H200, tall_wide=True) == (narrow, None)  # 5760 % 256 = 128
    assert plan_gemm(2048, 1536, 2048, 8, 128, H200, scale_format=K16).tile == narrow  # the rule
    plan = plan_gemm(2048, 1536, 2048, 8, 128, H200, scale_format=K16, tall_wide=True)
    assert (plan.moe_block_size, plan.tile, plan.blocks_per_sm, plan.grid_x) == (128, wide, 1, H200.sm_count)
    assert plan.shared_memory_bytes == wgmma_shared_memory_footprint(128, wide) == 2064 + 1024 + 4 * (16384 + 8192 + 1024)
    spec = planning.gemm_spec_for(plan, "bf16", 1536, 2048, 8, a_per_route=False, mul_topk_weights=False,
                                  epilogue="none")
    assert (spec.threads, spec.shared_bytes) == (256, plan.shared_memory_bytes)
    with pytest.raises(BadInputError, match="producer_warp"):
        GemmSpec(**{**spec.__dict__, "producer_warp": True})
    # a layer asks the knob for both GEMMs; the fused kernel never takes the tile
    facts = MoeLayerFacts(dtype="bf16", hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8,
                          activation="silu")
    assert {p.plan.tile for p in split_layer(2048, facts, H200)} == {narrow}  # nothing recorded there
    monkeypatch.setitem(planning.POLICY, "tallwide", "always")
    assert [(p.plan.tile, p.spec.threads) for p in split_layer(2048, facts, H200)] == [(wide, 256)] * 2
    assert plan_fused(2048, 2048, 768, 128, 8, True, H200, tall=True).fc1_tile.tile_n == 128
    # both knobs asked: the producer form keeps out of the 256-wide tile (its spec would refuse it)
    both = plan_gemm(2048, 1536, 2048, 8, 128, H200, scale_format=K16, tall_wide=True, producer=True)
    assert (both.tile, both.producer_warp) == (wide, False)
