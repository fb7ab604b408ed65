"""A real AOT build of specs/tiny.yaml (sm_90a + sm_120a) on a machine without a GPU."""

from __future__ import annotations

import json
import shutil
import time

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("cutlass", reason="the build needs CuTeDSL (cuteaot[codegen])")

from cuteaot.codegen.build import build, merge
from cuteaot.codegen.cli import main as cli
from cuteaot.runtime.errors import BundleNotFoundError, IntegrityError, SchemaMismatchError
from cuteaot.runtime.manifest import SCHEMA_PATH, read_manifest, verify_bundle
from tests.conftest import TINY_SPEC

pytestmark = pytest.mark.build


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    report = build(TINY_SPEC, root, progress=False)
    return root, report


def _comparable(manifest: dict) -> dict:
    m = json.loads(json.dumps(manifest))
    for k in m["kernels"]:
        k.pop("compile_seconds")
    return m


def test_manifest_matches_json_schema(built):
    root, report = built
    manifest = read_manifest(root / "tiny")
    jsonschema.validate(manifest, json.loads(SCHEMA_PATH.read_text()))
    assert {k["arch"] for k in manifest["kernels"]} == {"sm_90a", "sm_120a"}
    assert len(report.built) == 36 and report.reused == 0
    for k in manifest["kernels"]:
        cubin = (root / "tiny" / k["file"]).read_bytes()
        assert k["symbol"].encode() in cubin  # the symbol was read from the object, not guessed
        assert k["block"] == [256, 1, 1] and 0 < k["registers"] <= 64 and k["stack_bytes"] == 0
        # every production kernel starts with griddepcontrol.wait: the runtime launches it with PDL
        assert k["waits_for_prior_grids"] is True, k["family"]


def test_unchanged_rebuild_compiles_nothing(built):
    root, _ = built
    mtime = (root / "tiny" / "manifest.json").stat().st_mtime_ns
    start = time.perf_counter()
    again = build(TINY_SPEC, root, progress=False)
    assert again.built == [] and again.reused == 36 and again.unchanged
    assert time.perf_counter() - start < 5
    assert (root / "tiny" / "manifest.json").stat().st_mtime_ns == mtime
    assert "0 kernels built, 36 reused" in again.summary()


def test_shards_merge_to_the_full_build(built, tmp_path):
    root, _ = built
    shard_root = tmp_path / "shards"
    reports = [build(TINY_SPEC, shard_root, shard=(i, 2), progress=False) for i in range(2)]
    assert sum(len(r.built) for r in reports) == 36
    assert read_manifest(reports[0].bundle_dir)["shard"] == {"index": 0, "count": 2}
    merged = merge([r.bundle_dir for r in reports], tmp_path / "merged")
    full, joined = read_manifest(root / "tiny"), read_manifest(merged)
    assert _comparable(joined) == _comparable(full)
    for k in full["kernels"]:
        assert (merged / k["file"]).read_bytes() == (root / "tiny" / k["file"]).read_bytes()
    with pytest.raises(Exception, match="exactly once"):
        merge([reports[0].bundle_dir], tmp_path / "partial")


def test_flipped_byte_is_caught_by_verify_naming_the_file(built, tmp_path, capsys):
    root, _ = built
    copy = tmp_path / "tiny"
    shutil.copytree(root / "tiny", copy)
    verify_bundle(copy)
    victim = sorted((copy / "sm_120a").glob("*.cubin"))[3]
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=victim.name):
        verify_bundle(copy)
    assert cli(["verify", str(copy)]) == 1
    assert victim.name in capsys.readouterr().err


