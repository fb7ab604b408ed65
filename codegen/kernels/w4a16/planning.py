"""Build-time planning of the W4A16 grouped MoE GEMM: which kernel, grid and buffers for each M.

Runs only in the build (codegen): its decisions are written into the manifest's
resolution table and the runtime serves from that table, so a change here cannot
alter what an existing bundle serves.  It depends on a :class:`DeviceProfile`,
never on a live GPU: an AOT build plans for a target it may not have.

Where the numbers come from
---------------------------
* Tile candidates, the shared-memory fit check, the blocks-per-SM rule and the tile
  choice follow the seed's host planning (the W4A16 JIT kernel file,
  ``_select_tile_config`` and helpers).  Only the exact case is kept: N and K must
  be multiples of the tile and K of the scale group.
* The register counts are the seed's table measured on SM121; they are only an
  *estimate* on other targets (sm_90a differs), so every planning call accepts the
  real count read from the built cubin.
* Route-block sizing follows the standard Marlin-MoE recipe
  (:func:`select_route_block_size`); the slot bounds and the partition replay are
  kernel geometry (`cuteaot.runtime.kernels.w4a16.geometry`).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from cuteaot.runtime.devices import PROFILES, DeviceProfile
from cuteaot.runtime.errors import BadInputError
from cuteaot.runtime.kernels.w4a16.gemm_spec import Epilogue, GemmSpec, Mainloop, Routes
from cuteaot.runtime.types import DType
from cuteaot.runtime.weights import stored_dims
from cuteaot.runtime.kernels.w4a16.geometry import (
    ALLOWED_MOE_BLOCK_SIZES,
    PRODUCER_THREADS,
    STAGES,
    WGMMA_BLOCK_SIZES,
    WGMMA_WS_BLOCKS,
    WGMMA_WS_STAGES,
    WGMMA_WS_TILE,
    WGMMA_SHORT_BLOCKS,
    WGMMA_TALL_BLOCK,
    WGMMA_WIDE_BLOCK,
    ScaleFormat,
    TileConfig,
    check_positive,
    cta_m_blocks,
    lock_slots,
    max_packed_route_slots,
    shared_memory_footprint,
    splitk_scratch_floats,
    tile_count,
    wgmma_shared_memory_footprint,
    wgmma_threads,
    wgmma_tiles,
    wgmma_ws_launch_registers,
    wgmma_ws_layout,
)

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

# Candidates in the seed's order; on equal blocks-per-SM the earlier one wins.
# One-MMA-row blocks (moe_block_size 8 or 16) favour deep K; taller blocks wide N.
SMALL_BATCH_TILE_CONFIGS = (TileConfig(128, 128), TileConfig(64, 128), TileConfig(128, 64))

LARGE_BATCH_TILE_CONFIGS = (TileConfig(64, 256), TileConfig(64, 128), TileConfig(128, 64))

PACKED_M8_TILE = TileConfig(64, 128)

# NVFP4 read as stored (layout "modelopt"): its rows are K-contiguous, so a stage of tile_k reads tile_k / 2
# bytes of each weight row and tile_k / 16 scale bytes, 32 B and 4 B pieces at PACKED_M8_TILE's 64 (the packed
# layout's stage is one contiguous run).  Its mma.sync route blocks up to MODELOPT_DEEP_MAX_BLOCK rows take this
# (tile_k, tile_n) instead, per GEMM where it fits (K a multiple of 128): 64-byte pieces, the same stage bytes and
# threads.  A/B on the H200 (compare_layer --weights modelopt, docs/benchmarks.md "twelfth session"), against the
# 64-deep tiles: 8-row blocks 0.78-0.89x the layer's time at M = 4-64 on Qwen3-30B, GLM-4.5-Air and
# Nemotron-3-Nano, though a gated FC1 64 wide loses its activating epilogue (a 128x128 tile at 256 threads that
# keeps it took 0.81-0.91x, and Nemotron, whose FC2 K does not fit it, 1.26x); 16-row blocks 0.64-0.79x at
# M = 128-192.
MODELOPT_DEEP_TILE = (128, 64)
MODELOPT_DEEP_MAX_BLOCK = 16

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

# The sm_90a large-M loop (warpgroup MMA, codegen/kernels/w4a16/wgmma.py): one warpgroup per
# CTA over 64-row route blocks (the wgmma N), tiles WGMMA_TILES (defined below TileConfig).
WGMMA_ARCHS = ("sm_90a",)

# Registers per thread of the built sm_90a cubins by (block, tile_n) (`cuteaot inspect`); the
# runtime re-checks co-residency with the real count, this only sizes the planned grid.
WGMMA_REGISTERS_SM90 = {(16, 256): 178, (16, 128): 111, (32, 256): 188, (32, 128): 116, (48, 256): 223,
                        (48, 128): 132, (64, 256): 220, (64, 128): 136, (128, 128): 228, (128, 256): 232,
                        (256, 128): 221}
# The same for NVFP4 read as stored (layout "modelopt"): its decode holds six words per 16-row block
# (packed: one and a half), so its tiles are 128 wide (the 256-wide tile's four blocks spilled).  The short
# blocks' counts are ptxas's at 4 / 4 / 3 CTAs an SM, the gated FC1 epilogue's or the plain one's, whichever is
# more (the 48-row block spills 32-40 B at 4).
WGMMA_REGISTERS_SM90_MODELOPT = {(16, 128): 113, (32, 128): 128, (48, 128): 152, (64, 128): 173, (128, 128): 252,
                                 (256, 128): 226}
# 16-, 32- and 48-row route blocks (WGMMA_SHORT_BLOCKS, wgmma N = the block) take the wgmma loop on
# sm_90a too, on 128-wide tiles.  A/B on the H200 against the mma.sync loop (benchmarks/compare_layer.py,
# identical operands, docs/benchmarks.md "Short route blocks on the warpgroup-MMA loop"): 0.76-0.92x the
# layer's time wherever the plan changed (the 128-expert shapes at M = 128-384, Mixtral at 32-64,
# gpt-oss-20b at 64-128); the 256-wide tile (178-223 registers, 2 CTAs an SM against 3-4 for the
# 128-wide one's 111-132) gained less (0.69-1.06x).
WGMMA_SHORT = True
WGMMA_SHORT_MAX_TILE_N = 128
# The short blocks that take the wgmma loop for NVFP4 read as stored (layout "modelopt"): its layers then split
# into two wgmma GEMMs instead of running the fused mma.sync kernel.  A/B on the H200 (compare_layer --weights
# modelopt, identical operands, docs/results/ab-modelopt-short-blocks-2026-12-02.json): 48-row blocks 0.82-0.90x
# the layer's time (Qwen3-30B, GLM-4.5-Air, Qwen3-235B tp4, Nemotron-3-Nano), 32-row blocks 0.87-0.98x (Nemotron
# 1.004-1.006), 16-row blocks 1.10-1.19x: those stay on the mma.sync loop.
MODELOPT_WGMMA_SHORT_BLOCKS = (32, 48)
# 128-row blocks of the standalone GEMM on the 256-wide tile (two warpgroups, each 128 weight rows x the
# block's tokens; the knob "tallwide"): per 64-k stage a CTA stages 16 KiB of activations for 256 weight
# rows instead of 128, so the gathered activations are read from L2 half as often, but one CTA holds the
# SM (232 registers x 256 threads) and nothing hides its fill and epilogue.  A/B on the H200
# (compare_layer, identical operands, docs/benchmarks.md "128-row blocks on the 256-wide tile"): 0.93-0.97x
# the layer's time with long K or many tiles (Mixtral M = 512, GLM-4.5-Air 2048, Qwen3-30B and Qwen3-235B
# tp4 8192), 1.003-1.03x elsewhere (six stages instead of four: no better), so it is measured per layer
# shape, and the rule never takes it.
WGMMA_TALL_WIDE_TILE = False
# Average routes per expert from which a GEMM packs 128-row blocks (the wgmma loop's tallest), for
# layers without a measured choice (MEASURED_BLOCKS).
WGMMA_TALL_MIN_ROUTES = 128
# ... and from this many where one 128-row block an expert still gives every GEMM of the layer
# WGMMA_TALL_SPREAD_MIN_TILES x the SM count of 128-wide tiles.  The measured "tall" tables (H200) start
# winning at 55-78 routes per expert on nine of the ten shapes, each with 768-2816 such tiles; the tenth
# (Qwen3-235B tp8, 384 tiles) never wins.  Shapes no table holds (docs/benchmarks.md, twenty-ninth session):
# Qwen3-Next-80B (4096 tiles) 0.84-0.95x the layer's time at 80-120 routes per expert (H100 and H200),
# Llama-4-Scout (2048 tiles) 0.78-0.94x at 80-128 (H200), Granite-3.0-1B (256 tiles: one wave) 1.23-1.25x at
# 80-112 (H100).
WGMMA_TALL_SPREAD_MIN_ROUTES = 80
WGMMA_TALL_SPREAD_MIN_TILES = 4
# Experts up to which the rule takes 16-row wgmma blocks where it packs 8-row mma.sync ones (the
# "promote" choice, otherwise measured per shape and not borrowed): few experts, each holding many
# weight bytes per route.  The measured tables (H200): Mixtral-8x7B (8 experts) wins at every M of
# 7-64, gpt-oss-20b (32) from 40 tokens, the 128-expert shapes but the narrow Qwen3-235B shards never;
# borrowed by 64-expert shapes it lost at 7 of 8 points.  Measured with this rule (docs/benchmarks.md,
# twenty-ninth session): Llama-4-Scout and Phi-3.5-MoE (16 experts, no table) 0.90-0.97x the layer's time at
# every M of 7-48 on an H100; on the H200 0.86-0.98x at 3-8 tokens, 0.95-1.03x at 16-48; Mixtral at 3-6
# tokens, below its table's range, 0.82-0.90x (H200).
PROMOTE_MAX_EXPERTS = 16  # (layers only, as WGMMA_TALL_SPREAD_*: the standalone GEMM keeps its plain rules)
# Average routes per expert from which the standalone GEMM packs 256-row blocks (two warpgroups over
# one staged activation tile, wgmma N = 256); the fused kernel keeps one warpgroup and 128 rows.  Measured
# on the H200 against 256 (compare_layer --check, identical operands, 3 rounds,
# docs/results/ab-wide-min-routes-2026-12-03.json): at 160-224 routes per expert the 256-row blocks took
# 0.83-0.97x the layer's time on all six K >= 1024 shapes (gpt-oss-120b/-20b, GLM-4.5-Air, Qwen3-235B,
# Nemotron-3-Nano, Mixtral): an expert with 129-256 routes decodes its weights once, not twice.  At 128
# they lost on gpt-oss-120b (1.022x) and won on Nemotron at 144 (0.976x).
WGMMA_WIDE_MIN_ROUTES = 160
# Below this many routes per expert a layer whose FC1 may take 256-row blocks (K >= WGMMA_WIDE_MIN_K) but
# whose FC2 may not (Qwen3-30B: K = 768) runs FC1 on them anyway, and FC2 reads that packing as 128-row
# blocks (GemmSpec.packing_block).  Measured on Qwen3-30B's FC1 alone (compare_gemm, docs/results/
# ab-qwen3-fc1-wide-2026-12-03.json): 0.800x at 160 routes per expert, 1.159x at exactly 256 (half the
# experts then get a second, nearly empty 256-row block), 0.999x at 512.
WGMMA_MIXED_MAX_ROUTES = 256
# ... for layers without a measured choice, only where every GEMM's K is at least this: a 256-row CTA
# holds a whole SM (one per SM), so nothing hides its tiles' pipeline fill and epilogue, which a short K
# does not amortise (H200, 256-row blocks vs 128: Qwen3-30B, FC2 K = 768, 1.06x / 1.01x / 0.97x at
# M = 4096 / 8192 / 16384; K >= 1408: 0.88-0.98x; docs/benchmarks.md).
WGMMA_WIDE_MIN_K = 1024
# Where a measured choice beats the planner's rules, per device profile, layer shape and token
# range, as measured by benchmarks/tune_blocks.py (the file says when, where and on which commit).
# Four choices ("knobs"): "tall", 128-row wgmma route blocks below the average of 128 routes per expert
# (the answer depends on each shape's wave quantisation and tile widths, docs/benchmarks.md "Route
# blocks measured per layer": no single threshold wins); "decode", the fused decode regime (direct
# 8-row route blocks, top-k sum folded into FC2) past DECODE_MAX_M; "wide", 256-row blocks where
# the K rule (WGMMA_WIDE_MIN_K) says no; and "promote", 16-row wgmma blocks where the rule packs 8-row
# mma.sync ones (0.70-0.93x the time on Mixtral and the narrow Qwen3-235B shards, 1.02-1.07x on the
# wide 128-expert shapes).  A fifth, "producer", runs 128- and 256-row blocks on the wgmma loop with a
# producer warpgroup (codegen/kernels/w4a16/wgmma_ws.py); the rule never does, and nothing is recorded:
# on the H200 it took 0.98-1.05x the plain loop's layer time at M = 2048-16384 and racecheck reports
# hazards on it (docs/benchmarks.md "The wgmma loop with a producer warpgroup").  A sixth, "onewave",
# sizes a decode launch's grid to the larger GEMM's whole tiles instead of FC1's, so that FC2 keeps its
# narrower tiles and spreads over more SMs (fused_planning._decode_grid); a seventh, "topksum", has a
# packed plan's FC2 add the routes' rows into the output itself (no top-k sum kernel), and an eighth,
# "splitsum", the FC2 GEMM of a layer run as two GEMMs (with 16-byte vector reductions: 0.90-0.98x the time
# from ~1500 tokens on most 128-expert shapes, docs/benchmarks.md "fourteenth session"); a ninth,
# "tallwide", the standalone GEMMs' 128-row blocks on the 256-wide tile (WGMMA_TALL_WIDE_TILE); a tenth,
# "splitk", splits a decode launch's K over every co-resident CTA where the rule keeps one whole tile per
# CTA because one wave of them covers both GEMMs (fused_planning._decode_grid): the whole-tile plan leaves
# SMs idle or doubled (gpt-oss-120b M = 1: 180 FC1 tiles on 132 SMs, 92 FC2 tiles).  Measured on the H200
# (2026-12-04, docs/results/tune-splitk-2026-12-04.json) at M = 1, 2 on every shipped shape: 0.97-1.28x the
# rule's time, no win past noise, so the table records none (the split-K merges cost more than the balance buys).
# An eleventh, "fusepack", keeps a layer the rule would split into two GEMM launches (split_layer) on the fused
# kernel where that packs its routes itself (at most PACK_MAX_ROUTES of them): no route-pack launch, no
# intermediate through HBM, against the fused kernel's grid barriers.  Measured on the H200 (2026-12-04,
# docs/results/tune-fusepack-2026-12-04.json): 0.95-0.96x on Qwen3-30B at M = 116-128, 0.97x on Qwen3-235B tp4
# and gpt-oss-20b, 0.98x on gpt-oss-120b and Nemotron, 0.99x (no win) on tp1 / tp2 / GLM / Mixtral, 1.01-1.04x on tp8.
# A twelfth, "narrow", is "wide" the other way round: 128-row blocks where the rule (or the "wide" table) packs
# 256-row ones for a layer run as two GEMMs.  256 rows decode each weight tile for twice the tokens, but an
# expert's routes past a multiple of 256 then cost a whole second 256-row tile for a few of them, and an SM
# holds one such CTA: on an H100 (docs/benchmarks.md, thirtieth session) 128-row blocks took 0.955x / 0.961x
# the layer's time on GLM-4.5-Air at 256 / 384 routes per expert and 1.10x at 192, 0.974x on Qwen1.5-MoE at
# 273 and 1.07x at 205: it turns on how each expert's routes fill the blocks, which a table per shape and M
# records and no single threshold does.
# A thirteenth, "micro", runs a decode launch on the barrier-free micro kernel (FusedSpec.micro,
# codegen/kernels/w4a16/micro.py) wherever that can serve the layer; a fourteenth, "microstored", is the same
# choice for weights read as stored (modelopt, modelopt_w31), measured on them: there both kernels read other
# bytes (k-contiguous rows) than on the packed layout, so the packed table says nothing about them.
MEASURED_BLOCKS = Path(__file__).with_name("measured_blocks.json")
MEASURED_KNOBS = ("tall", "decode", "wide", "promote", "producer", "onewave", "topksum", "splitsum", "tallwide",
                  "splitk", "fusepack", "narrow", "micro", "microstored")

# What layer planning asks each knob for: "measured" (MEASURED_BLOCKS, else the rule), "rule" (the
# rule alone) or "always" (the choice wherever it can run).  benchmarks/tune_blocks.py builds its
# two candidate bundles with "rule" and "always"; shipped bundles use "measured".
POLICY = {"tall": "measured", "decode": "measured", "wide": "measured", "promote": "measured", "producer": "measured",
          "onewave": "measured", "topksum": "measured", "splitsum": "measured", "tallwide": "measured",
          "splitk": "measured", "fusepack": "measured", "narrow": "measured", "micro": "measured",
          "microstored": "measured"}


# A layer shape that no knob's table holds (a model nobody measured here) borrows, knob by knob, the
# table of the nearest shape measured for that knob, read at the same routes per expert (m * top_k /
# num_experts: how full the route blocks are, what most of these choices turn on).  Nearest: the
# smallest shape_distance, and none past BORROW_RADIUS.  Checked by leaving each measured shape out in
# turn and planning it from the others' tables (`python -m benchmarks.tune_blocks holdout`, docs/
# design.md "Shapes nobody measured"): over the recorded points where a knob's choice changes the plan,
# borrowing took 0.960-0.995x the rule's time for every knob that ever won, but "fusepack" 1.001x (3
# points faster, 4 slower, up to 1.04x) and "promote" 0.992x (3 of its 10 borrowed points slower, up to
# 1.04x).  On five real models no table holds (specs/bench-unseen.yaml, H200, docs/benchmarks.md
# "eighteenth session") the other choices took 0.79-0.99x the rule's time at 75 of the 76 points they
# changed (OLMoE at 896 tokens 1.11x), "promote" 0.92-1.06x (slower at 7 of 8).  So neither of those
# two is borrowed.  The radius keeps Mixtral (E = 8; its nearest measured shape is 4.0 away) on the
# rule: borrowed across that distance its choices went both ways (0.70-1.10x).  A shape that some
# table holds (every shipped one) keeps its own tables and the rule elsewhere.  "micro" is not borrowed
# either: whether it wins turns on how its work items (routes x 128-column FC1 tiles) fill the SMs against the
# persistent kernel's grid (0.91-2.2x on the measured shapes, docs/benchmarks.md "thirty-second session"), which
# routes per expert does not describe, and no leave-one-out has checked it.
BORROW = True
BORROW_RADIUS = 2.0
NOT_BORROWED = ("fusepack", "promote", "micro", "microstored")

Shape = tuple[int, int, int, int, bool]  # hidden, intermediate, experts, top_k, gated


def shape_distance(a: Shape, b: Shape) -> float:
    """Sum of |log| ratios of hidden size, intermediate size, experts and top_k, plus 1 where one is
    gated and the other not: 0.69 is one dimension doubled."""
    return (sum(abs(math.log(x / y)) for x, y in zip(a[:4], b[:4])) + (0.0 if a[4] == b[4] else 1.0))


def _lender(shape: Shape, measured) -> Shape | None:
    """The nearest of the `measured` shapes, if it is within BORROW_RADIUS (ties: the smaller shape)."""
    near = min(measured, key=lambda t: (shape_distance(shape, t), t), default=None)
    return near if near is not None and shape_distance(shape, near) <= BORROW_RADIUS else None


def borrowed_choice(m: int, shape: Shape, tables: dict) -> bool | None:
    """The choice an m-token layer of an unmeasured `shape` borrows from `tables` ({shape: ((lo, hi)
    measured, ((lo, hi), ...) won)} of one knob and profile): the nearest shape's, at the m' with the
    same routes per expert; None where nothing is within BORROW_RADIUS or m' is outside what it measured."""
    near = _lender(shape, tables)
    if near is None:
        return None
    (lo, hi), won = tables[near]
    at = m * shape[3] / shape[2] * near[2] / near[3]  # near's token count with this routes-per-expert
    if not lo <= at <= hi:
        return None
    return True if any(a <= at <= b for a, b in won) else None


