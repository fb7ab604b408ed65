"""Build a bundle: compile every specialization, cache by content, write atomically.

    generated/<bundle>/manifest.json
    generated/<bundle>/<arch>/<key sha256>.cubin
    generated/.cache/<arch>/<cache id>.{cubin,json}    cache id = sha256(key, arch, sources, toolchain)

An unchanged key + source fingerprint + toolchain reuses the cached cubin, so an
unchanged rebuild compiles nothing.  The bundle is assembled in a staging
directory and renamed into place: an interrupted build never leaves a bundle
that loads half-written.  `--shard i/N` builds every N-th job; `merge` joins shards.
"""

from __future__ import annotations

import dataclasses

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import cuteaot.runtime as runtime_pkg
from cuteaot.runtime.errors import BuildError
from cuteaot.runtime.keys import KernelKey
from cuteaot.runtime.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    kernel_records,
    read_cubin,
    read_manifest,
    verify_bundle,
)

from .enumerate import Job, jobs, resolution_table
from .spec import BundleSpec, load_spec

CODEGEN_DIR = Path(__file__).parent
RUNTIME_DIR = Path(runtime_pkg.__file__).parent
# Runtime modules whose content changes what is compiled (facts, signatures, profiles).
# The sources that decide what a key compiles to (the spec reader, enumeration, this driver and the
# CLI only decide *which* keys to compile, and the keys say that themselves).
CODEGEN_SOURCES = ("compile.py", "intrinsics.py", "ptx.py", "resources.py", "kernels")
# every runtime module a compiled kernel depends on: the specs (kernels/), the shared-memory and
# tile math they use (planning, fused_planning) and the weight layout the decode follows (weights)
RUNTIME_SOURCES = ("abi.py", "keys.py", "types.py", "devices.py", "kernels", "planning.py", "fused_planning.py",
                   "weights.py")
TOOLCHAIN_PACKAGES = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cuda-cuobjdump")
INLINE_JOBS = 8  # below this many compilations, worker start-up costs more than it saves


def source_fingerprint() -> str:
    """sha256 of the codegen sources and the runtime modules that decide what is compiled."""
    files = []
    for name in CODEGEN_SOURCES:
        path = CODEGEN_DIR / name
        found = path.rglob("*.py") if path.is_dir() else [path]
        files += [("codegen", f.relative_to(CODEGEN_DIR)) for f in found]
    for name in RUNTIME_SOURCES:
        path = RUNTIME_DIR / name
        found = path.rglob("*.py") if path.is_dir() else [path]
        files += [("runtime", f.relative_to(RUNTIME_DIR)) for f in found]
    h = hashlib.sha256()
    for top, rel in sorted(files):
        base = CODEGEN_DIR if top == "codegen" else RUNTIME_DIR
        h.update(f"{top}/{rel}".encode() + b"\0" + (base / rel).read_bytes() + b"\0")
    return h.hexdigest()


def toolchain() -> dict[str, str]:
    out = {"python": ".".join(map(str, sys.version_info[:3]))}
    for pkg in TOOLCHAIN_PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            raise BuildError(f"{pkg} is not installed: `pip install -e '.[codegen]'`") from None
    return out


