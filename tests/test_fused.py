"""Fused MoE path on the CPU: planning per bucket, kernel specs, spec enumeration, the serving
layer's input validation (with a stand-in bundle: validation never touches a GPU) and the
custom op's fake implementation."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from cuteaot.codegen.enumerate import jobs
from cuteaot.codegen.kernels.w4a16.fused_planning import DECODE_MAX_M, fused_spec_for, plan_fused, plan_layer
from cuteaot.codegen.spec import load_spec
from cuteaot.codegen.table import plan_bundle
from cuteaot.runtime.devices import PROFILES
from cuteaot.runtime.errors import BadInputError, BundleError, SpecError
from cuteaot.runtime.kernels.w4a16.fused_spec import PACK_MAX_ROUTES, FusedSpec, RoutePackLayout
from cuteaot.runtime.kernels.route_pack import max_packed_route_slots
from cuteaot.runtime.kernels.w4a16.geometry import BARRIER_WORDS, TileConfig
import cuteaot.runtime.moe as moe_module
from cuteaot.runtime.moe import MoeLayer
from cuteaot.runtime.resolution import MOE_LAYER, MoeLayerFacts
from cuteaot.runtime.weights import prepare_w2, prepare_w13
from tests.reference.nvfp4 import quantize_nvfp4
from tests.stub_bundle import StubLaunch, stub_bundle

H200, GB10 = PROFILES["h200"], PROFILES["gb10"]
QWEN3_30B = (2048, 768, 128, 8)  # H, I, E, top_k
GPT_OSS = (2880, 2880, 128, 4)


def spec_of(plan, hidden, inter, experts, top_k, activation, **options) -> FusedSpec:
    """The fused kernel a plan selects for a bf16 layer of this shape and options."""
    facts = MoeLayerFacts(dtype="bf16", hidden_size=hidden, intermediate_size=inter, num_experts=experts,
                          top_k=top_k, activation=activation, **options)
    return fused_spec_for(plan, facts)


# ---- planning ------------------------------------------------------------------------------------


def test_decode_plan_qwen3_30b_single_token():
    p = plan_fused(1, *QWEN3_30B, True, H200)
    # 8 routes x 12 FC1 tiles = 96 whole-K tiles: one wave, one tile per CTA; FC2 widened to 256 columns
    assert p.decode and p.moe_block_size == 8
    assert p.fc1_tile == TileConfig(128, 128) and p.fc2_tile == TileConfig(64, 256)
    assert p.grid_x == 96 and p.max_route_slots == 64 and p.max_route_blocks == 8
    assert p.whole_tiles_m8 and spec_of(p, *QWEN3_30B[:4], "silu").fc2_gemm.whole_tiles_m8


def test_decode_plan_widens_fc1_when_it_saves_a_wave():
    p = plan_fused(2, *QWEN3_30B, True, H200)
    # 16 routes x 12 tiles = 192 > 132 SMs, 96 wide tiles fit one wave (the seed's wide-N override)
    assert p.fc1_tile == TileConfig(64, 256)
    # ... but FC2's 16 x 8 = 128 wide tiles would need a second wave of 96: K is split over the grid
    assert p.grid_x == p.max_grid_x == 264 and not p.whole_tiles_m8
    p4 = plan_fused(4, *QWEN3_30B, True, H200)  # past DECODE_MAX_M: route-packed
    assert not p4.decode and p4.moe_block_size == 8 and p4.fc1_tile == TileConfig(64, 128)


def test_decode_splits_k_over_the_grid_where_whole_tiles_need_a_second_wave():
    glm = (4096, 1408, 128, 8)
    p = plan_fused(1, *glm, True, H200)  # FC1 8 x 11 wide tiles, FC2 8 x 16: 128 > 88 would be two waves
    assert p.decode and p.grid_x == p.max_grid_x and not p.whole_tiles_m8
    spec = spec_of(p, *glm, "silu")
    assert not spec.fc1_gemm.whole_tiles_m8 and not spec.fc2_gemm.whole_tiles_m8
    gpt_oss = plan_fused(1, 2880, 2880, 128, 4, True, H200)  # 180 FC1 and 92 FC2 tiles on 180 CTAs: one wave
    assert gpt_oss.grid_x == 180 and gpt_oss.whole_tiles_m8


def test_onewave_decode_grid_covers_the_larger_gemm_in_whole_tiles():
    """The "onewave" knob: the grid is sized to the GEMM with more whole tiles, so FC2 keeps its
    narrower tile (Qwen3-30B) or is not split over the grid (GLM-4.5-Air); where either GEMM needs a
    second wave the plan is the rule's."""
    p = plan_fused(1, *QWEN3_30B, True, H200, onewave=True)
    # FC1 8 x 12 = 96 tiles, FC2 8 x 16 = 128 tiles of 128 columns: both fit one CTA per SM
    assert p.fc1_tile == TileConfig(128, 128) and p.fc2_tile == TileConfig(128, 128)
    assert p.grid_x == 128 and p.whole_tiles_m8
    glm = (4096, 1408, 128, 8)
    g = plan_fused(1, *glm, True, H200, onewave=True)  # 88 wide FC1 tiles, 128 wide FC2 tiles
    assert g.fc1_tile == g.fc2_tile == TileConfig(64, 256) and g.grid_x == 128 and g.whole_tiles_m8
    mixtral = (4096, 14336, 8, 2)  # 896 FC1 tiles at M = 2: never one wave
    assert plan_fused(2, *mixtral, True, H200, onewave=True) == plan_fused(2, *mixtral, True, H200)
    gpt_oss = plan_fused(1, *GPT_OSS, True, H200)  # already one wave sized to FC1 (180 >= 92)
    assert plan_fused(1, *GPT_OSS, True, H200, onewave=True) == gpt_oss