@functools.cache
def _measured(knob: str) -> dict:
    """{(profile, hidden, intermediate, experts, top_k, gated): ((lo, hi) measured, ((lo, hi), ...) won)}:
    the token ranges measured and where the knob's choice won (MEASURED_BLOCKS)."""
    data = json.loads(MEASURED_BLOCKS.read_text())
    return {(profile, row["hidden_size"], row["intermediate_size"], row["num_experts"], row["top_k"], row["gated"]):
            (tuple(row["measured_m"]), tuple(tuple(r) for r in row["won_m"]))
            for profile, rows in data.get(knob, {}).items() for row in rows}


@functools.cache
def _known_shapes() -> frozenset:
    """Every (profile, shape) some knob's table holds."""
    return frozenset(key for knob in MEASURED_KNOBS for key in _measured(knob))


@functools.cache
def _profile_tables(knob: str, profile: str) -> dict:
    """{shape: (measured, won)} of one knob on one profile: what a shape no table holds may borrow from."""
    return {key[1:]: value for key, value in _measured(knob).items() if key[0] == profile}


@functools.cache
def _measured_profiles() -> frozenset:
    """The profiles some table holds."""
    return frozenset(key[0] for key in _known_shapes())


def tables_profile(profile: DeviceProfile) -> str:
    """The profile whose measured tables plan for `profile`: its own where some table holds it, else the first
    profile with tables and the same planning facts (the H100 plans with the H200's tables: the same SMs, shared
    memory and registers, only the memory differs; measured on an H100, docs/benchmarks.md, 2026-12-05)."""
    measured = _measured_profiles()
    if profile.name in measured:
        return profile.name
    for other in PROFILES.values():
        if other.name in measured and other.planning_facts == profile.planning_facts:
            return other.name
    return profile.name


