"""The measured planner choices: how benchmarks/tune_blocks.py turns timings into ranges, how the
layer planner reads them (codegen/kernels/w4a16/planning.py MEASURED_BLOCKS), and the shipped file."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.tune_blocks import KNOBS, decide, record
from cuteaot.codegen.kernels.w4a16 import planning
from cuteaot.codegen.kernels.w4a16.fused_planning import DECODE_MAX_M, DECODE_MEASURED_MAX_M, plan_layer, split_layer
from cuteaot.runtime import PROFILES
from cuteaot.runtime.resolution import MoeLayerFacts
from cuteaot.runtime.types import Activation, DType

H200 = PROFILES["h200"]
QWEN3 = MoeLayerFacts(dtype=DType.BF16, hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8,
                      activation=Activation.SILU)
SHAPE = (2048, 768, 128, 8, True)  # QWEN3 as measured_choice's shape arguments


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A scratch MEASURED_BLOCKS the planner reads (the cache is cleared around the test)."""
    path = tmp_path / "measured_blocks.json"
    path.write_text(json.dumps({"about": "test", "measured": {}}))
    monkeypatch.setattr(planning, "MEASURED_BLOCKS", path)
    planning.reload_measured()
    yield path
    planning.reload_measured()


def _rows(path, **knobs):
    """Write h200 tables {knob: [(shape, measured (lo, hi), won ranges), ...]}."""
    path.write_text(json.dumps({"about": "test", "measured": {}, **{knob: {"h200": [
        {"hidden_size": h, "intermediate_size": i, "num_experts": e, "top_k": k, "gated": g,
         "measured_m": list(measured), "won_m": [list(r) for r in won]}
        for (h, i, e, k, g), measured, won in rows]} for knob, rows in knobs.items()}}))
    planning.reload_measured()


def _write(path, knob, ranges, facts=QWEN3):
    """One knob's h200 table for one shape: won at `ranges`, measured from the first to the last."""
    shape = (facts.hidden_size, facts.intermediate_size, facts.num_experts, facts.top_k, facts.gated)
    _rows(path, **{knob: [(shape, (ranges[0][0], ranges[-1][1]) if ranges else (1, 1), ranges)]})


def test_the_tool_and_the_planner_know_the_same_knobs():
    assert KNOBS == planning.MEASURED_KNOBS == tuple(planning.POLICY)


def test_decide_splits_at_geometric_midpoints_and_merges_neighbours():
    # 512 and 1024 win, 2048 does not win by the margin, 4096 has the same plan both ways
    points = [(512, 0.95, True), (1024, 0.90, True), (2048, 0.99, True), (4096, 0.80, False)]
    measured, won = decide(points, margin=0.02)
    assert measured == (512, 4096)
    # midpoints: isqrt(512 * 1024) = 724, isqrt(1024 * 2048) = 1448
    assert won == [[512, 1448]]
    assert decide([(256, 1.0, True), (512, 0.9, True), (1024, 1.1, True), (2048, 0.9, True)], 0.02)[1] == \
        [[363, 724], [1449, 2048]]
    assert decide([(300, 0.97, True)], margin=0.05)[1] == []
    # a win next to points where the rule already makes the choice: one range through them
    assert decide([(1024, 1.1, True), (1536, 0.9, True), (2048, 1.0, False), (3072, 1.0, False)], 0.02)[1] == \
        [[1255, 3072]]
    # same-plan points alone make no range
    assert decide([(1024, 1.1, True), (2048, 1.0, False)], 0.02)[1] == []
    # runs of one M count once: the geometric mean of the compared ratios (a same-plan run ignored)
    assert decide([(512, 0.90, True), (512, 1.10, True), (1024, 1.0, True)], 0.02)[1] == []
    assert decide([(512, 0.95, True), (512, 1.00, False), (1024, 1.1, True)], 0.02)[1] == [[512, 724]]