def test_splitk_decode_splits_one_wave_plans_over_every_co_resident_cta():
    """The "splitk" knob: a decode plan whose whole tiles fit one wave (the rule's whole-tile grid) splits K
    over the grid instead; plans the rule splits already, and packed plans, do not change."""
    gpt_oss = plan_fused(1, *GPT_OSS, True, H200)
    assert gpt_oss.whole_tiles_m8 and gpt_oss.grid_x == 180  # 180 FC1 tiles on 132 SMs
    split = plan_fused(1, *GPT_OSS, True, H200, splitk=True)
    assert split.decode and not split.whole_tiles_m8 and split.grid_x == split.max_grid_x == gpt_oss.max_grid_x
    assert (split.fc1_tile, split.fc2_tile, split.blocks_per_sm) == (gpt_oss.fc1_tile, gpt_oss.fc2_tile,
                                                                      gpt_oss.blocks_per_sm)
    spec = spec_of(split, *GPT_OSS, "swigluoai")
    assert not spec.fc1_gemm.whole_tiles_m8 and not spec.fc2_gemm.whole_tiles_m8
    assert split.c_tmp_floats >= gpt_oss.c_tmp_floats  # split-K scratch for the whole grid
    glm = (4096, 1408, 128, 8)  # the rule splits already
    assert plan_fused(1, *glm, True, H200, splitk=True) == plan_fused(1, *glm, True, H200)
    packed = plan_fused(64, *QWEN3_30B, True, H200)
    assert plan_fused(64, *QWEN3_30B, True, H200, splitk=True) == packed


def test_micro_plans_decode_launches_it_can_serve(monkeypatch):
    """The "micro" knob: a decode plan runs the barrier-free micro kernel with one CTA per work item (a route's
    FC1 tile) up to the co-resident grid; shapes or options it cannot serve keep the persistent kernel."""
    from cuteaot.codegen.kernels.w4a16 import planning

    def facts(hidden, inter, experts, top_k, activation="silu", **options):
        return MoeLayerFacts(dtype="bf16", hidden_size=hidden, intermediate_size=inter, num_experts=experts,
                             top_k=top_k, activation=activation, **options)

    qwen3 = facts(*QWEN3_30B)
    monkeypatch.setitem(planning.POLICY, "micro", "rule")
    rule = plan_layer(1, qwen3, H200)
    assert rule.decode and not rule.micro
    monkeypatch.setitem(planning.POLICY, "micro", "always")
    p = plan_layer(1, qwen3, H200)
    assert p.micro and p.grid_x == 8 * 12 and p.fc1_tile == rule.fc1_tile  # 8 routes x 12 FC1 tiles
    spec = fused_spec_for(p, qwen3)
    assert spec.micro and spec.micro_slice == 64 and spec.key() != fused_spec_for(rule, qwen3).key()
    assert p.blocks_per_sm == 1  # 96 items fit one an SM: the whole register file for the FC2 slice's loads
    gpt_oss = facts(*GPT_OSS, "swigluoai")
    p2 = plan_layer(2, gpt_oss, H200)  # 2 x 4 routes x 45 tiles = 360 items on the 264 co-resident CTAs
    assert p2.micro and p2.grid_x == p2.max_grid_x == 264 and p2.whole_tiles_m8 and p2.blocks_per_sm == 2
    glm = facts(4096, 1408, 128, 8)
    monkeypatch.setitem(planning.POLICY, "micro", "rule")
    assert plan_layer(1, glm, H200).fc1_tile == TileConfig(64, 256)  # the decode plan's wide tiles: 88 of them
    monkeypatch.setitem(planning.POLICY, "micro", "always")
    g = plan_layer(1, glm, H200)  # a work item per 128-column FC1 tile: 8 x 22 = 176
    assert g.micro and g.fc1_tile == TileConfig(128, 128) and g.grid_x == 176
    assert plan_layer(1, facts(*GPT_OSS, "swigluoai", bias=True), H200).micro  # gpt-oss's checkpoint biases
    # not served: packed routes, NF3, relu2 with I not a multiple of its 128-column slice
    assert not plan_layer(64, qwen3, H200).micro
    assert not plan_layer(1, facts(*QWEN3_30B, weights="nf3"), H200).micro
    assert not plan_layer(1, facts(2688, 1856, 128, 6, "relu2"), H200).micro
    assert plan_layer(1, facts(2688, 1792, 128, 6, "relu2"), H200).micro
    # weights read as stored take their own knob ("microstored", measured on them), not the packed one's
    stored = facts(*QWEN3_30B, weights="modelopt_w31")
    assert not plan_layer(1, stored, H200).micro
    monkeypatch.setitem(planning.POLICY, "microstored", "always")
    s = plan_layer(1, stored, H200)
    assert s.micro and s.grid_x == 8 * 12 and fused_spec_for(s, stored).micro
    monkeypatch.setitem(planning.POLICY, "micro", "rule")
    assert plan_layer(1, stored, H200).micro and not plan_layer(1, qwen3, H200).micro


def test_shipped_micro_table():
    """The measured "micro" table (H100, docs/benchmarks.md, thirty-third session): gpt-oss and Qwen3-30B at M = 1 and
    Qwen3-30B at M = 2 run the micro kernel, Mixtral and the tp4 shard at M = 1 keep the persistent decode kernel."""
    def plan(m, hidden, inter, experts, top_k, activation="silu"):
        return plan_layer(m, MoeLayerFacts(dtype="bf16", hidden_size=hidden, intermediate_size=inter,
                                           num_experts=experts, top_k=top_k, activation=activation), H200)

    assert plan(1, *GPT_OSS, "swigluoai").micro and plan(2, *QWEN3_30B).micro and plan(1, *QWEN3_30B).micro
    assert not plan(1, 4096, 14336, 8, 2).micro and not plan(1, 4096, 384, 128, 8).micro
    assert plan(1, 4096, 384, 128, 8).decode


def test_micro_spec_refuses_what_the_kernel_does_not_serve():
    base = dict(dtype="bf16", hidden_size=2048, intermediate_size=768, top_k=8, activation="silu", fc1_tile_n=128,
                fc1_tile_k=128, fc2_tile_n=256, fc2_tile_k=64, moe_block_size=8, blocks_per_sm=1, decode=True,
                gated_epilogue=True, micro=True)
    assert FusedSpec(**base).micro_slice == 64
    assert "micro" not in FusedSpec(**{**base, "micro": None}).key().facts  # older keys keep their digests
    assert FusedSpec(**{**base, "weights": "modelopt_w31", "scale_exponent": 15}).micro  # read as stored
    for change, why in (({"decode": False}, "decode"), ({"gated_epilogue": None}, "gated_epilogue"),
                        ({"weights": "nf3"}, "NVFP4 weights"),
                        ({"router_weight_on_input": True}, "router weight"),
                        ({"activation": "relu2", "gated_epilogue": None, "intermediate_size": 320}, "intermediate_size"),
                        ({"micro": False}, "None or True")):
        with pytest.raises(BadInputError, match=why):
            FusedSpec(**{**base, **change})