def test_schema_version_mismatch(built, tmp_path):
    root, _ = built
    copy = tmp_path / "tiny"
    shutil.copytree(root / "tiny", copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["schema_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SchemaMismatchError, match="schema_version is 99"):
        verify_bundle(copy)


def test_interrupted_staging_is_never_loaded(built, tmp_path):
    """A leftover staging directory (killed build) is not a bundle and is replaced next build."""
    root, _ = built
    out = tmp_path / "gen"
    shutil.copytree(root / ".cache", out / ".cache")
    stale = out / ".tiny.staging-12345"
    (stale / "sm_90a").mkdir(parents=True)
    with pytest.raises(BundleNotFoundError):
        read_manifest(out / "tiny")
    report = build(TINY_SPEC, out, progress=False)
    assert report.built == [] and verify_bundle(out / "tiny")


def test_cli_inspect_and_list(built, capsys):
    root, _ = built
    assert cli(["inspect", str(root / "tiny")]) == 0
    text = capsys.readouterr().out
    assert "sm_90a: 18 kernels" in text and "sm_120a: 18 kernels" in text and "regs" in text
    assert cli(["list", str(TINY_SPEC)]) == 0
    assert "18 specializations, 36 kernels" in capsys.readouterr().out


def _splice_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts" / "splice_kernels.py"
    spec = importlib.util.spec_from_file_location("splice_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_splice_recompiles_the_selected_kernels_into_a_copy(built, tmp_path):
    """benchmarks/scripts/splice_kernels.py: the selected kernels compiled again from these sources are the built
    ones byte for byte; the copy verifies, keeps the resolution table and is marked spliced (never up to date)."""
    root, _ = built
    splice = _splice_module()
    source = read_manifest(root / "tiny")
    out = tmp_path / "tiny"
    changes = splice.splice(root / "tiny", out, {"family": "moe_activation", "arch": "sm_90a"}, [], jobs=1)
    assert changes and all(old == new for _, old, new in changes)
    spliced = verify_bundle(out)
    assert spliced["resolution"] == source["resolution"]
    assert spliced["plan_fingerprint"].startswith("spliced") and spliced["source_fingerprint"].startswith("spliced")
    picked = splice.selected(source["kernels"], {"family": "moe_activation", "arch": "sm_90a"}, [])
    assert {k["key"] for k in picked} == {key for key, _, _ in changes}
    assert all(k["family"] == "moe_activation" and k["arch"] == "sm_90a" for k in picked)


def test_splice_patch_holds_the_manifest_and_the_changed_cubins_only(built, tmp_path):
    root, _ = built
    splice = _splice_module()
    source = read_manifest(root / "tiny")
    first, second = [k["key"] for k in source["kernels"] if k["arch"] == "sm_90a"][:2]

    def fake_compile(record):  # the first kernel "changes", the second compiles to what it was
        cubin = (root / "tiny" / record["file"]).read_bytes()
        return {"registers": 7}, cubin + b"\0" * (record["key"] == first)

    out, patch = tmp_path / "tiny", tmp_path / "patch"
    changes = splice.splice(root / "tiny", out, {"arch": "sm_90a"}, [first[:12], second[:12]], jobs=1, patch=patch,
                            compile_fn=fake_compile)
    assert sorted((key, old != new) for key, old, new in changes) == sorted([(first, True), (second, False)])
    spliced = verify_bundle(out)  # sha256 and sizes recorded for the new cubin
    assert {(k["key"], k["arch"]): k["registers"] for k in spliced["kernels"]}[first, "sm_90a"] == 7
    files = sorted(p.relative_to(patch).as_posix() for p in patch.rglob("*") if p.is_file())
    assert files == sorted(["manifest.json", next(k["file"] for k in source["kernels"]
                                                  if k["key"] == first and k["arch"] == "sm_90a")])
    rebuilt = tmp_path / "rebuilt"  # the GPU machine's way: the bundle, then the patch over it
    shutil.copytree(root / "tiny", rebuilt)
    for path in patch.rglob("*"):
        if path.is_file():
            target = rebuilt / path.relative_to(patch)
            target.unlink()
            shutil.copy(path, target)
    assert verify_bundle(rebuilt)["kernels"] == spliced["kernels"]
