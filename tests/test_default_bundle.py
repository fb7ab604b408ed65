"""CI builds one real model for one target: the default spec (Qwen3-30B-A3B) for the H200.

Every fused kernel the runtime can resolve for 1..16384 tokens is compiled, its PTX entry
checked against the declared signature (the build fails otherwise), and the manifest must
resolve every token count of the MoE layer to kernels it contains, with launch facts the runtime
relies on (block = the kernel's threads, dynamic shared memory, no spills).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="the build needs CuTeDSL (cuteaot[codegen])")

from cuteaot.codegen.build import build
from cuteaot.codegen.kernels.w4a16.fused_planning import fused_spec_for, plan_layer, split_layer
from cuteaot.runtime.devices import PROFILES
from cuteaot.runtime.manifest import verify_bundle
from cuteaot.runtime.resolution import MOE_LAYER, MoeLayerFacts, ResolutionTable

pytestmark = pytest.mark.build
SPEC = Path(__file__).resolve().parents[1] / "specs" / "qwen3-30b-a3b.yaml"


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    build(SPEC, root, progress=False, targets=["h200"])
    return root / "qwen3-30b-a3b"


FACTS = MoeLayerFacts(dtype="bf16", hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8,
                      activation="silu")


def test_default_bundle_resolves_every_token_count_on_h200(bundle_dir):
    manifest = verify_bundle(bundle_dir)  # every kernel the table names is in the bundle
    assert [t["name"] for t in manifest["targets"]] == ["h200"]
    table = ResolutionTable.from_manifest(manifest, "h200")
    for deterministic in (False, True):
        entry = table.find(MOE_LAYER, dataclasses.replace(FACTS, deterministic=deterministic))
        assert entry.max_tokens == 16384 and entry.launch(1).m_min == 1
        assert [w.max_tokens for w in entry.workspaces] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                                             4096, 8192, 16384]
        assert entry.launch(1).direct != deterministic  # deterministic: no decode (atomic top-k sum) path


def test_kernels_match_what_the_planner_chose(bundle_dir):
    manifest = verify_bundle(bundle_dir)
    records = {k["key"]: k for k in manifest["kernels"]}
    entry = ResolutionTable.from_manifest(manifest, "h200").find(MOE_LAYER, FACTS)
    for m in (1, 2, 8, 9, 64, 300, 5000, 16384):
        launch = entry.launch(m)
        split = split_layer(m, FACTS, PROFILES["h200"])
        if split is not None:  # large M: FC1 and FC2 as two grouped-GEMM launches
            specs = {"fc1": split[0].spec, "fc2": split[1].spec}
            assert launch.grid("fc1") == split[0].plan.grid_x and launch.grid("fc2") == split[1].plan.grid_x
        else:
            plan = plan_layer(m, FACTS, PROFILES["h200"])
            specs = {"fused": fused_spec_for(plan, FACTS)}
            assert launch.grid_x == plan.grid_x
        assert {role: spec.key().digest for role, spec in specs.items()} == dict(launch.kernels)
        for spec in specs.values():
            record = records[spec.key().digest]
            assert record["block"] == [spec.threads, 1, 1]
            assert record["dynamic_smem_bytes"] == spec.shared_bytes
            assert record["min_blocks_per_sm"] == spec.blocks_per_sm
            assert record["stack_bytes"] == 0 and record["local_bytes"] == 0, "a shipped kernel spills"
            assert record["arch"] == "sm_90a"
    assert entry.launch(1).kernels.keys() == {"fused"} and entry.launch(16384).split
    fc1 = records[entry.launch(16384).kernels["fc1"]]  # the build compiled FC1's gated (silu) epilogue
    assert fc1["facts"]["epilogue"] == "silu" and fc1["facts"]["fast_math"] is True
    # ... on 256-row route blocks (two warpgroups, 256 threads) where measured faster (from M = 11586,
    # measured_blocks.json "wide"), on 128-row blocks below: on the 256-wide tile of two warpgroups where that
    # measured faster ("tallwide": 5017-12288), else one warpgroup
    for m, block, threads in ((16384, 256, 256), (11586, 256, 256), (11585, 128, 256), (5017, 128, 256),
                              (5016, 128, 128), (4096, 128, 128)):
        for role in ("fc1", "fc2"):
            record = records[entry.launch(m).kernels[role]]
            assert (record["facts"]["moe_block_size"], record["block"][0]) == (block, threads), (m, role)


def test_inspect_plans_lists_every_token_range_of_every_layer_variant(bundle_dir, capsys):
    """`cuteaot inspect --plans`: per resolution entry, rows that tile 1..max tokens, each naming its path; the
    deterministic variant never sums with atomics nor takes the decode regime or the micro kernel (atomic adds in no
    fixed order)."""
    from cuteaot.codegen.cli import PLANS_HEADING
    from cuteaot.codegen.cli import main as cli

    assert cli(["inspect", "--plans", str(bundle_dir)]) == 0
    text = capsys.readouterr().out.split(PLANS_HEADING)[1]
    blocks = [b for b in text.strip().split("\n\n") if b.strip()]
    manifest = verify_bundle(bundle_dir)
    assert len(blocks) == len(manifest["resolution"])
    for block in blocks:
        title, _, _, *rows = block.splitlines()
        assert title.startswith("qwen3-30b-a3b on h200 (sm_90a): H 2048 I 768, 128 experts top-8, bf16 silu"), title
        expected = 1
        for row in rows:
            tokens, plan = row.split(None, 1)
            first, _, last = tokens.partition("-")
            assert int(first) == expected, block
            expected = int(last or first) + 1
            assert plan.split()[0] in ("decode", "micro", "packed", "split"), row
            if title.endswith("deterministic"):
                assert plan.split()[0] not in ("decode", "micro") and "+sum" not in plan, row
        assert expected == 16385, block
    assert cli(["inspect", "--plans", "--problem", "mixtral", str(bundle_dir)]) == 1  # a problem it does not hold
    assert "no resolution entries for mixtral (the bundle's problems: qwen3-30b-a3b)" in capsys.readouterr().out