def test_micro_launches_reserve_their_output_sums_in_the_locks(monkeypatch):
    """The resolution table sizes `locks` for the micro kernel's counter and (M, H) float32 sums."""
    from cuteaot.codegen.kernels.w4a16 import planning
    from cuteaot.runtime.kernels.w4a16.fused_spec import MICRO_SUMS_WORD

    monkeypatch.setitem(planning.POLICY, "micro", "always")
    spec = load_spec("specs/bench-decode.yaml")
    entry = next(e for e in plan_bundle(spec).entries if e.facts.hidden_size == 2048)
    two = entry.launch(2)
    assert two.sizes["lock_words"] >= MICRO_SUMS_WORD + 2 * 2048
    assert entry.workspace(2).sizes["lock_words"] >= two.sizes["lock_words"]


def test_topk_sum_folds_into_packed_plans_only():
    """The "topksum" knob: a packed plan's FC2 adds the routes' rows into the output (the decode
    regime's red.add), so no top-k sum kernel runs; never where the order must be fixed
    (deterministic), nor with expert_map or calibration, nor in decode (which sums already)."""
    p = plan_fused(8, *QWEN3_30B, True, H200, topk_sum=True)
    assert not p.decode and p.mainloop == "mma_sync" and p.topk_sum
    spec = spec_of(p, *QWEN3_30B[:4], "silu")
    assert spec.topk_sum and spec.sums_topk and spec.fc2_gemm.sum_topk == 8 and spec.fc2_gemm.routes.value == "packed"
    assert spec.key() != spec_of(plan_fused(8, *QWEN3_30B, True, H200), *QWEN3_30B[:4], "silu").key()
    for options in (dict(deterministic=True), dict(expert_map=True), dict(collect_amax=True)):
        assert not plan_fused(8, *QWEN3_30B, True, H200, topk_sum=True, **options).topk_sum, options
    assert not plan_fused(1, *QWEN3_30B, True, H200, topk_sum=True).topk_sum  # decode sums already
    wide = plan_fused(4096, *QWEN3_30B, True, H200, topk_sum=True)
    assert wide.mainloop == "wgmma" and wide.topk_sum and spec_of(wide, *QWEN3_30B[:4], "silu").fc2_gemm.sum_topk == 8
    assert not plan_fused(4096, *QWEN3_30B, True, H200, topk_sum=True, deterministic=True).topk_sum
    decode = spec_of(plan_fused(1, *QWEN3_30B, True, H200), *QWEN3_30B[:4], "silu")
    with pytest.raises(BadInputError, match="topk_sum"):
        FusedSpec(**{**{f: getattr(decode, f) for f in FusedSpec.__dataclass_fields__}, "topk_sum": True})


def test_fusepack_keeps_the_fused_kernel_where_it_packs_its_routes(monkeypatch):
    """The "fusepack" knob: where the rule splits the layer into two GEMM launches, the fused kernel runs
    instead if it packs the routes itself (at most PACK_MAX_ROUTES of them); more routes still split."""
    from cuteaot.codegen.kernels.w4a16 import planning
    from cuteaot.codegen.kernels.w4a16.fused_planning import plan_layer, split_layer

    facts = MoeLayerFacts(dtype="bf16", hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8,
                          activation="silu")
    monkeypatch.setitem(planning.POLICY, "fusepack", "rule")
    assert split_layer(128, facts, H200) is not None and split_layer(129, facts, H200) is not None
    monkeypatch.setitem(planning.POLICY, "fusepack", "always")
    assert split_layer(128, facts, H200) is None  # 1024 routes
    fused = plan_layer(128, facts, H200)
    assert fused.pack_routes and fused.mainloop == "wgmma"
    assert split_layer(129, facts, H200) is not None  # 1032 routes: the fused kernel would need a packing launch
    assert split_layer(64, facts, H200) is None and plan_layer(64, facts, H200).mainloop == "mma_sync"  # as before


def test_split_layer_fc2_sums_the_topk_rows_where_the_knob_says(monkeypatch):
    from cuteaot.codegen.kernels.w4a16 import planning
    from cuteaot.codegen.kernels.w4a16.fused_planning import split_layer

    facts = MoeLayerFacts(dtype="bf16", hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8,
                          activation="silu")
    monkeypatch.setitem(planning.POLICY, "splitsum", "rule")
    assert split_layer(4096, facts, H200)[1].spec.sum_topk == 0
    monkeypatch.setitem(planning.POLICY, "splitsum", "always")
    fc1, fc2 = split_layer(4096, facts, H200)
    assert fc2.spec.sum_topk == 8 and fc2.spec.mainloop.value == "wgmma" and fc1.spec.sum_topk == 0
    exact = MoeLayerFacts(**{**facts.__dict__, "deterministic": True})
    assert split_layer(4096, exact, H200)[1].spec.sum_topk == 0


def test_decode_ends_at_decode_max_m_and_with_expert_map_or_calibration():
    assert plan_fused(DECODE_MAX_M, *QWEN3_30B, True, H200).decode
    assert not plan_fused(DECODE_MAX_M + 1, *QWEN3_30B, True, H200).decode
    assert not plan_fused(1, *QWEN3_30B, True, H200, expert_map=True).decode
    assert not plan_fused(1, *QWEN3_30B, True, H200, collect_amax=True).decode


