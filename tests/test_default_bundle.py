"""CI builds one real model for one target: the default spec (Qwen3-30B-A3B) for the H200.

Every fused kernel the runtime can resolve for 1..16384 tokens is compiled, its PTX entry
checked against the declared signature (the build fails otherwise), and the manifest must
resolve every bucket of the MoE layer to kernels it contains, with launch facts the runtime
relies on (block = the kernel's threads, dynamic shared memory, no spills).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="the build needs CuTeDSL (cuteaot[codegen])")

from cuteaot.codegen.build import build
from cuteaot.runtime.devices import PROFILES
from cuteaot.runtime.fused_planning import plan_fused
from cuteaot.runtime.kernels.fused_spec import FusedSpec
from cuteaot.runtime.manifest import verify_bundle

pytestmark = pytest.mark.build
SPEC = Path(__file__).resolve().parents[1] / "specs" / "qwen3-30b-a3b.yaml"


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    build(SPEC, root, progress=False, targets=["h200"])
    return root / "qwen3-30b-a3b"


def test_default_bundle_resolves_every_bucket_on_h200(bundle_dir):
    manifest = verify_bundle(bundle_dir)
    assert [t["name"] for t in manifest["targets"]] == ["h200"]
    rows = manifest["resolution"]
    assert sorted(r["tokens"] for r in rows) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert all({"fused", "activation", "topk_sum"} <= set(r["kernels"]) for r in rows)


def test_fused_kernels_match_what_the_runtime_plans(bundle_dir):
    manifest = verify_bundle(bundle_dir)
    fused = {k["key"]: k for k in manifest["kernels"] if k["family"] == "w4a16_fused_moe"}
    for m in (1, 2, 8, 9, 64, 300, 5000, 16384):
        plan = plan_fused(m, 2048, 768, 128, 8, True, PROFILES["h200"])
        spec = FusedSpec.for_plan(plan, "bf16", 2048, 768, 128, 8, "silu")
        record = fused[spec.key().digest]
        assert record["block"] == [spec.threads, 1, 1]
        assert record["dynamic_smem_bytes"] == spec.shared_bytes
        assert record["min_blocks_per_sm"] == spec.blocks_per_sm
        assert record["stack_bytes"] == 0 and record["local_bytes"] == 0, "a shipped kernel spills"
        assert record["arch"] == "sm_90a"