def test_planner_takes_tall_blocks_where_the_table_says_and_the_rule_elsewhere(table):
    _write(table, "tall", [[400, 700]])
    assert planning.measured_choice("tall", 512, *SHAPE, H200) is True
    # elsewhere the rule decides: where the 128-row plan lost, and where the rule's plan is that plan
    for m in (200, 800, 4096):
        assert planning.measured_choice("tall", m, *SHAPE, H200) is None
    assert planning.measured_choice("tall", 512, 7168, 256, 256, 8, False, H200) is None  # a shape too far to borrow
    assert planning.measured_choice("tall", 512, *SHAPE, PROFILES["b200"]) is None  # another profile
    assert planning.measured_choice("tall", 512, *SHAPE, PROFILES["h100"]) is True  # the H200's: the same SMs
    assert planning.measured_choice("decode", 512, *SHAPE, H200) is None  # another knob
    # the layer plan: M = 512 by the rule is the fused kernel on 48-row blocks; measured, the wgmma split
    split = split_layer(512, QWEN3, H200)
    assert split is not None and split[0].plan.moe_block_size == split[1].plan.moe_block_size == 128
    assert split_layer(800, QWEN3, H200)[0].plan.moe_block_size == 64  # outside the range: the rule's block
    assert split_layer(2048, QWEN3, H200)[0].plan.moe_block_size == 128  # the rule's own 128-row blocks


def test_planner_extends_the_decode_regime_where_the_table_says(table):
    _write(table, "decode", [[3, 5]])
    for m in range(1, 9):
        plan = plan_layer(m, QWEN3, H200)
        assert plan.decode == (m <= DECODE_MAX_M or 3 <= m <= 5), m
        assert split_layer(m, QWEN3, H200) is None
    assert plan_layer(4, QWEN3, H200).moe_block_size == 8
    # the decode regime's own limits still hold: no expert map, no calibration, not deterministic
    from dataclasses import replace
    for changed in (dict(expert_map=True), dict(calibration=True), dict(deterministic=True)):
        assert not plan_layer(4, replace(QWEN3, **changed), H200).decode


OLMOE = (2048, 1024, 64, 8, True)  # unmeasured: 0.98 from QWEN3 (intermediate x 4/3, half the experts)


def test_an_unmeasured_shape_borrows_the_nearest_table_at_the_same_routes_per_expert(table):
    far = (2880, 2880, 32, 4, True)  # 3.0 from OLMOE
    _rows(table, tall=[(SHAPE, (48, 3072), [(400, 700)]), (far, (48, 3072), [(48, 3072)])])
    assert planning.shape_distance(OLMOE, SHAPE) == pytest.approx(math.log(4 / 3) + math.log(2))
    # OLMoE's 8 routes of 64 experts a token: m tokens fill blocks as 2m tokens of QWEN3 do
    assert planning.measured_choice("tall", 256, *OLMOE, H200) is True  # QWEN3 at 512: won
    assert planning.measured_choice("tall", 150, *OLMOE, H200) is None  # QWEN3 at 300: the rule
    assert planning.measured_choice("tall", 2000, *OLMOE, H200) is None  # QWEN3 at 4000: never measured
    # past BORROW_RADIUS nothing is borrowed, even where the nearest shape always won
    assert planning.shape_distance((1024, 256, 512, 1, False), far) > planning.BORROW_RADIUS
    assert planning.measured_choice("tall", 64, 1024, 256, 512, 1, False, H200) is None
    # the layer plan follows: 128-row blocks on both GEMMs at 256 tokens, the rule's blocks at 150
    facts = MoeLayerFacts(dtype=DType.BF16, hidden_size=2048, intermediate_size=1024, num_experts=64, top_k=8,
                          activation=Activation.SILU)
    assert split_layer(256, facts, H200)[0].plan.moe_block_size == 128
    assert split_layer(150, facts, H200) is None or split_layer(150, facts, H200)[0].plan.moe_block_size < 128