def test_packed_plans_grow_the_route_block_with_m():
    blocks = [plan_fused(m, *QWEN3_30B, True, H200).moe_block_size for m in (16, 64, 256, 1024, 4096)]
    assert blocks == [8, 8, 32, 64, 128]  # 128-row blocks once the average expert fills them (wgmma)
    # no wgmma there, and 64-row mma.sync blocks of the fused kernel spill on Blackwell: 48 at most
    assert [plan_fused(m, *QWEN3_30B, True, GB10).moe_block_size for m in (1024, 4096)] == [48, 48]
    small = plan_fused(64, *QWEN3_30B, True, H200)  # packed 8-row blocks: 128-thread tiles, 4 CTAs/SM
    assert small.fc1_tile == small.fc2_tile == TileConfig(64, 128) and small.blocks_per_sm == 4
    assert small.grid_x == 528 and plan_fused(64, *QWEN3_30B, True, GB10).blocks_per_sm == 3
    big = plan_fused(4096, *QWEN3_30B, True, H200)
    assert big.fc1_tile == big.fc2_tile == TileConfig(64, 128)  # 128 threads both
    assert big.grid_x == big.max_grid_x == 132 * big.blocks_per_sm


def test_large_m_runs_both_phases_on_the_wgmma_loop_on_sm90_only():
    for m, block, tile_n in ((1024, 64, 256), (4096, 128, 128), (16384, 128, 128)):
        plan = plan_fused(m, *QWEN3_30B, True, H200)
        assert (plan.mainloop, plan.moe_block_size, plan.fc1_tile.tile_n) == ("wgmma", block, tile_n)
        spec = spec_of(plan, 2048, 768, 128, 8, "silu")
        assert spec.threads == 128 and spec.fc1_gemm.mainloop.value == spec.fc2_gemm.mainloop.value == "wgmma"
        assert spec.key().facts["mainloop"] == "wgmma"
    # 48-row blocks: the wgmma loop on the 128-wide tile, 3 CTAs an SM (132 registers); asked not to, mma.sync
    short = plan_fused(512, *QWEN3_30B, True, H200)
    assert (short.mainloop, short.moe_block_size, short.fc1_tile.tile_n, short.blocks_per_sm) == ("wgmma", 48, 128, 3)
    assert plan_fused(512, *QWEN3_30B, True, H200, short=False).mainloop == "mma_sync"
    assert plan_fused(4096, *QWEN3_30B, True, GB10).mainloop == "mma_sync"  # the wgmma loop is sm_90a-only


def test_gpt_oss_fc2_keeps_128_tiles_when_padded_hidden_is_not_256_wide():
    p = plan_fused(1, *GPT_OSS, True, H200)
    assert p.fc2_tile == TileConfig(128, 128)  # H = 2880 is stored as 2944, not a multiple of 256


def test_small_gpu_profile_plans_within_its_shared_memory():
    for m in (1, 8, 64, 4096):
        p = plan_fused(m, *QWEN3_30B, True, GB10)
        assert p.grid_x <= p.max_grid_x == 48 * p.blocks_per_sm
        spec = spec_of(p, 2048, 768, 128, 8, "silu")
        assert spec.shared_bytes <= GB10.max_shared_memory_per_block_optin


@pytest.mark.parametrize("profile", ["h200", "gb10"])
def test_table_workspaces_cover_every_launch_up_to_their_capacity(tmp_path, profile):
    spec = _spec(tmp_path, "{expert_map: [false, true]}", tokens="[1, 8, 64, 600]", targets=f"[{profile}]")
    for entry in plan_bundle(spec).entries:
        for ws in entry.workspaces:
            for launch in entry.launches:
                if launch.m_min <= ws.max_tokens and "fused" in launch.kernels:  # (not the two-GEMM launches)
                    m = min(launch.m_max, ws.max_tokens)
                    plan = plan_layer(m, entry.facts, PROFILES[profile])
                    assert plan.c_tmp_floats <= ws.sizes["c_tmp_floats"]
                    assert plan.lock_words <= ws.sizes["lock_words"]
                    assert plan.max_route_slots <= ws.sizes["route_slots"]
                    assert plan.max_route_blocks <= ws.sizes["route_blocks"]
    assert BARRIER_WORDS >= 2


# ---- kernel specs --------------------------------------------------------------------------------


def test_fused_spec_derives_both_gemms():
    spec = spec_of(plan_fused(1, *GPT_OSS, True, H200), 2880, 2880, 128, 4, "swigluoai")
    fc1, fc2 = spec.fc1_gemm, spec.fc2_gemm
    assert (fc1.n, fc1.k, fc1.n_out, fc1.k_in) == (5760, 2880, None, None)  # K: whole 64-k rows, no padding
    assert (fc2.n, fc2.k, fc2.n_out, fc2.k_in) == (2880, 2880, None, None)  # N: whole 64-column slabs
    assert fc1.k_tail and fc2.k_tail and fc1.k_tiles == fc2.k_tiles == 23  # 128-deep tiles, the last half past K
    assert fc2.n_tail and not fc1.n_tail and fc2.n_tiles == 23  # 128-wide tiles, the last half past N
    assert fc2.sum_topk == 4 and fc2.mul_topk_weights and not fc1.mul_topk_weights
    assert (spec.swiglu_alpha, spec.swiglu_beta, spec.swiglu_limit) == (1.702, 1.0, 7.0)
    assert FusedSpec.from_facts(spec.key().facts) == spec


def test_fused_spec_relu2_and_router_weight_on_input():
    plan = plan_fused(64, 2688, 1856, 128, 6, False, H200)
    spec = spec_of(plan, 2688, 1856, 128, 6, "relu2", router_weight_on_input=True)
    assert spec.fc1_gemm.epilogue.value == "relu2" and spec.fc1_gemm.mul_topk_weights
    assert not spec.fc2_gemm.mul_topk_weights and spec.fc2_gemm.sum_topk == 0


def test_fused_spec_rejects_impossible_combinations():
    plan = plan_fused(1, *QWEN3_30B, True, H200)
    spec = spec_of(plan, 2048, 768, 128, 8, "silu")
    facts = dict(spec.key().facts)
    with pytest.raises(BadInputError, match="decode"):
        FusedSpec.from_facts({**facts, "expert_map": True})
    with pytest.raises(BadInputError, match="same CTA size"):
        FusedSpec.from_facts({**facts, "fc2_tile_n": 128})
    with pytest.raises(BadInputError, match="amax_experts"):
        FusedSpec.from_facts({**facts, "decode": False, "collect_amax": True})


# ---- specs and enumeration -----------------------------------------------------------------------