def reload_measured() -> None:
    """Read MEASURED_BLOCKS again on the next question (after the file or its path changed)."""
    for cached in (_measured, _known_shapes, _measured_profiles, _profile_tables):
        cached.cache_clear()


def tables_of(hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, gated: bool,
              profile: DeviceProfile) -> str:
    """Where this shape's measured choices come from, for the build's planning line: its own tables,
    the nearest measured shapes' (BORROW), or none (the rule alone)."""
    shape = (hidden_size, intermediate_size, num_experts, top_k, gated)
    name = tables_profile(profile)
    of = "" if name == profile.name else f", {name}'s (the same SMs)"
    if (name, *shape) in _known_shapes():
        return "measured tables" + of
    if name not in _measured_profiles():
        return f"nothing measured on {profile.name}: the rule alone"
    lenders = set()
    for knob in MEASURED_KNOBS if BORROW else ():
        near = _lender(shape, _profile_tables(knob, name))
        if knob not in NOT_BORROWED and near is not None:
            lenders.add(near)
    if not lenders:
        return f"no measured shape within {BORROW_RADIUS} (BORROW_RADIUS): the rule alone"
    return "tables borrowed from " + ", ".join(
        f"H {h} I {i} E {e} top-{k}{'' if g else ' ungated'} ({shape_distance(shape, (h, i, e, k, g)):.2f} away)"
        for h, i, e, k, g in sorted(lenders, key=lambda t: shape_distance(shape, t))) + of