def test_borrowing_is_only_for_shapes_no_table_holds(table, monkeypatch):
    _rows(table, tall=[(SHAPE, (48, 3072), [(400, 700)])], decode=[(OLMOE, (3, 8), [])],
          fusepack=[(SHAPE, (8, 512), [(8, 512)])])
    # OLMOE is in the decode table: a shape some table holds keeps the rule wherever its own tables are silent
    assert planning.measured_choice("tall", 256, *OLMOE, H200) is None
    other = (2048, 1024, 64, 6, True)  # known to no table, 0.29 from OLMOE and 1.27 from QWEN3
    assert planning.measured_choice("tall", 342, *other, H200) is True  # QWEN3 at 342 * 6 / 64 * 16 = 513
    assert planning.measured_choice("fusepack", 100, *other, H200) is None  # never borrowed (NOT_BORROWED)
    assert planning.measured_choice("tall", 342, *other, PROFILES["b200"]) is None  # no b200 table to borrow
    assert planning.measured_choice("tall", 342, *other, PROFILES["h100"]) is True  # the H200's, borrowed
    # what the build's planning line says of each
    assert planning.tables_of(*OLMOE, H200) == "measured tables"
    assert planning.tables_of(*other, H200) == ("tables borrowed from H 2048 I 1024 E 64 top-8 (0.29 away), "
                                                "H 2048 I 768 E 128 top-8 (1.27 away)")  # decode's, tall's
    assert planning.tables_of(7168, 256, 256, 8, False, H200).startswith("no measured shape within 2.0")
    assert planning.tables_of(*other, PROFILES["b200"]) == "nothing measured on b200: the rule alone"
    assert planning.tables_of(*OLMOE, PROFILES["h100"]) == "measured tables, h200's (the same SMs)"
    assert planning.tables_of(*other, PROFILES["h100"]).endswith("(1.27 away), h200's (the same SMs)")
    monkeypatch.setattr(planning, "BORROW", False)
    assert planning.measured_choice("tall", 342, *other, H200) is None


def test_the_shipped_tables_lend_to_unseen_models():
    """With the shipped MEASURED_BLOCKS, an unseen 64-expert model takes the choices its neighbour won."""
    planning.reload_measured()
    olmoe = MoeLayerFacts(dtype=DType.BF16, hidden_size=2048, intermediate_size=1024, num_experts=64, top_k=8,
                          activation=Activation.SILU)
    borrowed = [k for k in planning.MEASURED_KNOBS for m in (1, 2, 3, 4, 8, 64, 512, 1024, 4096, 8192)
                if planning.measured_choice(k, m, 2048, 1024, 64, 8, True, H200)]
    assert {"tall", "wide", "splitsum"} <= set(borrowed)
    assert not {"fusepack", "promote"} & set(borrowed)
    assert plan_layer(1, olmoe, H200).decode


def test_policies_rule_and_always(table, monkeypatch):
    _write(table, "tall", [[400, 700]])
    monkeypatch.setitem(planning.POLICY, "tall", "rule")
    assert planning.measured_choice("tall", 512, *SHAPE, H200) is None
    assert split_layer(512, QWEN3, H200)[0].plan.moe_block_size == 48  # the rule's short wgmma blocks
    monkeypatch.setitem(planning.POLICY, "tall", "always")
    assert planning.measured_choice("tall", 300, *SHAPE, PROFILES["b200"]) is True
    # 128-row blocks only where the wgmma loop runs: Blackwell keeps its blocks
    assert plan_layer(1024, QWEN3, PROFILES["b200"]).moe_block_size == 48
    # "always" decode: up to DECODE_MEASURED_MAX_M, never past it
    monkeypatch.setitem(planning.POLICY, "decode", "always")
    assert plan_layer(DECODE_MEASURED_MAX_M, QWEN3, H200).decode
    assert not plan_layer(DECODE_MEASURED_MAX_M + 1, QWEN3, H200).decode


def test_record_replaces_the_shapes_entry(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"about": "test", "measured": {}, "tall": {"h200": [
        {"hidden_size": 2048, "intermediate_size": 768, "num_experts": 128, "top_k": 8, "gated": True,
         "measured_m": [1, 2], "won_m": [[1, 2]]}]}}))
    facts = {"hidden_size": 2048, "intermediate_size": 768, "num_experts": 128, "top_k": 8, "activation": "silu"}
    rows = [{"model": "q", "M": m, "facts": facts, "profile": "h200", "knob": knob, "base_plan": "a",
             "new": {"always": {"ratio": r, "plan": "b"}}}
            for knob, m, r in (("tall", 512, 0.9), ("tall", 1024, 1.05), ("decode", 3, 0.9), ("decode", 4, 1.1))]
    rows_path = tmp_path / "rows.json"
    rows_path.write_text(json.dumps({"date": "2026-12-01", "gpu": "H200", "commit": "abc", "rows": rows}))
    out = record([str(rows_path)], 0.02, table=path)
    assert json.loads(path.read_text()) == out
    (entry,) = out["tall"]["h200"]
    assert entry["measured_m"] == [512, 1024] and entry["won_m"] == [[512, 724]]
    assert out["decode"]["h200"][0]["won_m"] == [[3, 3]]
    assert out["measured"]["tall"]["h200"]["runs"][0]["commit"] == "abc"