def _spec(tmp_path, fused: str, tokens="[1, 8, 64]", targets="[h200]"):
    path = tmp_path / "s.yaml"
    path.write_text(
        f"bundle: t\ntargets: {targets}\nmoe:\n  - name: p\n    hidden_size: 512\n    intermediate_size: 256\n"
        f"    num_experts: 16\n    top_k: 4\n    activation: silu\n    dtype: bf16\n    tokens: {tokens}\n"
        f"    fused: {fused}\n"
    )
    return load_spec(path)


def test_spec_fused_true_builds_decode_and_packed_kernels(tmp_path):
    spec = _spec(tmp_path, "true")
    planned = plan_bundle(spec)
    keys = planned.keys["sm_90a"]
    decode = {k for k in keys if k.facts.get("decode")}
    assert decode and keys - decode
    families = {j.key.family for j in jobs(spec)}
    assert {"w4a16_fused_moe", "moe_route_pack", "moe_topk_sum"} <= families
    assert all(entry.op == MOE_LAYER for entry in planned.entries)
    plain = [e for e in planned.entries if not e.facts.deterministic]
    assert len(plain) == 1 and plain[0].launch(1).direct and not plain[0].launch(64).direct
    assert plain[0].max_tokens == 64 and [w.max_tokens for w in plain[0].workspaces] == [1, 8, 64]


def test_spec_fused_builds_the_masked_topk_sums_the_layer_launches(tmp_path):
    """MoeLayer's packed path sums with the ids (int32 or int64, as the caller passes them)."""
    from cuteaot.codegen.enumerate import kernel_keys
    from cuteaot.runtime.kernels.topk_sum import spec_for_call

    spec = _spec(tmp_path, "true")
    keys = set(kernel_keys(spec))
    fc2 = torch.empty(8, 4, 512, dtype=torch.bfloat16)  # (M, top_k, H) of the problem
    for ids_dtype in (torch.int32, torch.int64):
        assert spec_for_call(fc2, torch.empty(8, 4, dtype=ids_dtype)).key() in keys
        # the accumulating sums (a HybridMoeLayer's later parts) come with expert-map layers only
        assert spec_for_call(fc2, torch.empty(8, 4, dtype=ids_dtype), accumulate=True).key() not in keys
        mapped = set(kernel_keys(_spec(tmp_path, "{expert_map: [false, true]}")))
        assert spec_for_call(fc2, torch.empty(8, 4, dtype=ids_dtype), accumulate=True).key() in mapped


def test_spec_fused_variants_enumerate_the_cross_product(tmp_path):
    spec = _spec(tmp_path, "{router_weight_on_input: [false, true], expert_map: [false, true]}")
    assert len(spec.moe[0].fused) == 4
    variants = {(e.facts.router_weight_on_input, e.facts.expert_map, e.facts.deterministic)
                for e in plan_bundle(spec).entries}
    # every variant, and a deterministic twin of those without an expert map
    assert variants == {(False, False, False), (True, False, False), (False, True, False), (True, True, False),
                        (False, False, True), (True, False, True)}


def test_spec_fused_unknown_variant_is_an_error(tmp_path):
    with pytest.raises(SpecError, match="fused"):
        _spec(tmp_path, "{router_weights: [true]}")


# ---- serving-layer validation (stand-in bundle on the CPU) ---------------------------------------


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator().manual_seed(1)
    w13 = prepare_w13(*quantize_nvfp4(torch.randn(16, 512, 512, generator=g) * 0.05), "bf16")
    w2 = prepare_w2(*quantize_nvfp4(torch.randn(16, 512, 256, generator=g) * 0.05), "bf16")
    with pytest.MonkeyPatch.context() as patch:  # construction resolves kernels; these tests never launch
        patch.setattr(moe_module, "persistent_launch", StubLaunch)
        return MoeLayer(stub_bundle(), w13, w2, top_k=4, activation="silu", validate_ids=True)


def _inputs(m=4, top_k=4, e=16):
    x = torch.zeros(m, 512, dtype=torch.bfloat16)
    ids = torch.arange(m * top_k, dtype=torch.int32).view(m, top_k) % e
    return x, torch.full((m, top_k), 0.25), ids


def test_layer_takes_its_capacity_from_the_bundle(layer):
    assert layer.max_tokens == 4096 and layer.intermediate_size == 256 and layer.fc1_width == 512  # tiny-fused's


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x, w, i: (x.half(), w, i), "hidden_states must have dtype torch.bfloat16"),
        (lambda x, w, i: (x[:, :256], w, i), r"hidden_states must have shape \(4, 512\)"),
        (lambda x, w, i: (x.t().contiguous().t(), w, i), "contiguous"),
        (lambda x, w, i: (x, w.double(), i), "topk_weights must have dtype torch.float32"),
        (lambda x, w, i: (x, w, i.float()), "topk_ids must be int32 or int64"),
        (lambda x, w, i: (x, w[:, :2], i[:, :2]), "layer was built for top_k=4"),
        (lambda x, w, i: (x, w[:3], i), r"topk_ids must have shape \(4, 4\)|topk_weights must have shape"),
        (lambda x, w, i: (x, w, i.masked_fill(i == 3, 16)), r"topk_ids must be in \[-1, 16\)"),
        (lambda x, w, i: (x, w, i.masked_fill(i == 3, -2)), r"topk_ids must be in \[-1, 16\)"),
        (lambda x, w, i: (x.to("meta"), w, i), "must be on cpu"),
    ],
)
def test_layer_rejects_bad_inputs_before_launch(layer, change, message):
    x, w, ids = change(*_inputs())
    with pytest.raises(BadInputError, match=message):
        layer(x, w, ids)


def test_masked_routes_pass_the_host_check(layer, monkeypatch):
    """-1 is how serving engines mask a route (padded tokens): validate_ids keeps it on a layer without a map
    too (test_expert_map_layer_accepts_dropped_routes_but_not_below_minus_one: with one)."""
    x, w, ids = _inputs()
    assert layer._check(x, w, ids.masked_fill(ids == 3, -1), None, None, None) == 4  # the checks of a call


