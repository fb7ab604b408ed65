"""The bundle manifest: reading, structural checks and integrity verification.

`docs/manifest.md` documents every field; `manifest.schema.json` beside this
file is the full JSON Schema (the tests validate built manifests against it).
The runtime checks only what it relies on, without third-party packages.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from .devices import PROFILES
from .errors import BundleNotFoundError, IntegrityError, SchemaMismatchError
from .keys import KernelKey
from .resolution import Entry

SCHEMA_VERSION = 2  # 2: the resolution table holds the build's decisions per token range (frozen resolution)
MANIFEST_NAME = "manifest.json"
SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")
# The `arch` and `sha256` patterns of manifest.schema.json.  A record's `file` must be exactly
# `<arch>/<key>.cubin`: with `arch` checked against this pattern, that leaves no room for `..`,
# an absolute path or a file of another record (see `cubin_path`).
_ARCH = re.compile(r"sm_[0-9]+a?")
_SHA256 = re.compile(r"[0-9a-f]{64}")

_KERNEL_FIELDS = {
    "key": str,
    "family": str,
    "version": int,
    "facts": dict,
    "arch": str,
    "file": str,
    "sha256": str,
    "bytes": int,
    "symbol": str,
    "params": list,
    "block": list,
    "dynamic_smem_bytes": int,
    "registers": int,
}
_TOP_FIELDS = {
    "schema_version": int,
    "bundle": str,
    "toolchain": dict,
    "source_fingerprint": str,
    "plan_fingerprint": str,
    "spec": dict,
    "targets": list,
    "kernels": list,
    "resolution": list,
}


@dataclass(frozen=True)
class KernelRecord:
    """One compiled kernel for one architecture, as the manifest records it."""

    key: KernelKey
    arch: str
    file: str
    sha256: str
    bytes: int
    symbol: str
    params: list
    block: tuple[int, int, int]
    dynamic_smem_bytes: int
    registers: int
    raw: dict  # the whole record, for display
    # its PTX begins with griddepcontrol.wait, so it may be launched with programmatic stream
    # serialization (bundles built before the field existed: False, launched plainly)
    waits_for_prior_grids: bool = False

    @property
    def digest(self) -> str:
        return self.key.digest


def _require(obj: dict, fields: dict, where: str) -> None:
    for name, typ in fields.items():
        if name not in obj:
            raise SchemaMismatchError(f"{where}: field {name!r} is missing; rebuild the bundle with this cuteaot")
        if not isinstance(obj[name], typ) or (typ is int and isinstance(obj[name], bool)):
            raise SchemaMismatchError(
                f"{where}: field {name!r} must be {typ.__name__}, got {type(obj[name]).__name__}"
            )


def _no_manifest(bundle_dir: Path) -> str:
    """What is wrong with a folder that is not a bundle, and how to make one."""
    how = "build one with `cuteaot build SPEC --out DIR` (it is written to DIR/<bundle name from the spec>)"
    if bundle_dir.is_file():
        return f"{bundle_dir} is a file; pass the bundle folder that holds {MANIFEST_NAME} ({bundle_dir.parent})"
    if not bundle_dir.is_dir():
        return f"{bundle_dir} does not exist (expected a bundle folder holding {MANIFEST_NAME}); {how}"
    # `cuteaot verify generated` instead of `generated/<bundle>`: name the bundles inside
    inside = sorted(str(d) for d in bundle_dir.iterdir() if (d / MANIFEST_NAME).is_file())
    if inside:
        more = f" ... ({len(inside)} in all)" if len(inside) > 5 else ""
        return (
            f"{bundle_dir} has no {MANIFEST_NAME}: it is a build output folder holding the bundle(s) "
            f"{', '.join(inside[:5])}{more}; pass one of those"
        )
    return f"{bundle_dir} has no {MANIFEST_NAME}, so it is not a cuteaot bundle; {how}"


def read_manifest(bundle_dir: str | Path) -> dict:
    """Parse and structurally check `<bundle_dir>/manifest.json`."""
    path = Path(bundle_dir) / MANIFEST_NAME
    if not path.is_file():
        raise BundleNotFoundError(_no_manifest(Path(bundle_dir)))
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SchemaMismatchError(f"{path} is not UTF-8 text ({exc}): the file is damaged; rebuild the bundle") from exc
    except (json.JSONDecodeError, RecursionError) as exc:
        raise SchemaMismatchError(f"{path} is not valid JSON: {exc}") from exc
    except OSError as exc:
        raise SchemaMismatchError(f"{path} cannot be read: {exc}") from exc
    if not isinstance(manifest, dict):
        raise SchemaMismatchError(f"{path}: expected a JSON object at the top level")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaMismatchError(
            f"{path}: schema_version is {version!r}, this runtime reads {SCHEMA_VERSION}; "
            "rebuild the bundle with the matching cuteaot version"
        )
    _require(manifest, _TOP_FIELDS, str(path))
    for i, kernel in enumerate(manifest["kernels"]):
        where = f"{path}: kernels[{i}]"
        _require(_object(kernel, where), _KERNEL_FIELDS, where)
        _check_kernel_values(kernel, where)
        if KernelKey(kernel["family"], kernel["version"], kernel["facts"]).digest != kernel["key"]:
            raise SchemaMismatchError(f"{where}: key does not match its family/version/facts")
        _check_file_name(kernel["arch"], kernel["key"], kernel["file"], kernel["sha256"], where)
    for i, target in enumerate(manifest["targets"]):
        _require(_object(target, f"{path}: targets[{i}]"), _TARGET_FIELDS, f"{path}: targets[{i}]")
    names = [t["name"] for t in manifest["targets"]]
    if len(set(names)) != len(names):
        raise SchemaMismatchError(f"{path}: targets name a device profile twice: {names}")
    for i, raw in enumerate(manifest["resolution"]):
        _require(_object(raw, f"{path}: resolution[{i}]"), _ENTRY_FIELDS, f"{path}: resolution[{i}]")
    shard = manifest.get("shard")
    if shard is not None:
        _require(_object(shard, f"{path}: shard"), {"index": int, "count": int}, f"{path}: shard")
    return manifest


_TARGET_FIELDS = {"name": str, "arch": str, "sm_count": int}
_ENTRY_FIELDS = {"op": str, "profile": str, "problem": str, "facts": dict, "launches": list, "workspaces": list}
_FACT_TYPES = (str, int, float, bool, type(None))


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise SchemaMismatchError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _check_kernel_values(kernel: dict, where: str) -> None:
    """What the runtime computes with: facts of scalars (they form the key), a block of three positive
    counts, non-negative sizes."""
    bad = [k for k, v in kernel["facts"].items() if not isinstance(v, _FACT_TYPES)]
    if bad:
        raise SchemaMismatchError(f"{where}: fact {bad[0]!r} must be a string, number, bool or null")
    if not isinstance(kernel.get("waits_for_prior_grids", False), bool):
        raise SchemaMismatchError(f"{where}: waits_for_prior_grids must be true or false, got "
                                  f"{kernel['waits_for_prior_grids']!r}")
    block = kernel["block"]
    if len(block) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block):
        raise SchemaMismatchError(f"{where}: block must be three positive ints, got {block!r}")
    for name in ("version", "bytes", "dynamic_smem_bytes", "registers"):
        if kernel[name] < 0:
            raise SchemaMismatchError(f"{where}: {name} must be >= 0, got {kernel[name]}")


def _check_file_name(arch: str, key: str, file: str, sha256: str, where: str) -> None:
    """Refuse a record whose file is not `<arch>/<key>.cubin` (checked before anything is opened)."""
    if not _ARCH.fullmatch(arch):
        raise SchemaMismatchError(f"{where}: arch must look like 'sm_90a', got {arch!r}")
    if not _SHA256.fullmatch(sha256):
        raise SchemaMismatchError(f"{where}: sha256 must be 64 lowercase hex digits, got {sha256!r}")
    expected = f"{arch}/{key}.cubin"
    if file != expected:
        raise SchemaMismatchError(
            f"{where}: file must be {expected!r} (<arch>/<key>.cubin inside the bundle), got {file!r}; "
            "the manifest was edited or is not from cuteaot: rebuild the bundle"
        )


def kernel_records(manifest: dict) -> list[KernelRecord]:
    return [
        KernelRecord(
            key=KernelKey(k["family"], k["version"], k["facts"]),
            arch=k["arch"],
            file=k["file"],
            sha256=k["sha256"],
            bytes=k["bytes"],
            symbol=k["symbol"],
            params=k["params"],
            block=tuple(k["block"]),
            dynamic_smem_bytes=k["dynamic_smem_bytes"],
            registers=k["registers"],
            raw=k,
            waits_for_prior_grids=k.get("waits_for_prior_grids", False),
        )
        for k in manifest["kernels"]
    ]


def cubin_path(bundle_dir: str | Path, record: KernelRecord) -> Path:
    """Where the record's cubin lies: `<bundle_dir>/<arch>/<key>.cubin`, never outside the bundle.

    `read_manifest` already refused other file names; this checks again (a KernelRecord can be
    built by hand) and resolves symlinks, so a cubin or arch folder linked to a file outside the
    bundle is refused before it is opened.
    """
    where = f"{bundle_dir}: kernel {record.digest[:12]} ({record.arch})"
    _check_file_name(record.arch, record.digest, record.file, record.sha256, where)
    path = Path(bundle_dir) / record.file
    root, resolved = Path(bundle_dir).resolve(), path.resolve()
    if not resolved.is_relative_to(root):
        raise IntegrityError(
            f"{path}: resolves to {resolved}, outside the bundle {root}; a bundle's cubins must lie inside it "
            "(copy the bundle with `cp -rL` instead of linking its files)"
        )
    return path


def read_cubin(bundle_dir: str | Path, record: KernelRecord) -> bytes:
    """The cubin's bytes, after checking its place, size and sha256 against the manifest."""
    path = cubin_path(bundle_dir, record)
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise IntegrityError(f"{path}: cubin listed in the manifest is missing") from exc
    except OSError as exc:  # a directory or unreadable file where the cubin should be
        raise IntegrityError(f"{path}: cubin listed in the manifest cannot be read: {exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != record.bytes or digest != record.sha256:
        raise IntegrityError(
            f"{path}: cubin is corrupt (sha256 {digest[:16]}…, {len(data)} bytes; "
            f"manifest says {record.sha256[:16]}…, {record.bytes} bytes); rebuild or re-copy the bundle"
        )
    return data


def check_serves(manifest: dict, profile) -> None:
    """Before loading for `profile` (a DeviceProfile the live GPU matched): the bundle is whole (not one shard
    of a build), was planned for the device facts this runtime's profile has (grids are sized to its SMs:
    a grid barrier over more CTAs than can be resident hangs), and every kernel its table names for that
    arch is in it.  Raises SchemaMismatchError or IntegrityError."""
    if manifest.get("shard") is not None:
        shard = manifest["shard"]
        raise SchemaMismatchError(f"bundle {manifest['bundle']!r} is shard {shard['index']} of {shard['count']} of a "
                                  "build: join the shards with `cuteaot merge` and load the merged bundle")
    (target,) = [t for t in manifest["targets"] if t["name"] == profile.name]
    _check_target(manifest, target, profile)
    built = {k["key"] for k in manifest["kernels"] if k["arch"] == profile.arch}
    for raw in manifest["resolution"]:
        if raw["profile"] != profile.name:
            continue
        for launch in raw["launches"]:
            missing = [d for d in launch["kernels"].values() if d not in built]
            if missing:
                raise IntegrityError(f"bundle {manifest['bundle']!r}: {raw['problem']} needs {profile.arch} kernel "
                                     f"{missing[0][:12]} for M {launch['m_min']}..{launch['m_max']}, which the bundle "
                                     "does not contain; rebuild it")


def _check_target(manifest: dict, target: dict, profile) -> None:
    """The device facts a target was planned with are this runtime's profile's."""
    planned = {f: target.get(f) for f in ("arch", "sm_count", "max_shared_memory_per_block_optin")}
    live = {f: getattr(profile, f) for f in planned}
    if planned != live:
        raise SchemaMismatchError(f"bundle {manifest['bundle']!r} was planned for {profile.name} as {planned}, this "
                                  f"runtime's {profile.name} profile is {live}: rebuild the bundle with this cuteaot")


def verify_bundle(bundle_dir: str | Path) -> dict:
    """Check schema, every cubin's checksum and the resolution table; no GPU needed.

    Returns the manifest.  Raises SchemaMismatchError or IntegrityError.
    """
    manifest = read_manifest(bundle_dir)
    for target in manifest["targets"]:  # the checks load_bundle makes of the live GPU's target, for every target
        if target["name"] in PROFILES:
            _check_target(manifest, target, PROFILES[target["name"]])
    records = kernel_records(manifest)
    for record in records:
        read_cubin(bundle_dir, record)
    if manifest.get("shard") is not None:
        return manifest  # a shard holds part of the kernels; `cuteaot merge` checks the whole
    built = {(r.arch, r.digest) for r in records}
    arch_of = {t["name"]: t["arch"] for t in manifest["targets"]}
    for raw in manifest["resolution"]:
        entry = Entry.from_json(raw)  # launch ranges tile 1..max without gaps
        arch = arch_of.get(entry.profile)
        for launch in entry.launches:
            for variant, digest in launch.kernels.items():
                if (arch, digest) not in built:
                    raise IntegrityError(
                        f"{bundle_dir}: resolution entry {entry.op} {entry.problem}/{entry.profile} needs {variant} "
                        f"kernel {digest[:12]} for {arch} (M {launch.m_min}..{launch.m_max}), which the bundle "
                        "does not contain"
                    )
    return manifest