def test_shipped_table_is_well_formed():
    data = json.loads(planning.MEASURED_BLOCKS.read_text())
    for knob in planning.MEASURED_KNOBS:
        for profile, entries in data.get(knob, {}).items():
            assert profile in PROFILES and profile in data["measured"][knob]
            for e in entries:
                lo, hi = e["measured_m"]
                ranges = e["won_m"]
                assert all(lo <= a <= b <= hi for a, b in ranges), e
                assert all(b < c for (_, b), (c, _) in zip(ranges, ranges[1:])), e  # sorted, disjoint
                if knob == "decode":
                    assert all(b <= DECODE_MEASURED_MAX_M for _, b in ranges), e


GLM = MoeLayerFacts(dtype=DType.BF16, hidden_size=4096, intermediate_size=1408, num_experts=128, top_k=8,
                    activation=Activation.SILU)
MIXTRAL = MoeLayerFacts(dtype=DType.BF16, hidden_size=4096, intermediate_size=14336, num_experts=8, top_k=2,
                        activation=Activation.SILU)


def test_wide_blocks_by_the_k_rule_and_where_measured(table):
    def block(m, facts):
        fc1, fc2 = split_layer(m, facts, H200)
        assert fc1.plan.moe_block_size == fc2.plan.moe_block_size  # one packing serves both GEMMs
        assert fc1.spec.threads == fc2.spec.threads == (256 if fc1.plan.moe_block_size == 256 else 128)
        return fc1.plan.moe_block_size

    # no table: 256-row blocks from WGMMA_WIDE_MIN_ROUTES (160) routes per expert where both K reach
    # WGMMA_WIDE_MIN_K (GLM-4.5-Air: 4096 and 1408), not for Qwen3-30B (FC2's K = 768)
    assert [block(m, GLM) for m in (2559, 2560, 16384)] == [128, 256, 256]
    assert [block(m, QWEN3) for m in (4096, 16384)] == [128, 128]
    # measured: where the table says so, whatever K
    _write(table, "wide", [[11586, 16384]])
    assert [block(m, QWEN3) for m in (4096, 11585, 11586, 16384)] == [128, 128, 256, 256]
    # ... never below 160 routes per expert, and only where the wgmma loop runs
    _write(table, "wide", [[2048, 16384]])
    assert block(2559, QWEN3) == 128
    assert plan_layer(16384, QWEN3, PROFILES["b200"]).moe_block_size != 256


def test_fc1_alone_on_wide_blocks_where_only_fc2_k_forbids_them(table):
    """Qwen3-30B (FC2 K = 768): from 160 to below 256 routes per expert FC1 packs 256-row blocks and FC2
    reads that packing as 128-row blocks (GemmSpec.packing_block); elsewhere both share one block size."""
    def blocks(m, facts=QWEN3):
        fc1, fc2 = split_layer(m, facts, H200)
        return fc1.plan.moe_block_size, fc2.plan.moe_block_size, fc2.spec.packing_block, fc1.spec.packing_block

    assert blocks(2559) == (128, 128, None, None)
    assert blocks(2560) == blocks(4095) == (256, 128, 256, None)  # 160 .. 255.9 routes per expert
    assert blocks(4096) == (128, 128, None, None)  # exactly 256: FC1 alone measured 1.159x on 256-row blocks
    fc1, fc2 = split_layer(3072, QWEN3, H200)
    assert (fc1.spec.threads, fc2.spec.threads) == (256, 128) and fc2.spec.key() != split_layer(2048, QWEN3, H200)[1].spec.key()
    # both K >= 1024 (GLM-4.5-Air): one block size for both, nothing mixed
    assert blocks(2560, GLM) == (256, 256, None, None)
    # where the measured "wide" table gives both GEMMs 256-row blocks, it decides; elsewhere the rule above
    _write(table, "wide", [[3000, 16384]])
    assert blocks(3000) == (256, 256, None, None) and blocks(2560) == (256, 128, 256, None)


