"""The measured route-block table: how benchmarks/tune_blocks.py turns timings into ranges, how the
layer planner reads them (codegen/kernels/w4a16/planning.py MEASURED_BLOCKS), and the shipped file."""

from __future__ import annotations

import json

import pytest

from benchmarks.tune_blocks import decide, record
from cuteaot.codegen.kernels.w4a16 import planning
from cuteaot.codegen.kernels.w4a16.fused_planning import plan_layer, split_layer
from cuteaot.runtime import PROFILES
from cuteaot.runtime.resolution import MoeLayerFacts
from cuteaot.runtime.types import Activation, DType

H200 = PROFILES["h200"]
QWEN3 = MoeLayerFacts(dtype=DType.BF16, hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8,
                      activation=Activation.SILU)


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A scratch MEASURED_BLOCKS the planner reads (the cache is cleared around the test)."""
    path = tmp_path / "measured_blocks.json"
    path.write_text(json.dumps({"about": "test", "measured": {}, "tall": {}}))
    monkeypatch.setattr(planning, "MEASURED_BLOCKS", path)
    planning._measured_tall.cache_clear()
    yield path
    planning._measured_tall.cache_clear()


def _write(path, profile, ranges, measured=(256, 4096), facts=QWEN3):
    path.write_text(json.dumps({"about": "test", "measured": {}, "tall": {profile: [{
        "hidden_size": facts.hidden_size, "intermediate_size": facts.intermediate_size,
        "num_experts": facts.num_experts, "top_k": facts.top_k, "gated": facts.gated,
        "measured_m": list(measured), "tall_m": ranges}]}}))
    planning._measured_tall.cache_clear()


def test_decide_splits_at_geometric_midpoints_and_merges_neighbours():
    # 512 and 1024 win, 2048 does not win by the margin, 4096 has the same plan both ways
    points = [(512, 0.95, True), (1024, 0.90, True), (2048, 0.99, True), (4096, 0.80, False)]
    measured, tall = decide(points, margin=0.02)
    assert measured == (512, 4096)
    # midpoints: isqrt(512 * 1024) = 724, isqrt(1024 * 2048) = 1448
    assert tall == [[512, 1448]]
    assert decide([(256, 1.0, True), (512, 0.9, True), (1024, 1.1, True), (2048, 0.9, True)], 0.02)[1] == \
        [[363, 724], [1449, 2048]]
    assert decide([(300, 0.97, True)], margin=0.05)[1] == []
    # a win next to points where the rule plans 128-row blocks itself: one range through them
    assert decide([(1024, 1.1, True), (1536, 0.9, True), (2048, 1.0, False), (3072, 1.0, False)], 0.02)[1] == \
        [[1255, 3072]]
    # same-plan points alone make no range
    assert decide([(1024, 1.1, True), (2048, 1.0, False)], 0.02)[1] == []


def test_planner_takes_tall_blocks_where_the_table_says_and_the_rule_elsewhere(table):
    _write(table, "h200", [[400, 700]], measured=(256, 1024))
    assert planning.measured_tall(512, 2048, 768, 128, 8, True, H200) is True
    # elsewhere the rule decides: where the 128-row plan lost, and where the rule's plan is that plan
    assert planning.measured_tall(800, 2048, 768, 128, 8, True, H200) is None
    assert planning.measured_tall(200, 2048, 768, 128, 8, True, H200) is None
    assert planning.measured_tall(4096, 2048, 768, 128, 8, True, H200) is None
    assert planning.measured_tall(512, 2048, 768, 128, 8, False, H200) is None  # another shape
    assert planning.measured_tall(512, 2048, 768, 128, 8, True, PROFILES["h100"]) is None  # another profile
    # the layer plan: M = 512 by the rule is the fused kernel on 48-row blocks; measured, the wgmma split
    split = split_layer(512, QWEN3, H200)
    assert split is not None and split[0].plan.moe_block_size == split[1].plan.moe_block_size == 128
    assert split_layer(800, QWEN3, H200)[0].plan.moe_block_size == 64  # outside the tall range: the rule's block
    assert split_layer(4096, QWEN3, H200)[0].plan.moe_block_size == 128  # the rule's own 128-row blocks


def test_policies_rule_and_always(table, monkeypatch):
    _write(table, "h200", [[400, 700]], measured=(256, 1024))
    monkeypatch.setattr(planning, "TALL_POLICY", "rule")
    assert planning.measured_tall(512, 2048, 768, 128, 8, True, H200) is None
    assert split_layer(512, QWEN3, H200) is None
    monkeypatch.setattr(planning, "TALL_POLICY", "always")
    assert planning.measured_tall(300, 2048, 768, 128, 8, True, PROFILES["b200"]) is True
    # 128-row blocks only where the wgmma loop runs: Blackwell keeps its blocks
    assert plan_layer(1024, QWEN3, PROFILES["b200"]).moe_block_size == 48


def test_record_replaces_the_shapes_entry(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"about": "test", "measured": {}, "tall": {"h200": [
        {"hidden_size": 2048, "intermediate_size": 768, "num_experts": 128, "top_k": 8, "gated": True,
         "measured_m": [1, 2], "tall_m": [[1, 2]]}]}}))
    facts = {"hidden_size": 2048, "intermediate_size": 768, "num_experts": 128, "top_k": 8, "activation": "silu"}
    rows = [{"model": "q", "M": m, "facts": facts, "profile": "h200", "base_plan": "a",
             "new": {"always": {"ratio": r, "plan": "b"}}} for m, r in ((512, 0.9), (1024, 1.05))]
    rows_path = tmp_path / "rows.json"
    rows_path.write_text(json.dumps({"date": "2026-12-01", "gpu": "H200", "commit": "abc", "rows": rows}))
    out = record([str(rows_path)], 0.02, table=path)
    (entry,) = out["tall"]["h200"]
    assert entry["measured_m"] == [512, 1024] and entry["tall_m"] == [[512, 724]]
    assert out["measured"]["h200"]["runs"][0]["commit"] == "abc"


def test_shipped_table_is_well_formed():
    data = json.loads(planning.MEASURED_BLOCKS.read_text())
    for profile, entries in data["tall"].items():
        assert profile in PROFILES and profile in data["measured"]
        for e in entries:
            lo, hi = e["measured_m"]
            ranges = e["tall_m"]
            assert all(lo <= a <= b <= hi for a, b in ranges), e
            assert all(b < c for (_, b), (c, _) in zip(ranges, ranges[1:])), e  # sorted, disjoint