def _cache_id(job: Job, fingerprint: str, tools: dict) -> str:
    blob = json.dumps({"key": job.canonical, "arch": job.arch, "src": fingerprint, "tools": tools}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _compile_job(canonical: str, arch: str) -> tuple[dict, bytes]:
    """Worker entry point (module level so process pools can pickle it)."""
    from .compile import compile_kernel  # imports CuTeDSL: only in processes that compile

    raw = json.loads(canonical)
    compiled = compile_kernel(KernelKey(raw["family"], raw["version"], raw["facts"]), arch)
    return compiled.record, compiled.cubin


@dataclass
class BuildReport:
    bundle_dir: Path
    built: list[tuple[str, float]] = field(default_factory=list)  # (description, seconds)
    reused: int = 0
    seconds: float = 0.0
    unchanged: bool = False
    spills: list[str] = field(default_factory=list)  # kernels that use local memory / stack

    def summary(self) -> str:
        lines = [
            f"bundle {self.bundle_dir}: {len(self.built)} kernels built, {self.reused} reused, "
            f"{self.seconds:.1f} s" + (" (bundle unchanged)" if self.unchanged else "")
        ]
        slow = sorted(self.built, key=lambda t: -t[1])[:5]
        if slow:
            lines.append("slowest: " + "; ".join(f"{d} {s:.2f} s" for d, s in slow))
        if self.spills:
            lines.append(f"warning: {len(self.spills)} kernel(s) spill registers (see `cuteaot inspect`): "
                         + "; ".join(self.spills[:6]) + (" ..." if len(self.spills) > 6 else ""))
        return "\n".join(lines)


class _Progress:
    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.stream = total, 0, stream
        self.tty = stream.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        width = 30
        filled = width * self.done // max(self.total, 1)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label}"
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120) + ("\n" if self.done == self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _compile_all(todo: list[Job], workers: int, progress: bool, on_done=None) -> dict[Job, tuple[dict, bytes]]:
    """Compile `todo`; `on_done(job, result)` runs as each finishes (the build caches it there, so
    an interrupted or failed build keeps everything that did compile)."""
    results: dict[Job, tuple[dict, bytes]] = {}
    bar = _Progress(len(todo)) if progress and todo else None

    def done(job: Job, result: tuple[dict, bytes]) -> None:
        results[job] = result
        if on_done:
            on_done(job, result)
        if bar:
            bar.step(f"{job.arch} {job.key.family} {result[0]['compile_seconds']:.2f}s")

    if workers <= 1 or len(todo) <= INLINE_JOBS:
        for job in todo:
            done(job, _compile_job(job.canonical, job.arch))
        return results
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=ctx) as pool:
        futures = {pool.submit(_compile_job, job.canonical, job.arch): job for job in todo}
        for fut in as_completed(futures):
            job = futures[fut]
            try:
                done(job, fut.result())
            except Exception as exc:  # re-raised with the specialization named
                for other in futures:
                    other.cancel()
                raise BuildError(f"compiling {job.key.describe()} for {job.arch} failed: {exc}") from exc
    return results


def _manifest(spec: BundleSpec, records: list[dict], fingerprint: str, tools: dict, shard) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "bundle": spec.bundle,
        "toolchain": tools,
        "source_fingerprint": fingerprint,
        "spec": {"file": Path(spec.file).name, "sha256": spec.sha256},
        "targets": [
            {
                "name": t.name,
                "arch": t.arch,
                "compute_capability": list(t.compute_capability),
                "sm_count": t.sm_count,
                "max_shared_memory_per_block_optin": t.max_shared_memory_per_block_optin,
            }
            for t in spec.targets
        ],
        "shard": shard,
        "kernels": sorted(records, key=lambda r: (r["arch"], r["family"], r["key"])),
        "resolution": resolution_table(spec),
    }