def test_narrow_blocks_where_measured_override_the_rule_and_the_wide_table(table, monkeypatch):
    """"narrow": 128-row blocks for both GEMMs where its table says so, over the K rule (GLM-4.5-Air), over a
    "wide" table, and over the mixed packing (Qwen3-30B: FC1 alone on 256 rows)."""
    def blocks(m, facts):
        fc1, fc2 = split_layer(m, facts, H200)
        return fc1.plan.moe_block_size, fc2.plan.moe_block_size, fc2.spec.packing_block

    assert [blocks(m, GLM) for m in (3072, 4096)] == [(256, 256, None)] * 2
    _write(table, "narrow", [[3800, 5000]], facts=GLM)
    assert [blocks(m, GLM) for m in (3072, 3800, 4096, 5000, 5001)] == [
        (256, 256, None), (128, 128, None), (128, 128, None), (128, 128, None), (256, 256, None)]
    _rows(table, wide=[(SHAPE, (11586, 16384), [[11586, 16384]])], narrow=[(SHAPE, (2560, 16384), [[12000, 16384]])])
    assert blocks(11586, QWEN3) == (256, 256, None) and blocks(12000, QWEN3) == (128, 128, None)
    _write(table, "narrow", [[3000, 3500]])
    assert blocks(2999, QWEN3) == (256, 128, 256) and blocks(3000, QWEN3) == (128, 128, None)
    # the policies tune_blocks builds with: "always" takes 128 rows wherever the rule takes 256
    monkeypatch.setitem(planning.POLICY, "narrow", "always")
    assert blocks(2999, QWEN3) == (128, 128, None) and blocks(16384, GLM) == (128, 128, None)


def test_the_shipped_wide_entries():
    # measured on the H200 (docs/results/tune-wide-2026-12-01.json): Qwen3-30B only from 11586 tokens
    qwen3 = split_layer(16384, QWEN3, H200)
    assert qwen3[0].plan.moe_block_size == 256 and split_layer(8192, QWEN3, H200)[0].plan.moe_block_size == 128


def test_the_shipped_narrow_entries():
    """Measured (docs/results/tune-narrow-2026-12-05-*.json): GLM-4.5-Air takes 128-row blocks where its experts
    average just over 256 routes (M = 4096: 0.955x), and keeps 256-row ones below (M = 3072: 128-row 1.10x);
    Mixtral-8x7B, where 128-row blocks lost at every M, keeps the rule's 256-row blocks."""
    assert [split_layer(m, GLM, H200)[0].plan.moe_block_size for m in (3072, 4096, 16384)] == [256, 128, 256]
    assert {split_layer(m, MIXTRAL, H200)[0].plan.moe_block_size for m in (1024, 4096, 16384)} == {256}


def test_the_shipped_tall_entries_below_256_tokens():
    """128-row blocks had won against the 16- to 48-row mma.sync plans at some mid M (Mixtral-8x7B at
    M = 79-175, docs/results/tune-tall-mid-2026-12-02.json); against the same blocks on the wgmma loop they
    take 1.17-1.31x the time (docs/results/tall-vs-short-rule-2026-12-02.json), so those ranges are gone and
    every shape keeps the rule's blocks there.  Mixtral takes 128-row blocks from 248 tokens (at 224 and
    240 its 64-row split plan stays faster)."""
    for m, tall in ((64, False), (79, False), (128, False), (175, False), (176, False), (247, False), (248, True)):
        split = split_layer(m, MIXTRAL, H200)
        assert (split is not None and split[0].plan.moe_block_size == 128) == tall, m
    for m in (64, 128, 192):  # (8-row fused plans at 64; 16- and 32-row wgmma GEMMs from 128)
        for facts in (QWEN3, GLM):
            split = split_layer(m, facts, H200)
            assert split is None or split[0].plan.moe_block_size < 128, m


