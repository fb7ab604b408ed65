"""A manifest cannot make the runtime open a file outside its bundle (issue 17, item 2).

Every hostile record below carries the sha256 and size of the file it points to, so only the
path rule stops it; the rule is checked before anything is opened.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib

import pytest

from cuteaot.runtime import load_bundle
from cuteaot.runtime.errors import IntegrityError, SchemaMismatchError
from cuteaot.runtime.manifest import SCHEMA_PATH, kernel_records, read_cubin, read_manifest, verify_bundle
from tests.handmade_bundle import read, write_bundle, write_manifest

SECRET = b"not a cubin: a file outside the bundle" * 4


@pytest.fixture
def bundle(tmp_path):
    return write_bundle(tmp_path / "bundle")


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "outside" / "secret.cubin"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


@pytest.fixture
def opened(monkeypatch):
    """Every file Path.read_bytes opens, resolved (to show the refused file is never opened)."""
    seen: list[pathlib.Path] = []
    original = pathlib.Path.read_bytes

    def spy(self):
        seen.append(self.resolve())
        return original(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", spy)
    return seen


def _point(bundle, index: int, file: str, data: bytes, **fields) -> None:
    """Make kernels[index] name `file`, with the sha256 and size of `data` (what the file holds)."""
    m = read(bundle)
    m["kernels"][index].update(file=file, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), **fields)
    write_manifest(bundle, m)


@pytest.mark.parametrize("how", ["absolute", "dotdot-after-arch", "dotdot"])
def test_paths_out_of_the_bundle_are_refused_before_opening(bundle, secret, opened, how):
    file = {
        "absolute": str(secret),
        "dotdot-after-arch": "sm_90a/../../outside/secret.cubin",
        "dotdot": "../outside/secret.cubin",
    }[how]
    _point(bundle, 0, file, SECRET)
    with pytest.raises(SchemaMismatchError, match=r"file must be 'sm_100a/[0-9a-f]{64}\.cubin'"):
        verify_bundle(bundle)
    assert secret.resolve() not in opened


def test_file_must_be_named_after_its_own_key(bundle):
    m = read(bundle)
    other = m["kernels"][1]  # same arch, a real cubin of the bundle
    _point(bundle, 0, other["file"], (bundle / other["file"]).read_bytes())
    with pytest.raises(SchemaMismatchError, match="file must be"):
        read_manifest(bundle)


def test_file_must_lie_in_the_folder_of_its_arch(bundle):
    # the same key is built for every arch: point the sm_100a record at the sm_90a cubin
    k = read(bundle)["kernels"][0]
    assert k["arch"] == "sm_100a"
    wrong = f"sm_90a/{k['key']}.cubin"
    _point(bundle, 0, wrong, (bundle / wrong).read_bytes())
    with pytest.raises(SchemaMismatchError, match="file must be 'sm_100a/"):
        verify_bundle(bundle)


def test_arch_cannot_smuggle_a_parent_folder(bundle, opened):
    # file == f"{arch}/{key}.cubin" holds for arch "..": the arch itself must be an arch name
    k = read(bundle)["kernels"][0]
    escaped = bundle.parent / f"{k['key']}.cubin"
    escaped.write_bytes(SECRET)
    _point(bundle, 0, f"../{k['key']}.cubin", SECRET, arch="..")
    with pytest.raises(SchemaMismatchError, match="arch must look like 'sm_90a', got '..'"):
        verify_bundle(bundle)
    assert escaped.resolve() not in opened


def test_symlinked_cubin_pointing_out_is_refused(bundle, tmp_path, opened):
    k = read(bundle)["kernels"][0]
    cubin = bundle / k["file"]
    outside = tmp_path / "copy.cubin"
    outside.write_bytes(cubin.read_bytes())  # identical bytes: the checksum would pass
    cubin.unlink()
    cubin.symlink_to(outside)
    opened.clear()
    with pytest.raises(IntegrityError, match="outside the bundle"):
        verify_bundle(bundle)
    assert outside.resolve() not in opened


def test_symlinked_arch_folder_pointing_out_is_refused(bundle, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.replace(bundle / "sm_120a", tmp_path / "elsewhere" / "sm_120a")
    (bundle / "sm_120a").symlink_to(tmp_path / "elsewhere" / "sm_120a")
    with pytest.raises(IntegrityError, match=r"sm_120a/[0-9a-f]{64}\.cubin: resolves to .*outside the bundle"):
        verify_bundle(bundle)


def test_links_inside_the_bundle_and_a_linked_bundle_are_fine(bundle, tmp_path):
    k = read(bundle)["kernels"][0]
    cubin = bundle / k["file"]
    os.replace(cubin, bundle / "store.cubin")
    cubin.symlink_to(bundle / "store.cubin")
    link = tmp_path / "linked-bundle"
    link.symlink_to(bundle)
    assert len(verify_bundle(bundle)["kernels"]) == 6
    assert len(verify_bundle(link)["kernels"]) == 6


def test_read_cubin_checks_a_record_built_by_hand(bundle, secret, opened):
    # kernel_records() output is public: read_cubin re-checks the path, not only read_manifest
    record = kernel_records(read_manifest(bundle))[0]
    hostile = dataclasses.replace(record, file="../outside/secret.cubin", sha256=hashlib.sha256(SECRET).hexdigest(),
                                  bytes=len(SECRET))
    with pytest.raises(SchemaMismatchError, match="file must be"):
        read_cubin(bundle, hostile)
    assert secret.resolve() not in opened
    assert read_cubin(bundle, record) == (bundle / record.file).read_bytes()


def test_load_bundle_refuses_the_manifest_before_looking_for_a_gpu(bundle, secret):
    _point(bundle, 0, "../outside/secret.cubin", SECRET)
    with pytest.raises(SchemaMismatchError, match="file must be"):
        load_bundle(bundle)


def test_merge_refuses_a_shard_whose_file_points_out(bundle, secret, tmp_path):
    pytest.importorskip("yaml", reason="merge lives in the codegen package (cuteaot[codegen])")
    from cuteaot.codegen.build import merge

    m = read(bundle)
    m["shard"] = {"index": 0, "count": 1}
    write_manifest(bundle, m)
    _point(bundle, 0, "../outside/secret.cubin", SECRET)
    with pytest.raises(SchemaMismatchError, match="file must be"):
        merge([bundle], tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_the_schema_and_the_runtime_agree(bundle):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA_PATH.read_text())
    m = read(bundle)
    jsonschema.validate(m, schema)  # the hand-made bundle is a well-formed one
    m["kernels"][0]["file"] = "sm_90a/../../x.cubin"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(m, schema)


def test_a_bundle_is_loaded_only_whole_as_planned_for_the_live_profile():
    """check_serves (load_bundle, before any cubin is loaded): a shard, a bundle planned for other device facts,
    and a table naming a kernel the bundle lacks are refused."""
    import copy

    from cuteaot.runtime.devices import PROFILES
    from cuteaot.runtime.manifest import check_serves

    h200 = PROFILES["h200"]
    manifest = {"bundle": "b", "shard": None, "targets": [
        {"name": "h200", "arch": "sm_90a", "sm_count": h200.sm_count,
         "max_shared_memory_per_block_optin": h200.max_shared_memory_per_block_optin}],
        "kernels": [{"arch": "sm_90a", "key": "a" * 64}],
        "resolution": [{"profile": "h200", "problem": "p", "launches": [
            {"m_min": 1, "m_max": 8, "kernels": {"fused": "a" * 64}}]}]}
    check_serves(manifest, h200)
    shard = dict(manifest, shard={"index": 0, "count": 2})
    with pytest.raises(SchemaMismatchError, match="is shard 0 of 2 of a build: join the shards with `cuteaot merge`"):
        check_serves(shard, h200)
    other = copy.deepcopy(manifest)
    other["targets"][0]["sm_count"] = 114
    with pytest.raises(SchemaMismatchError, match="was planned for h200 as .*'sm_count': 114.*rebuild"):
        check_serves(other, h200)
    lacking = dict(manifest, kernels=[])
    with pytest.raises(IntegrityError, match=r"p needs sm_90a kernel aaaaaaaaaaaa for M 1\.\.8"):
        check_serves(lacking, h200)


def _set(path: list, value):
    def edit(m):
        obj = m
        for part in path[:-1]:
            obj = obj[part]
        obj[path[-1]] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set(["kernels", 0], 123), r"kernels\[0\] must be a JSON object, got int"),
    (_set(["kernels", 0, "facts", "index"], [1, 2]), "fact 'index' must be a string, number, bool or null"),
    (_set(["kernels", 0, "block"], ["a"]), "block must be three positive ints"),
    (_set(["kernels", 0, "block"], [0, 1, 1]), "block must be three positive ints"),
    (_set(["kernels", 0, "registers"], -4), "registers must be >= 0"),
    (_set(["targets", 0], "h200"), r"targets\[0\] must be a JSON object"),
    (lambda m: m["targets"][0].pop("name"), r"targets\[0\]: field 'name' is missing"),
    (lambda m: m["targets"][0].pop("sm_count"), r"targets\[0\]: field 'sm_count' is missing"),
    (_set(["targets", 0, "sm_count"], 114), r"was planned for h200 as .*'sm_count': 114.* profile is"),
    (lambda m: m.update(resolution=["x"]), r"resolution\[0\] must be a JSON object, got str"),
    (lambda m: m.update(shard={"index": 0}), r"shard: field 'count' is missing"),
    (_set(["kernels", 0, "waits_for_prior_grids"], "false"), "waits_for_prior_grids must be true or false"),
    (lambda m: m["targets"].append(dict(m["targets"][0])), "targets name a device profile twice"),
])
def test_a_malformed_manifest_is_a_schema_error_not_a_crash(bundle, edit, message):
    """Whatever a damaged or hand-edited manifest holds, reading it raises the one error type a serving
    engine catches (and `cuteaot build`, which rebuilds over a bundle it cannot read)."""
    m = read(bundle)
    edit(m)
    write_manifest(bundle, m)
    with pytest.raises(SchemaMismatchError, match=message):
        verify_bundle(bundle)


def test_a_manifest_that_is_not_text_is_a_schema_error(bundle):
    path = bundle / "manifest.json"
    path.write_bytes(path.read_bytes()[:40] + b"\xff\xfe" + path.read_bytes()[40:])
    with pytest.raises(SchemaMismatchError, match="is not UTF-8 text"):
        read_manifest(bundle)