def test_a_max_tokens_above_the_bundles_largest_launch_serves_in_chunks_of_it(layer):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe_module, "persistent_launch", StubLaunch)
        big = MoeLayer(layer.bundle, layer.w13, layer.w2, top_k=4, max_tokens=8192)
        small = MoeLayer(layer.bundle, layer.w13, layer.w2, top_k=4, max_tokens=100)
    assert big.max_tokens == layer.max_tokens == 4096 and big.shape == layer.shape and small.max_tokens == 100
    for bad in (0, -1, 2.5, True):
        with pytest.raises(BadInputError, match="max_tokens must be a positive int"):
            MoeLayer(layer.bundle, layer.w13, layer.w2, top_k=4, max_tokens=bad)


def test_calibration_on_an_expert_parallel_layer_is_refused(layer, monkeypatch):
    """The calibration kernels index activation_amax by the global expert count (the map's length): with
    fewer local experts they would write past the table, so the call is refused before any launch."""
    monkeypatch.setattr(moe_module, "persistent_launch", StubLaunch)
    em = torch.full((16,), -1, dtype=torch.int32)
    em[:8] = torch.arange(8, dtype=torch.int32)
    half = lambda p: dataclasses.replace(p, qweight=p.qweight[:8], scales=p.scales[:8],  # noqa: E731
                                         global_scale=p.global_scale[:8], num_experts=8)
    ep = MoeLayer(layer.bundle, half(layer.w13), half(layer.w2), top_k=4, expert_map=em)
    x, w, ids = _inputs()
    with pytest.raises(BadInputError, match="index activation_amax by 16 experts .* the layer holds 8"):
        ep(x, w, ids, activation_amax=torch.zeros(2, 8, 2), layer_idx=1)
    with pytest.raises(BadInputError, match="expert_map is empty"):
        MoeLayer(layer.bundle, layer.w13, layer.w2, top_k=4, expert_map=torch.zeros(0, dtype=torch.int32))


def test_layer_rejects_bad_out_and_calibration_arguments(layer):
    x, w, ids = _inputs()
    with pytest.raises(BadInputError, match="out must have shape"):
        layer(x, w, ids, out=torch.empty(4, 256, dtype=torch.bfloat16))
    with pytest.raises(BadInputError, match="layer_idx is only used with activation_amax"):
        layer(x, w, ids, layer_idx=0)
    with pytest.raises(BadInputError, match="activation_amax must have shape"):
        layer(x, w, ids, activation_amax=torch.zeros(2, 8, 2), layer_idx=0)
    with pytest.raises(BadInputError, match="layer_idx must be an int in"):
        layer(x, w, ids, activation_amax=torch.zeros(2, 16, 2), layer_idx=2)


def test_layer_construction_checks_weights_and_options(layer):
    b = layer.bundle
    with pytest.raises(BadInputError, match="relu2 needs w13 = I x H and w2 = H x I"):
        MoeLayer(b, layer.w13, layer.w2, top_k=4, activation="relu2")
    with pytest.raises(BadInputError, match="activation must be one of"):
        MoeLayer(b, layer.w13, layer.w2, top_k=4, activation="gelu")
    with pytest.raises(BadInputError, match="top_k=17 exceeds"):
        MoeLayer(b, layer.w13, layer.w2, top_k=17)
    with pytest.raises(BadInputError, match="expert_map values"):
        MoeLayer(b, layer.w13, layer.w2, top_k=4, expert_map=torch.tensor([0, 16, -1], dtype=torch.int32))
    with pytest.raises(BadInputError, match="swiglu_limit"):
        MoeLayer(b, layer.w13, layer.w2, top_k=4, swiglu_limit=-1.0)


def test_expert_map_layer_accepts_dropped_routes_but_not_below_minus_one(layer, monkeypatch):
    em = torch.full((16,), -1, dtype=torch.int32)  # 16 global experts (the spec's), 8 of them here
    em[:8] = torch.arange(8, dtype=torch.int32)
    monkeypatch.setattr(moe_module, "persistent_launch", StubLaunch)
    ep = MoeLayer(layer.bundle, layer.w13, layer.w2, top_k=4, expert_map=em, validate_ids=True)
    x, w, ids = _inputs(e=16)
    with pytest.raises(BadInputError, match=r"topk_ids must be in \[-1, 16\)"):
        ep(x, w, ids.masked_fill(ids == 3, -2))