def test_promote_gives_16_row_wgmma_blocks_where_the_rule_packs_8(table, monkeypatch):
    """The "promote" knob: where it won, a layer whose rule packs 8-row mma.sync blocks runs 16-row wgmma
    GEMMs instead (sm_90a, packed NVFP4 only); elsewhere, and outside its range, the rule's plan."""
    import dataclasses

    _write(table, "promote", [[10, 40]])
    assert split_layer(8, QWEN3, H200) is None  # outside the range: the fused 8-row plan (or decode)
    promoted = split_layer(16, QWEN3, H200)
    assert promoted is not None
    assert {(p.plan.moe_block_size, p.plan.mainloop, p.plan.tile.tile_n) for p in promoted} == {(16, "wgmma", 128)}
    # where the rule's block is not 8, nothing changes
    assert split_layer(128, QWEN3, H200)[0].plan.moe_block_size == 16
    # the fused kernel (expert maps) promotes too; NF3 and the stored layout keep 8-row mma.sync blocks
    mapped = plan_layer(16, dataclasses.replace(QWEN3, expert_map=True), H200)
    assert (mapped.moe_block_size, mapped.mainloop) == (16, "wgmma")
    for weights in ("nf3", "modelopt"):
        plan = plan_layer(16, dataclasses.replace(QWEN3, weights=weights), H200)
        assert (plan.moe_block_size, plan.mainloop) == (8, "mma_sync"), weights
        assert split_layer(16, dataclasses.replace(QWEN3, weights=weights), H200) is None
    # no wgmma on Blackwell, nor with the short blocks off: the rule's plan
    assert split_layer(16, QWEN3, PROFILES["b200"]) is None
    assert planning.plan_gemm(16, 1536, 2048, 8, 128, H200, scale_format="e4m3_k16", promote=True,
                              short=False).moe_block_size == 8
    assert plan_layer(16, dataclasses.replace(QWEN3, expert_map=True), H200).moe_block_size == 16
    from cuteaot.codegen.kernels.w4a16.fused_planning import plan_fused
    assert plan_fused(16, 2048, 768, 128, 8, True, H200, promote=True, short=False).moe_block_size == 8
    monkeypatch.setitem(planning.POLICY, "promote", "rule")
    assert split_layer(16, QWEN3, H200) is None


def test_the_rule_promotes_where_a_layer_has_few_experts(table):
    """With no table (an empty one here), 16-row wgmma blocks replace 8-row mma.sync ones on layers of at most
    PROMOTE_MAX_EXPERTS experts (Llama-4-Scout, Phi-3.5-MoE, Mixtral: 16, 16, 8), never on more."""
    import dataclasses

    scout = MoeLayerFacts(dtype=DType.BF16, hidden_size=5120, intermediate_size=8192, num_experts=16, top_k=1,
                          activation=Activation.SILU)
    for m in (8, 32, 64):
        split = split_layer(m, scout, H200)
        assert split is not None and {p.plan.moe_block_size for p in split} == {16}, m
        assert {p.plan.mainloop for p in split} == {"wgmma"}
    assert plan_layer(4, dataclasses.replace(scout, top_k=2), H200).moe_block_size == 16  # the fused kernel too
    wider = dataclasses.replace(scout, num_experts=planning.PROMOTE_MAX_EXPERTS * 2)
    assert split_layer(8, wider, H200) is None and plan_layer(8, wider, H200).moe_block_size == 8
    assert split_layer(8, scout, PROFILES["b200"]) is None  # no wgmma there: the rule's 8-row plan