def measured_choice(knob: str, m: int, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                    gated: bool, profile: DeviceProfile) -> bool | None:
    """True where an m-token layer of this shape takes the knob's choice by POLICY; None: the rule
    decides (where the choice did not win, or the rule already makes it).  A shape no table holds
    borrows the nearest measured shape's choice (BORROW)."""
    policy = POLICY[knob]
    if policy == "always":
        return True
    if policy == "rule":
        return None
    key = (tables_profile(profile), hidden_size, intermediate_size, num_experts, top_k, gated)
    entries = _measured(knob)
    if key in entries:
        return True if any(lo <= m <= hi for lo, hi in entries[key][1]) else None
    if not BORROW or knob in NOT_BORROWED or key in _known_shapes():
        return None
    return borrowed_choice(m, key[1:], _profile_tables(knob, key[0]))


def layer_rules(m: int, top_k: int, num_experts: int, widths, profile: DeviceProfile,
                tall: bool | None, promote: bool | None) -> tuple[bool, bool]:
    """A layer's (tall, promote): the given choices, and where one is None (nothing measured) the layer's rule.

    tall: 128-row blocks once the average expert has WGMMA_TALL_MIN_ROUTES routes, or WGMMA_TALL_SPREAD_MIN_ROUTES
    where a block an expert leaves every GEMM (output widths `widths`) WGMMA_TALL_SPREAD_MIN_TILES x the SM count
    of 128-wide tiles.  promote: at most PROMOTE_MAX_EXPERTS experts.  (The standalone GEMM keeps its plain
    rules, wgmma_tall_block's and no promotion: the evidence is the layers'.)"""
    if tall is None:
        routes = m * top_k
        tiles = min(num_experts * tile_count(n, 128) for n in widths)  # (128-row blocks run 128-wide tiles)
        tall = routes >= WGMMA_TALL_MIN_ROUTES * num_experts or (
            routes >= WGMMA_TALL_SPREAD_MIN_ROUTES * num_experts
            and tiles >= WGMMA_TALL_SPREAD_MIN_TILES * profile.sm_count)
    if promote is None:
        promote = num_experts <= PROMOTE_MAX_EXPERTS
    return tall, promote