def test_packed_call_with_the_fused_topk_sum_launches_no_topk_sum_kernel(monkeypatch):
    """A table whose packed plans fold the top-k sum (knobs "topksum", "splitsum" forced on): the call
    packs the routes and launches the fused kernel (or, split, zeroes the output and launches both GEMMs) with
    the (M, H) output as FC2's target, and no top-k sum kernel after it; the same bundle planned by
    the rule keeps the top-k sum kernel."""
    import tests.stub_bundle as stubs
    from cuteaot.codegen.kernels.w4a16 import planning

    g = torch.Generator().manual_seed(3)
    w13 = prepare_w13(*quantize_nvfp4(torch.randn(16, 512, 512, generator=g) * 0.05), "bf16")
    w2 = prepare_w2(*quantize_nvfp4(torch.randn(16, 512, 256, generator=g) * 0.05), "bf16")
    seen = {}
    try:
        for policy in ("always", "rule"):
            monkeypatch.setitem(planning.POLICY, "topksum", policy)
            monkeypatch.setitem(planning.POLICY, "splitsum", policy)
            stubs._planned.cache_clear()  # the stub's table is planned under this policy
            calls = stubs.stub_launches(monkeypatch)
            layer = MoeLayer(stubs.stub_bundle(), w13, w2, top_k=4, activation="silu")
            for m in (5, 4096):  # the fused kernel; FC1 and FC2 as two GEMMs
                calls.clear()
                x, w, ids = _inputs(m=m)
                out = torch.empty(m, 512, dtype=torch.bfloat16)
                assert not layer.resolve(m).decode
                layer(x, w, ids, out=out)
                fc2 = [c[2] for c in calls if c[0] == "fused"][-1]
                target = fc2["fc2_out" if "fc2_out" in fc2 else "out"]
                seen[policy, m] = ([c[0] for c in calls], layer.resolve(m).sums_topk, target == out.data_ptr())
                if layer.resolve(m).sums_topk and layer.resolve(m).launch.split:  # zeroed before FC2 adds
                    assert calls[1] == ("zero", out.data_ptr(), m * 512 // 2)
    finally:
        stubs._planned.cache_clear()
    # M = 5: 20 routes, packed by the fused kernel itself (pack_experts)
    assert seen["always", 5] == (["fused"], True, True)
    assert seen["rule", 5] == (["fused", "topk_sum"], False, False)
    assert seen["always", 4096] == (["pack_routes", "zero", "fused", "fused"], True, True)
    assert seen["rule", 4096] == (["pack_routes", "fused", "fused", "topk_sum"], False, False)


def test_packed_plans_pack_their_routes_in_the_kernel():
    """Packed plans up to PACK_MAX_ROUTES routes pack them in the fused kernel (pack_experts = the routing's
    expert count), on either loop; decode, expert maps, calibration and more routes do not; the packing's
    tables follow the GEMM arena in shared memory and still fit the plan's CTAs per SM."""
    loops = set()
    for m in (8, 64, 115, 116, 128):  # Qwen3-30B takes the wgmma loop from 116 tokens
        p = plan_fused(m, *QWEN3_30B, True, H200)
        assert p.pack_routes and not p.decode
        loops.add(p.mainloop)
        spec = spec_of(p, *QWEN3_30B, "silu")
        lay = spec.pack_layout
        assert spec.pack_experts == 128 and lay == RoutePackLayout(-(-spec.gemm_shared_bytes // 16) * 16, 128,
                                                                   p.moe_block_size, spec.threads // 32)
        assert lay.capacity >= max_packed_route_slots(m * 8, p.moe_block_size, 128)
        assert lay.hist < lay.slots < lay.blocks < lay.count < lay.sums < lay.end == spec.shared_bytes
        assert spec.shared_bytes * p.blocks_per_sm <= H200.shared_memory_per_sm
        assert spec.key() != dataclasses.replace(spec, pack_experts=None).key()  # a key fact
    assert loops == {"mma_sync", "wgmma"}
    assert not plan_fused(1, *QWEN3_30B, True, H200).pack_routes  # decode reads topk_ids directly
    assert not plan_fused(64, *QWEN3_30B, True, H200, expert_map=True).pack_routes
    assert not plan_fused(64, *QWEN3_30B, True, H200, collect_amax=True).pack_routes
    assert not plan_fused(129, *QWEN3_30B, True, H200).pack_routes  # 1032 routes
    assert not plan_fused(PACK_MAX_ROUTES // 2 + 1, 2880, 2880, 128, 2, True, H200).pack_routes  # > 1024 routes
    with pytest.raises(BadInputError, match="pack_experts"):
        dataclasses.replace(spec_of(plan_fused(1, *QWEN3_30B, True, H200), *QWEN3_30B, "silu"), pack_experts=128)


def test_every_shipped_packing_plan_fits_shared_memory():
    """The shared-memory packing tables of every fused kernel of specs/moe-models.yaml leave the plan's CTAs
    per SM co-resident, on every target (the runtime would refuse the launch otherwise)."""
    from cuteaot.codegen.kernels.w4a16.fused_planning import plan_layer
    from cuteaot.codegen.kernels.w4a16.planning import _RESIDENT_SHARED_MEMORY_PER_BLOCK as RESIDENT

    spec, packing = load_spec("specs/moe-models.yaml"), 0
    for profile in spec.targets:
        for problem in spec.moe:
            for facts in problem.layer_facts():
                for m in range(1, min(problem.tokens[-1], PACK_MAX_ROUTES // facts.top_k) + 1):
                    plan = plan_layer(m, facts, profile)
                    if not plan.pack_routes:
                        continue
                    packing += 1
                    fused = fused_spec_for(plan, facts)
                    assert (fused.shared_bytes + RESIDENT) * fused.blocks_per_sm <= profile.shared_memory_per_sm, (profile.name, m)
                    assert fused.shared_bytes <= profile.max_shared_memory_per_block_optin, (profile.name, m)
    assert packing


def test_a_call_whose_kernel_packs_launches_no_route_packing(monkeypatch):
    """Where the fused kernel packs the routes, the call passes the (narrowed) topk_ids and launches no
    route-pack kernel; with PACK_IN_KERNEL off the same call packs first, as before."""
    import tests.stub_bundle as stubs
    from cuteaot.codegen.kernels.w4a16 import fused_planning

    g = torch.Generator().manual_seed(5)
    w13 = prepare_w13(*quantize_nvfp4(torch.randn(16, 512, 512, generator=g) * 0.05), "bf16")
    w2 = prepare_w2(*quantize_nvfp4(torch.randn(16, 512, 256, generator=g) * 0.05), "bf16")
    seen = {}
    try:
        for packs in (True, False):
            monkeypatch.setattr(fused_planning, "PACK_IN_KERNEL", packs)
            stubs._planned.cache_clear()
            calls = stubs.stub_launches(monkeypatch)
            layer = MoeLayer(stubs.stub_bundle(), w13, w2, top_k=4, activation="silu")
            for dtype in (torch.int32, torch.int64):
                calls.clear()
                x, w, ids = _inputs(m=5)  # (this problem's fused packed plans: 3-6 tokens)
                ids = ids.to(dtype)
                layer(x, w, ids, out=torch.empty(5, 512, dtype=torch.bfloat16))
                fused = [c[2] for c in calls if c[0] == "fused"][0]
                r = layer.resolve(5)
                narrowed = layer.workspace().ids32.data_ptr() if dtype is torch.int64 else ids.data_ptr()
                seen[packs, dtype] = ([c[0] for c in calls], r.packs_routes,
                                      fused["route_indices"] == narrowed, "+pack" in r.describe())
    finally:
        stubs._planned.cache_clear()
    summed = seen[True, torch.int32][0][1:]  # the top-k sum kernel, or nothing where FC2 sums (measured table)
    assert seen[True, torch.int32] == (["fused"] + summed, True, True, True)
    assert seen[True, torch.int64] == (["fused"] + summed, True, True, True)
    assert seen[False, torch.int32][:2] == (["pack_routes", "fused"] + summed, False)


def test_custom_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 512, dtype=torch.bfloat16)
        w, ids = torch.empty(5, 4), torch.empty(5, 4, dtype=torch.int32)
        torch.ops.cuteaot.moe_layer(x, w, ids, torch.empty(5, 512, dtype=torch.bfloat16), None, -1, "any")
        with pytest.raises(BadInputError, match="out must be"):
            torch.ops.cuteaot.moe_layer(x, w, ids, torch.empty(5, 256, dtype=torch.bfloat16), None, -1, "any")


def test_persistent_kernel_that_is_not_co_resident_is_refused(monkeypatch):
    """The occupancy API says 1 CTA/SM fits, the plan needs 4: refuse before any launch."""
    from cuda.bindings import driver

    from cuteaot.runtime.errors import LaunchError
    from cuteaot.runtime.kernels.w4a16 import gemm

    plan = plan_fused(64, *QWEN3_30B, True, H200)
    spec = spec_of(plan, 2048, 768, 128, 8, "silu")
    def loaded(key, block=(spec.threads, 1, 1), smem=spec.shared_bytes):
        record = types.SimpleNamespace(registers=168, dynamic_smem_bytes=smem, key=key, block=block)
        found = types.SimpleNamespace(function=object(), block=block, bind=lambda sig: None, record=record,
                                      waits_on_grid=False)
        found.mark_waits_on_grid = lambda: setattr(found, "waits_on_grid", True)
        return found

    kernel = loaded(spec.key())
    bundle = types.SimpleNamespace(kernel_by_digest=lambda digest: kernel, profile=H200)
    monkeypatch.setattr(gemm.driver, "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                        lambda fn, threads, smem: (driver.CUresult.CUDA_SUCCESS, 1))
    with pytest.raises(LaunchError, match="only 1 CTAs per SM fit on h200.*needs 4.*deadlock"):
        gemm.PersistentLaunch(bundle, spec.key().digest)
    # the record must be the kernel this runtime would launch: same key version, block and shared memory
    older = dataclasses.replace(spec.key(), version=spec.key().version + 1)
    for kernel in (loaded(older), loaded(spec.key(), block=(32, 1, 1)), loaded(spec.key(), smem=0)):
        with pytest.raises(BundleError, match="built by another version of cuteaot"):
            gemm.PersistentLaunch(bundle, spec.key().digest)
    kernel = loaded(dataclasses.replace(spec.key(), family="w4a16_next"))
    with pytest.raises(BundleError, match="family 'w4a16_next' is unknown to this runtime"):
        gemm.PersistentLaunch(bundle, spec.key().digest)
    monkeypatch.setattr(gemm.driver, "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                        lambda fn, threads, smem: (driver.CUresult.CUDA_SUCCESS, 4))
    kernel = loaded(spec.key())
    launch = gemm.PersistentLaunch(bundle, spec.key().digest)
    assert kernel.waits_on_grid is True and launch.capacity == 4 * H200.sm_count
    launch.check_grid(4 * H200.sm_count)
    for grid in (0, 4 * H200.sm_count + 1):
        with pytest.raises(BundleError, match=f"with {grid} CTAs; {4 * H200.sm_count} fit"):
            launch.check_grid(grid)


def test_measured_ctas_per_sm_of_16_and_32_row_blocks_apply_where_measured():
    """sm_90a runs 4 CTAs/SM for 16-row and 3 for 32-row packed mma.sync blocks (measured faster, no spills;
    where those blocks take the wgmma loop, by default, that loop's registers decide); sm_100a keeps the
    estimate (the same launch bound spills there); sm_12x is bounded by shared memory."""
    assert plan_fused(256, *QWEN3_30B, True, H200, short=False).blocks_per_sm == 3  # 32-row blocks
    assert plan_fused(256, *QWEN3_30B, True, PROFILES["b200"]).blocks_per_sm == 2
    assert plan_fused(256, *QWEN3_30B, True, GB10).blocks_per_sm == 2
    sixteen = plan_fused(256, 2880, 2880, 128, 4, True, H200, short=False)  # gpt-oss: 1024 routes, 16-row blocks
    assert (sixteen.moe_block_size, sixteen.blocks_per_sm) == (16, 4)


def test_tiny_relu2_problem_reaches_the_masked_tiles():
    """specs/tiny-fused.yaml's relu2 problem (H = 576, I = 320: both 64 mod 128, stored unpadded), which the
    GPU tests run: decode masks both GEMMs' last N tile and 128-deep k-tile, the wgmma plan the last N tile."""
    shape = (576, 320, 8, 3)
    decode = spec_of(plan_fused(1, *shape, False, H200), *shape, "relu2")
    for gemm in (decode.fc1_gemm, decode.fc2_gemm):
        assert gemm.n_tail and gemm.k_tail and (gemm.n_out, gemm.k_in) == (None, None)
    large = spec_of(plan_fused(1000, *shape, False, H200), *shape, "relu2")
    assert large.mainloop.value == "wgmma"
    assert large.fc1_gemm.n_tail and large.fc2_gemm.n_tail and not large.fc2_gemm.k_tail


def test_layer_refuses_a_bundle_that_stores_other_sizes(monkeypatch):
    """Weights packed by this runtime (K = 576 stored unpadded) against kernels that read them padded to 640,
    as a bundle of the runtime before 2026-12-02 (sizes padded to multiples of 128) would: refused when the
    layer is built, not misread at the first call."""
    import tests.stub_bundle as stubs
    import cuteaot.runtime.weights as weights_module
    from cuteaot.runtime.errors import BundleError

    g = torch.Generator().manual_seed(4)
    w13 = prepare_w13(*quantize_nvfp4(torch.randn(8, 320, 576, generator=g) * 0.05), "bf16")
    w2 = prepare_w2(*quantize_nvfp4(torch.randn(8, 576, 320, generator=g) * 0.05), "bf16")
    stubs.stub_launches(monkeypatch)
    bundle = stubs.stub_bundle()  # tiny-fused-relu2: H = 576, I = 320
    assert MoeLayer(bundle, w13, w2, top_k=3, activation="relu2").w13.k_stored == 576
    monkeypatch.setattr(weights_module, "STORED_K_MULTIPLE", 128)  # the weights now claim K stored as 640
    with pytest.raises(BundleError, match=r"reads w13 stored as N=320 x K=576, but this runtime stores them as "
                                          r"320 x 640 .* rebuild it"):
        MoeLayer(bundle, w13, w2, top_k=3, activation="relu2")