def test_the_rule_takes_tall_blocks_from_fewer_routes_where_tiles_are_many(table):
    """With no table, 128-row blocks from WGMMA_TALL_SPREAD_MIN_ROUTES routes per expert where one block an
    expert still leaves every GEMM 4 x 132 128-wide tiles (Qwen3-Next-80B: 512 experts x 8), not where it
    would leave one wave (Granite-3.0-1B: 32 x 8); from WGMMA_TALL_MIN_ROUTES everywhere."""
    assert planning.WGMMA_TALL_SPREAD_MIN_ROUTES < planning.WGMMA_TALL_MIN_ROUTES
    next80 = MoeLayerFacts(dtype=DType.BF16, hidden_size=2048, intermediate_size=512, num_experts=512, top_k=10,
                           activation=Activation.SILU)
    granite = MoeLayerFacts(dtype=DType.BF16, hidden_size=1024, intermediate_size=512, num_experts=32, top_k=8,
                            activation=Activation.SILU)

    def block(facts, routes_per_expert):
        m = -(-routes_per_expert * facts.num_experts // facts.top_k)
        split = split_layer(m, facts, H200)
        assert split is not None and split[0].plan.moe_block_size == split[1].plan.moe_block_size
        return split[0].plan.moe_block_size

    spread = planning.WGMMA_TALL_SPREAD_MIN_ROUTES
    assert block(next80, spread - 1) == 64 and block(next80, spread) == 128
    assert block(granite, spread) == 64 and block(granite, planning.WGMMA_TALL_MIN_ROUTES) == 128


def test_the_shipped_promote_entries():
    """docs/results/tune-promote-2026-12-02.json: 16-row wgmma blocks won on Mixtral-8x7B at M = 7-24 (0.70-0.92x)
    and on the narrow Qwen3-235B shards (tp8 at 12-64, tp4 at 7-12), lost 2-7 % on the wide 128-expert shapes."""
    tp8 = MoeLayerFacts(dtype=DType.BF16, hidden_size=4096, intermediate_size=192, num_experts=128, top_k=8,
                        activation=Activation.SILU)
    for facts, m in ((MIXTRAL, 8), (MIXTRAL, 24), (tp8, 16), (tp8, 48)):
        split = split_layer(m, facts, H200)
        assert split is not None and split[0].plan.moe_block_size == 16, (facts.intermediate_size, m)
    for m in (16, 32, 64):
        assert split_layer(m, QWEN3, H200) is None, m  # the 8-row fused plans stay


def test_holdout_plans_each_shape_from_the_others_tables(tmp_path):
    """`tune_blocks holdout`: leave a shape out, borrow from the rest, read off the recorded ratios."""
    from benchmarks.tune_blocks import holdout

    def row(shape, m, ratio):
        h, i, e, k, _ = shape
        return {"model": f"{h}-{i}-{e}", "M": m, "base_plan": "rule", "profile": "h200", "knob": "tall",
                "facts": {"hidden_size": h, "intermediate_size": i, "num_experts": e, "top_k": k, "activation": "silu"},
                "new": {"always": {"ratio": ratio, "plan": "tall"}}}

    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"rows": [row(SHAPE, 512, 0.9), row(SHAPE, 1024, 1.1),
                                         row(OLMOE, 256, 0.8), row(OLMOE, 512, 1.2)]}))
    path = tmp_path / "measured_blocks.json"
    path.write_text(json.dumps({"about": "test", "measured": {"tall": {"h200": {"runs": [{"rows": str(rows)}]}}}}))
    result = holdout(0.02, table=path)["tall/h200"]
    # QWEN3 left out: OLMOE's table (won at 256-362) says tall at 512 (OLMOE's 256: 0.9), not at 1024;
    # OLMOE left out: QWEN3's (won at 512-724) says tall at 256 (QWEN3's 512: 0.8), not at 512
    assert result["points"] == 4 and (result["faster"], result["slower"]) == (2, 0)
    assert result["borrowed"] == pytest.approx((0.9 * 0.8) ** 0.25)
    assert result["own_table"] == pytest.approx((0.9 * 0.8) ** 0.25)


def test_the_h100_plans_with_the_h200_tables():
    """No table was measured on an H100; it has the H200's SMs, so the shipped H200 tables plan for it (timed on
    an H100 against the rule alone: 33 of 35 points where the plans differ faster, docs/benchmarks.md
    2026-12-05), and a profile with other SMs keeps the rule."""
    h100, b200 = PROFILES["h100"], PROFILES["b200"]
    assert planning.tables_profile(h100) == "h200" and planning.tables_profile(H200) == "h200"
    assert planning.tables_profile(b200) == "b200"
    for m in (1, 2, 4, 8, 64, 256, 1024, 2048, 4096, 16384):
        assert plan_layer(m, QWEN3, h100) == plan_layer(m, QWEN3, H200), m
        assert split_layer(m, QWEN3, h100) == split_layer(m, QWEN3, H200), m
    assert any(plan_layer(m, QWEN3, h100) != plan_layer(m, QWEN3, b200) for m in (1, 2, 8, 64))