def write_bundle(final: Path, manifest: dict, cubins: dict[str, bytes]) -> bool:
    """Write `final` atomically (staging dir + rename); False if it already holds this manifest."""
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    if (final / MANIFEST_NAME).is_file() and (final / MANIFEST_NAME).read_text() == text:
        if all((final / rel).is_file() for rel in cubins):
            return False
    staging = final.with_name(f".{final.name}.staging-{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    for rel, data in cubins.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    (staging / MANIFEST_NAME).write_text(text)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    if old.exists():
        shutil.rmtree(old)
    return True


def build(
    spec_path: str | Path,
    out_root: str | Path = "generated",
    *,
    workers: int | None = None,
    shard: tuple[int, int] | None = None,
    progress: bool = True,
    targets: list[str] | None = None,
) -> BuildReport:
    """Build a spec's bundle; `targets` restricts it to some of its device profiles (by name)."""
    start = time.perf_counter()
    spec = load_spec(spec_path)
    if targets:
        unknown = sorted(set(targets) - {t.name for t in spec.targets})
        if unknown:
            raise BuildError(f"--targets {unknown} are not targets of {spec_path} ({[t.name for t in spec.targets]})")
        spec = dataclasses.replace(spec, targets=tuple(t for t in spec.targets if t.name in targets))
    out_root = Path(out_root)
    fingerprint, tools = source_fingerprint(), toolchain()
    selected = jobs(spec)
    name = spec.bundle
    if shard is not None:
        index, count = shard
        if not (count >= 1 and 0 <= index < count):
            raise BuildError(f"--shard {index}/{count}: need 0 <= i < N")
        selected = [j for i, j in enumerate(selected) if i % count == index]
        name = f"{spec.bundle}.shard-{index}-of-{count}"
    cache = out_root / ".cache"
    ids = {job: _cache_id(job, fingerprint, tools) for job in selected}
    todo = [j for j in selected if not (cache / j.arch / f"{ids[j]}.json").is_file()]
    report = BuildReport(out_root / name)

    def cache_one(job: Job, result: tuple[dict, bytes]) -> None:
        record, cubin = result
        _atomic_write(cache / job.arch / f"{ids[job]}.cubin", cubin)  # cubin first: the json marks it complete
        _atomic_write(cache / job.arch / f"{ids[job]}.json", json.dumps(record, sort_keys=True).encode())
        report.built.append((f"{job.arch} {job.key.family} {job.key.digest[:12]}", record["compile_seconds"]))

    _compile_all(todo, workers or os.cpu_count() or 1, progress, on_done=cache_one)
    report.reused = len(selected) - len(todo)
    records, cubins = [], {}
    for job in selected:
        record = json.loads((cache / job.arch / f"{ids[job]}.json").read_text())
        data = (cache / job.arch / f"{ids[job]}.cubin").read_bytes()
        rel = f"{job.arch}/{job.key.digest}.cubin"
        record.update(file=rel, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
        records.append(record)
        if record["stack_bytes"] or record["local_bytes"]:
            report.spills.append(
                f"{job.arch} {job.key.family} {job.key.digest[:12]} ({record['registers']} regs, "
                f"{record['stack_bytes']} B stack, {record['local_bytes']} B local)"
            )
        cubins[rel] = data
    shard_info = None if shard is None else {"index": shard[0], "count": shard[1]}
    manifest = _manifest(spec, records, fingerprint, tools, shard_info)
    report.unchanged = not write_bundle(report.bundle_dir, manifest, cubins)
    report.seconds = time.perf_counter() - start
    return report


def merge(shard_dirs: list[str | Path], out_root: str | Path = "generated") -> Path:
    """Join the shards of one build into the full bundle (checks they belong together)."""
    if not shard_dirs:
        raise BuildError("merge needs at least one shard directory")
    manifests = [(Path(d), read_manifest(d)) for d in shard_dirs]
    first = manifests[0][1]
    same = ("bundle", "toolchain", "source_fingerprint", "spec", "targets", "resolution")
    for path, m in manifests:
        if m.get("shard") is None:
            raise BuildError(f"{path} is not a shard (built without --shard)")
        for f in same:
            if m[f] != first[f]:
                raise BuildError(f"{path} differs from {manifests[0][0]} in {f!r}: shards of different builds")
    count = first["shard"]["count"]
    indices = sorted(m["shard"]["index"] for _, m in manifests)
    if indices != list(range(count)) or any(m["shard"]["count"] != count for _, m in manifests):
        raise BuildError(f"merge needs shards 0..{count - 1} exactly once, got indices {indices}")
    records, cubins = [], {}
    for path, m in manifests:
        for rec in kernel_records(m):
            cubins[rec.file] = read_cubin(path, rec)
            records.append(rec.raw)
    manifest = dict(first, shard=None, kernels=sorted(records, key=lambda r: (r["arch"], r["family"], r["key"])))
    final = Path(out_root) / first["bundle"]
    write_bundle(final, manifest, cubins)
    verify_bundle(final)  # every resolution row must now find its kernels
    return final