def wgmma_tall_block(m: int, top_k: int, num_experts: int, block: int, dims, scale_format, profile,
                     tall: bool | None = None) -> int:
    """`block`, or WGMMA_TALL_BLOCK where every (n, k) of `dims` takes a 128-row wgmma tile and
    `tall` says so (None: where the average expert has WGMMA_TALL_MIN_ROUTES routes)."""
    if tall is None:
        tall = m * top_k >= WGMMA_TALL_MIN_ROUTES * num_experts
    if tall and all(wgmma_tile(n, k, WGMMA_TALL_BLOCK, scale_format, profile)[0] is not None for n, k in dims):
        return WGMMA_TALL_BLOCK
    return block

def wide_by_k(*ks: int) -> bool:
    """The rule for 256-row blocks where nothing was measured: every GEMM's (stored) K is long enough."""
    return min(ks) >= WGMMA_WIDE_MIN_K

def wgmma_wide_block(m: int, top_k: int, num_experts: int, block: int, dims, scale_format, profile,
                     wide: bool | None = None) -> int:
    """`block`, or WGMMA_WIDE_BLOCK where `block` is the 128-row one, the average expert has
    WGMMA_WIDE_MIN_ROUTES routes, every (n, k) of `dims` takes a 256-row wgmma tile and `wide` says
    so (None: `wide_by_k` of the ks of `dims`)."""
    if block != WGMMA_TALL_BLOCK or m * top_k < WGMMA_WIDE_MIN_ROUTES * num_experts:
        return block
    if wide is None:
        wide = wide_by_k(*(k for _, k in dims))
    if wide and all(wgmma_tile(n, k, WGMMA_WIDE_BLOCK, scale_format, profile)[0] is not None for n, k in dims):
        return WGMMA_WIDE_BLOCK
    return block

@functools.cache
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

@functools.cache
def wgmma_tile(n: int, k: int, moe_block_size: int, scale_format: "ScaleFormat",
               profile: DeviceProfile, layout: str = "packed",
               tall_wide: bool = False) -> tuple[TileConfig | None, str | None]:
    """The widest wgmma tile that runs this GEMM on `profile`, or (None, why not).

    tall_wide: 128-row blocks may take the 256-wide tile on two warpgroups (the standalone GEMM where the
    "tallwide" knob says so); otherwise their tile is one warpgroup's, 128 wide."""
    if profile.arch not in WGMMA_ARCHS:
        return None, f"{profile.name} ({profile.arch}) has no warpgroup MMA"
    if moe_block_size not in WGMMA_BLOCK_SIZES:
        return None, f"the wgmma loop takes {WGMMA_BLOCK_SIZES}-row route blocks, the plan has {moe_block_size}"
    if scale_format is not ScaleFormat.E4M3_K16:
        return None, f"the wgmma loop decodes e4m3_k16 scales, not {scale_format.value}"
    limit = profile.max_shared_memory_per_block_optin - _FIT_SHARED_MEMORY_MARGIN
    tiles = wgmma_tiles(moe_block_size)
    if moe_block_size in WGMMA_SHORT_BLOCKS:
        if layout == "modelopt" and moe_block_size not in MODELOPT_WGMMA_SHORT_BLOCKS:
            return None, (f"NVFP4 read as stored takes the wgmma loop for {MODELOPT_WGMMA_SHORT_BLOCKS}-row short blocks "
                          f"only (measured: MODELOPT_WGMMA_SHORT_BLOCKS)")
        tiles = tuple(t for t in tiles if t.tile_n <= WGMMA_SHORT_MAX_TILE_N)
    if layout == "modelopt":
        tiles = tuple(t for t in tiles if t.tile_n <= 128)
    if moe_block_size == WGMMA_TALL_BLOCK and not tall_wide:
        tiles = tuple(t for t in tiles if t.tile_n <= 128)
    for tile in tiles:
        if (n_tiles_fit(n, tile.tile_n) and k % tile.tile_k == 0
                and wgmma_shared_memory_footprint(moe_block_size, tile) <= limit):
            return tile, None
    return None, f"N={n} and K={k} are not multiples of a wgmma tile ({', '.join(f'{t.tile_n}x{t.tile_k}' for t in tiles)})"

def on_wgmma(block: int, short: bool | None = None) -> bool:
    """Whether a route block of this size may take the wgmma loop (`wgmma_tile` then says whether a tile
    runs it): 64 rows and up always, the short blocks where `short` says so (None: WGMMA_SHORT)."""
    return block not in WGMMA_SHORT_BLOCKS or (WGMMA_SHORT if short is None else short)

def promoted_block(block: int, dims, scale_format, profile, layout: str = "packed", promote: bool | None = None,
                   short: bool | None = None) -> int:
    """16 for a packed 8-row block where `promote` (the "promote" knob) says so and a 16-row wgmma tile runs
    every (n, k) of `dims`, else `block`.  (Stored-layout layers are never promoted: no wgmma tile runs their
    16-row blocks, MODELOPT_WGMMA_SHORT_BLOCKS.)"""
    if block != 8 or not promote or not on_wgmma(16, short):
        return block
    if all(wgmma_tile(n, k, 16, scale_format, profile, layout)[0] is not None for n, k in dims):
        return 16
    return block

def wgmma_blocks_per_sm(m: int, n: int, top_k: int, moe_block_size: int, tile: TileConfig, profile: DeviceProfile,
                        registers: int) -> int:
    """Co-resident wgmma CTAs per SM (registers, shared memory, threads), lowered for small problems."""
    unit = _REGISTER_UNIT_PER_THREAD
    threads = wgmma_threads(moe_block_size, tile)
    per_block = -(-registers // unit) * unit * threads
    smem = wgmma_shared_memory_footprint(moe_block_size, tile) + _RESIDENT_SHARED_MEMORY_PER_BLOCK
    limit = max(min(profile.registers_per_sm // per_block, profile.shared_memory_per_sm // smem,
                    profile.max_threads_per_sm // threads), 1)
    work_ctas = tile_count(n, tile.tile_n) * m * top_k * _WORK_CTAS_PER_TILE_ROUTE
    if work_ctas < profile.sm_count * limit:
        limit = max(work_ctas // profile.sm_count, 1)
    return limit

def wgmma_ws_blocks_per_sm(moe_block_size: int, tile: TileConfig, profile: DeviceProfile) -> int:
    """Co-resident producer-warpgroup CTAs per SM: shared memory and threads (registers are split by setmaxnreg
    from what that count leaves, geometry.wgmma_ws_compute_registers)."""
    threads = wgmma_threads(moe_block_size, tile) + PRODUCER_THREADS
    smem = (wgmma_ws_layout(moe_block_size, tile, WGMMA_WS_STAGES[moe_block_size]).footprint
            + _RESIDENT_SHARED_MEMORY_PER_BLOCK)
    return max(min(profile.shared_memory_per_sm // smem, profile.max_threads_per_sm // threads), 1)

def n_tiles_fit(n: int, tile_n: int) -> bool:
    """Whether tile_n-wide tiles may cover N: whole tiles, or where N = 64 (mod 128) (stored to whole 64-column
    slabs, which no 128- or 256-wide tile divides) a masked last tile at least half inside N."""
    tail = n % tile_n
    return tail == 0 or (n % 128 == 64 and 2 * tail >= tile_n)


@functools.cache
def tile_misfit(
    n: int, k: int, moe_block_size: int, tile: TileConfig, scale_format: ScaleFormat, profile: DeviceProfile,
    layout: str = "packed",
) -> str | None:
    """Why `tile` cannot run an (N, K) GEMM on `profile`, or None if it can.

    Every scale group is whole; N and K end in part tiles only as `n_tiles_fit` and the layout allow:
    e4m3_k16 scales mask a last N tile (packed and stored alike), the packed layout also a last 128-deep
    k-tile (K a multiple of 64); NF3 keeps whole tiles (its N a multiple of 128).
    """
    group = scale_format.group_size
    masks_n = scale_format is ScaleFormat.E4M3_K16  # NVFP4, packed or read as stored (modelopt)
    masks_k = masks_n and layout == "packed"
    if n % tile.tile_n and not (masks_n and n_tiles_fit(n, tile.tile_n)):
        return f"N={n} is not a multiple of tile_n={tile.tile_n}"
    if k % tile.tile_k and not (masks_k and k % 64 == 0):
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
    cap: int | None = None,
) -> int:
    """Persistent CTAs per SM: what registers, shared memory and threads allow, then the seed's caps.

    `cap` (a measured count for this block size) replaces the register estimate and the seed's
    caps; shared memory and threads still bound it, and the kernel's launch bound makes ptxas
    fit the registers (a spill fails a default build).

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
    limit = _resident_blocks(moe_block_size, tile, scale_format, profile, registers)
    if cap is not None:
        limit = max(min(cap, _resource_blocks(moe_block_size, tile, scale_format, profile)), 1)
    work_ctas = tile_count(n, tile.tile_n) * m * top_k * _WORK_CTAS_PER_TILE_ROUTE
    if work_ctas < profile.sm_count * limit:
        limit = max(work_ctas // profile.sm_count, 1)
    return limit


@functools.cache
def _resident_blocks(moe_block_size: int, tile: TileConfig, scale_format: ScaleFormat, profile: DeviceProfile,
                     registers: int) -> int:
    """blocks_per_sm before the small-problem lowering (independent of M: cached, planning runs it per M)."""
    valid = isinstance(registers, int) and not isinstance(registers, bool)
    if not valid or not 1 <= registers <= _MAX_REGISTERS_PER_THREAD:
        raise BadInputError(f"registers must be in [1, {_MAX_REGISTERS_PER_THREAD}] per thread, got {registers!r}")
    unit = _REGISTER_UNIT_PER_THREAD
    registers_per_block = -(-registers // unit) * unit * tile.threads
    resources = _resource_blocks(moe_block_size, tile, scale_format, profile)
    limit = min(profile.registers_per_sm // registers_per_block, resources)
    if moe_block_size == 8:
        limit = max(min(M8_BLOCKS_PER_SM, resources), 1)
    elif cta_m_blocks(moe_block_size) == 1:
        limit = max(min(limit, _MAX_BLOCKS_PER_SM_ONE_M_BLOCK), 1)
    else:
        limit = max(min(limit, _MAX_BLOCKS_PER_SM_MULTI_M_BLOCK), 1)
    return limit

@functools.cache
def _resource_blocks(moe_block_size: int, tile: TileConfig, scale_format: ScaleFormat,
                     profile: DeviceProfile) -> int:
    """CTAs per SM that shared memory and the thread count allow (registers aside)."""
    smem = shared_memory_footprint(moe_block_size, tile, scale_format)
    smem_limit = profile.max_shared_memory_per_block_optin // (smem + _RESIDENT_SHARED_MEMORY_PER_BLOCK)
    return min(smem_limit, profile.max_threads_per_sm // tile.threads)


def packed_m8_blocks_per_sm(profile: DeviceProfile, tile: TileConfig = PACKED_M8_TILE) -> int:
    """CTAs per SM of an 8-row tile: PACKED_M8_BLOCKS_PER_SM 128-thread CTAs' worth (the register file at 128
    a thread) where shared memory and threads allow."""
    smem = shared_memory_footprint(8, tile, ScaleFormat.E4M3_K16) + _RESIDENT_SHARED_MEMORY_PER_BLOCK
    resident = min(profile.max_shared_memory_per_block_optin // smem, profile.max_threads_per_sm // tile.threads)
    return max(1, min(PACKED_M8_BLOCKS_PER_SM * 128 // tile.threads, resident))


def small_block_tile(n: int, k: int, block: int, scale_format: ScaleFormat, profile: DeviceProfile,
                     layout: str = "packed") -> TileConfig | None:
    """The tile of an N x K GEMM's packed route blocks of `block` rows on the mma.sync loop, where it is not the
    general choice (`select_tile`): 8-row blocks take PACKED_M8_TILE, and the stored layout's blocks up to
    MODELOPT_DEEP_MAX_BLOCK rows MODELOPT_DEEP_TILE where they fit; None where neither applies or fits."""
    candidates = []
    if layout == "modelopt" and block <= MODELOPT_DEEP_MAX_BLOCK:
        candidates.append(TileConfig(*MODELOPT_DEEP_TILE))
    if block == 8:
        candidates.append(PACKED_M8_TILE)
    return next((t for t in candidates if tile_misfit(n, k, block, t, scale_format, profile, layout) is None), None)

def select_tile(
    m: int, n: int, k: int, top_k: int, moe_block_size: int, scale_format: ScaleFormat, profile: DeviceProfile,
    *, threads: int | None = None, layout: str = "packed",
) -> tuple[TileConfig, int]:
    """The candidate tile with the most blocks per SM (earliest on ties), and that count.

    threads restricts the candidates to one CTA size (the fused kernel runs FC1 and FC2
    with the same threads); layout: the weights' (which part tiles its kernels mask, `tile_misfit`).

    Raises BadInputError naming every candidate and why it does not fit when none does.
    """
    candidates = SMALL_BATCH_TILE_CONFIGS if cta_m_blocks(moe_block_size) == 1 else LARGE_BATCH_TILE_CONFIGS
    best: tuple[TileConfig, int] | None = None
    reasons = []
    for tile in candidates:
        if threads is not None and tile.threads != threads:
            reasons.append(f"(tile_k={tile.tile_k}, tile_n={tile.tile_n}): not {threads} threads")
            continue
        reason = tile_misfit(n, k, moe_block_size, tile, scale_format, profile, layout)
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
    check_positive(m=m, top_k=top_k, num_experts=num_experts)
    routes = m * top_k
    for block in ALLOWED_MOE_BLOCK_SIZES:
        if routes * _ROUTE_FILL_DEN < _ROUTE_FILL_NUM * num_experts * block:
            return block
    return ALLOWED_MOE_BLOCK_SIZES[-1]

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
    producer_warp: bool = False  # the wgmma loop with a producer warpgroup (the "producer" knob)

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
    tall: bool | None = None,
    wide: bool | None = None,
    layout: str = "packed",
    short: bool | None = None,
    promote: bool | None = None,
    producer: bool | None = None,
    tall_wide: bool | None = None,
) -> GemmPlan:
    """Plan the grouped GEMM of m tokens x top_k routes against (N, K) expert weights.

    For FC2 of a fused MoE pass the same m and top_k as FC1 (the seed passes
    m * top_k rows with top_k = 1; only the product enters planning).
    pinned_tile replaces the automatic choice and must pass the same fit check.
    registers is the real per-thread count of the built cubin for that tile: it
    needs pinned_tile, and is what the runtime uses to re-check blocks per SM,
    since a grid larger than what is co-resident deadlocks in the split-K waits.
    tall: take 128-row wgmma blocks where they fit (True) or not (False); None: WGMMA_TALL_MIN_ROUTES.
    wide: 256-row wgmma blocks where the average expert fills them (True) or not (False); None: where K
    is at least WGMMA_WIDE_MIN_K (`wide_by_k`).  A layer's two GEMMs pass the same answer (they share
    one packing).  layout: the weights' ("modelopt": 128-wide wgmma tiles and their register counts).
    short: 16-, 32- and 48-row blocks on the wgmma loop (True) or the mma.sync loop (None: WGMMA_SHORT).
    promote: 16-row wgmma blocks where the rule packs 8-row ones (`promoted_block`).
    tall_wide: 128-row blocks on the 256-wide tile of two warpgroups where N fits it (None:
    WGMMA_TALL_WIDE_TILE).
    producer: 128- and 256-row packed blocks on the wgmma loop with a producer warpgroup, where the grid
    keeps its full CTA count (its register split assumes it); None / False: the plain loop.
    """
    check_positive(m=m, n=n, k=k, top_k=top_k, num_experts=num_experts)
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
    if pinned_tile is None and not direct:
        block = promoted_block(block, ((n, k),), scale_format, profile, layout, promote, short)
        block = wgmma_tall_block(m, top_k, num_experts, block, ((n, k),), scale_format, profile, tall)
        block = wgmma_wide_block(m, top_k, num_experts, block, ((n, k),), scale_format, profile, wide)
    mainloop = "mma_sync"
    producer_warp = False
    wg_tile = None
    if pinned_tile is None and on_wgmma(block, short):
        tall_wide = WGMMA_TALL_WIDE_TILE if tall_wide is None else tall_wide
        wg_tile = wgmma_tile(n, k, block, scale_format, profile, layout, tall_wide)[0]
    if wg_tile is not None:
        # 64-row blocks on sm_90a: the warpgroup-MMA loop (the mma.sync loop is issue-bound there)
        registers = WGMMA_REGISTERS_SM90_MODELOPT if layout == "modelopt" else WGMMA_REGISTERS_SM90
        mainloop, tile, used_registers = "wgmma", wg_tile, registers[(block, wg_tile.tile_n)]
        per_sm = wgmma_blocks_per_sm(m, n, top_k, block, tile, profile, used_registers)
        if producer and block in WGMMA_WS_BLOCKS and layout == "packed" and tile == WGMMA_WS_TILE:
            ws_per_sm = wgmma_ws_blocks_per_sm(block, tile, profile)
            if per_sm == ws_per_sm:
                producer_warp = True
                used_registers = wgmma_ws_launch_registers(block, per_sm, profile.registers_per_sm)
    elif (pinned_tile is None and block == 8 and not direct and k <= PACKED_M8_MAX_K
          and profile.arch in PACKED_M8_MEASURED_ARCHS
          and (tile := small_block_tile(n, k, block, scale_format, profile, layout)) is not None):
        per_sm = packed_m8_blocks_per_sm(profile, tile)
        used_registers = estimated_registers(tile, block)
    elif pinned_tile is None:
        tile, per_sm = select_tile(m, n, k, top_k, block, scale_format, profile, layout=layout)
        used_registers = estimated_registers(tile, block)
    else:
        tile, used_registers, per_sm = _check_pinned(
            m, n, k, top_k, block, scale_format, profile, pinned_tile, registers, layout
        )
    routes = m * top_k
    whole_tiles = block == 8 and per_sm == 1
    if direct and routes * tile_count(n, tile.tile_n) <= profile.sm_count:
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
        shared_memory_bytes=(wgmma_ws_layout(block, tile, WGMMA_WS_STAGES[block]).footprint if producer_warp
                             else wgmma_shared_memory_footprint(block, tile) if mainloop == "wgmma"
                             else shared_memory_footprint(block, tile, scale_format)),
        blocks_per_sm=per_sm,
        grid_x=grid_x,
        n_tiles=tile_count(n, tile.tile_n),
        k_tiles=tile_count(k, tile.tile_k),
        max_route_slots=slots,
        max_route_blocks=blocks,
        lock_slots=lock_slots(grid_x),
        splitk_scratch_floats=splitk_scratch_floats(grid_x, block, tile.tile_n),
        whole_tiles_m8=whole_tiles,
        mainloop=mainloop,
        producer_warp=producer_warp,
    )

def _coerce_scale_format(scale_format) -> ScaleFormat:
    try:
        return ScaleFormat(scale_format)
    except ValueError:
        allowed = ", ".join(f.value for f in ScaleFormat)
        raise BadInputError(f"scale_format must be one of {allowed}, got {scale_format!r}") from None

def _check_pinned(m, n, k, top_k, block, scale_format, profile, tile, registers,
                  layout: str = "packed") -> tuple[TileConfig, int, int]:
    """Validate a pinned tile with the automatic choice's fit check; its registers and blocks per SM."""
    if not isinstance(tile, TileConfig):
        raise BadInputError(f"pinned_tile must be a TileConfig, got {type(tile).__name__}")
    reason = tile_misfit(n, k, block, tile, scale_format, profile, layout)
    if reason is not None:
        raise BadInputError(
            f"pinned tile (tile_k={tile.tile_k}, tile_n={tile.tile_n}, threads={tile.threads}) "
            f"does not fit N={n}, K={k}, moe_block_size={block} on {profile.name}: {reason}"
        )
    used = estimated_registers(tile, block) if registers is None else registers
    return tile, used, blocks_per_sm(m, n, top_k, block, tile, scale_format, profile, used)


def plan_for(m: int, n: int, k: int, top_k: int, num_experts: int, profile, tall: bool | None = None,
             wide: bool | None = None, layout: str = "packed", promote: bool | None = None,
             producer: bool | None = None, tall_wide: bool | None = None) -> GemmPlan:
    """The launch plan for logical sizes n x k: planned on the zero-padded stored sizes."""
    n_stored, k_stored = stored_dims(n, k)
    return plan_gemm(m, n_stored, k_stored, top_k, num_experts, profile, scale_format="e4m3_k16", tall=tall,
                     wide=wide, layout=layout, promote=promote, producer=producer, tall_wide=tall_wide)


def gemm_spec_for(plan: GemmPlan, dtype: DType, n: int, k: int, top_k: int, *, a_per_route: bool,
                  mul_topk_weights: bool, epilogue: Epilogue | str, layout: str = "packed",
                  scale_format: str = "e4m3_k16", bias: bool = False, n_rotation: int | None = None,
                  split_global_scale: bool | None = None, scale_exponent: int | None = None, sum_topk: int = 0,
                  packing_block: int | None = None, **activation) -> GemmSpec:
    """The kernel specialization a plan selects for logical sizes n x k (shared with the enumeration).

    The plan must have been made for the stored sizes, `plan_for(m, n, k, ...)`.  `activation`:
    a gated epilogue's fast_math and swiglu_* (GemmSpec); `n_rotation`, `split_global_scale`,
    `scale_exponent`: the modelopt layout's (GemmSpec); `sum_topk`: FC2 adds route rows into token rows;
    `packing_block`: the taller route packing the GEMM reads (GemmSpec).
    """
    n_stored, k_stored = stored_dims(n, k)
    return GemmSpec(
        dtype=dtype,
        n=n_stored,
        k=k_stored,
        n_out=None if n == n_stored else n,
        k_in=None if k == k_stored else k,
        top_k=1 if a_per_route else top_k,
        tile_n=plan.tile.tile_n,
        tile_k=plan.tile.tile_k,
        moe_block_size=plan.moe_block_size,
        blocks_per_sm=plan.blocks_per_sm,
        mul_topk_weights=mul_topk_weights,
        routes=Routes.DIRECT if plan.direct_topk_routes else Routes.PACKED,
        whole_tiles_m8=plan.whole_tiles_m8,
        epilogue=Epilogue(epilogue),
        layout=layout,
        scale_format=scale_format,
        mainloop=Mainloop(plan.mainloop),
        producer_warp=True if plan.producer_warp else None,
        stages=WGMMA_WS_STAGES[plan.moe_block_size] if plan.producer_warp else STAGES,
        bias=bias,
        n_rotation=n_rotation,
        split_global_scale=split_global_scale,
        scale_exponent=scale_exponent,
        sum_topk=sum_topk,
        packing_block=packing_block,
        **activation,
    )
