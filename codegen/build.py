"""Build a bundle: compile every specialization, cache by content, write atomically.

    generated/<bundle>/manifest.json
    generated/<bundle>/<arch>/<key sha256>.cubin
    generated/.cache/<arch>/<cache id>.{cubin,json}    cache id = sha256(key, arch, sources, toolchain)

An unchanged key + source fingerprint + toolchain reuses the cached cubin, so an
unchanged rebuild compiles nothing.  The bundle is assembled in a staging
directory and renamed into place: an interrupted build never leaves a bundle
that loads half-written.  `--shard i/N` builds every N-th job; `merge` joins shards.

Robustness (docs/reliability.md):
* a cache entry's json records the sha256 and size of its cubin; an entry that does not match
  (flipped bit, half-written file, older format) is rebuilt with a warning, never shipped;
* compile workers die with the build (PR_SET_PDEATHSIG on Linux, a parent-pid watch elsewhere),
  and SIGINT / SIGTERM stop a build cleanly: pending jobs cancelled, workers killed, staging
  removed, the previous bundle left as it was, one line on stderr (BuildError);
* writers of one bundle serialise on the file lock `<out>/.<bundle>.lock`; cache writes use
  temporary names unique per process and thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import filelock

import cuteaot.runtime as runtime_pkg
from cuteaot.runtime.errors import BuildError, CuteAotError
from cuteaot.runtime.keys import KernelKey
from cuteaot.runtime.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    kernel_records,
    read_cubin,
    read_manifest,
    verify_bundle,
)

from .enumerate import Job, jobs_of
from .table import PlannedBundle, plan_bundle
from .spec import BundleSpec, load_spec

CODEGEN_DIR = Path(__file__).parent
RUNTIME_DIR = Path(runtime_pkg.__file__).parent
# Runtime modules whose content changes what is compiled (facts, signatures, profiles).
# The sources that decide what a key compiles to (the spec reader, enumeration, this driver and the
# CLI only decide *which* keys to compile, and the keys say that themselves).
CODEGEN_SOURCES = ("compile.py", "intrinsics.py", "ptx.py", "resources.py", "kernels")
# ... except the planners under kernels/: they choose which keys a bundle holds, never what a key compiles
# to (no compiled module imports them: tests/test_build_robustness.py), so a planner edit re-plans without
# recompiling
PLANNER_SOURCES = ("kernels/w4a16/planning.py", "kernels/w4a16/fused_planning.py")
# every runtime module a compiled kernel depends on: the specs and their geometry (kernels/) and the
# weight layouts the decodes follow (weights, nf3)
RUNTIME_SOURCES = ("abi.py", "keys.py", "types.py", "devices.py", "kernels", "weights.py", "nf3.py")
# runtime modules the fingerprinted ones import that cannot change what is compiled: exceptions, and what
# the kernel families use to launch (tests/test_build_robustness.py checks that nothing else is left out)
LAUNCH_ONLY_SOURCES = ("errors.py", "bundle.py", "tensors.py", "resolution.py", "workspace.py")
# What else decides the resolution table (which kernel, grid and buffers serve each M): a bundle
# whose plan fingerprint and spec are unchanged is up to date without re-planning.
PLAN_SOURCES = (("codegen", "table.py"), ("codegen", "enumerate.py"), ("codegen", "spec.py"),
                ("codegen", "kernels/w4a16/measured_blocks.json"), ("runtime", "resolution.py"),
                *(("codegen", name) for name in PLANNER_SOURCES))
TOOLCHAIN_PACKAGES = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cuda-cuobjdump")
INLINE_JOBS = 8  # below this many compilations, worker start-up costs more than it saves
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_S = 1.0  # how often a worker checks its parent where PR_SET_PDEATHSIG does not exist
WORKER_STOP_S = 5.0  # how long a stopped worker gets to exit after SIGTERM before SIGKILL


def _fingerprint(files: list[tuple[str, Path]]) -> str:
    h = hashlib.sha256()
    for top, rel in sorted(files):
        base = CODEGEN_DIR if top == "codegen" else RUNTIME_DIR
        h.update(f"{top}/{rel}".encode() + b"\0" + (base / rel).read_bytes() + b"\0")
    return h.hexdigest()


def _source_files() -> list[tuple[str, Path]]:
    files = []
    for top, base, names in (("codegen", CODEGEN_DIR, CODEGEN_SOURCES), ("runtime", RUNTIME_DIR, RUNTIME_SOURCES)):
        for name in names:
            path = base / name
            found = path.rglob("*.py") if path.is_dir() else [path]
            files += [(top, f.relative_to(base)) for f in found]
    return [(top, rel) for top, rel in files if not (top == "codegen" and rel.as_posix() in PLANNER_SOURCES)]


def source_fingerprint() -> str:
    """sha256 of the codegen sources and the runtime modules that decide what is compiled."""
    return _fingerprint(_source_files())


def plan_fingerprint() -> str:
    """sha256 of everything that decides the resolution table: the compiled sources (the planners
    live in codegen/kernels) plus the table builder, enumeration, spec reader and table schema."""
    return _fingerprint(_source_files() + [(top, Path(name)) for top, name in PLAN_SOURCES])


def toolchain() -> dict[str, str]:
    """The packages that compile, and the CuTeDSL settings of this environment (CUTE_DSL_LINEINFO,
    ..._ENABLE_ASSERTIONS, ..._COMPILER_OPT and others change the cubins; the workers inherit them), so a
    debug build's cubins never serve a plain build from the cache, nor leave its bundle standing."""
    out = {"python": ".".join(map(str, sys.version_info[:3]))}
    for pkg in TOOLCHAIN_PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            raise BuildError(f"{pkg} is not installed: `pip install -e '.[codegen]'`") from None
    out.update({f"env {name}": value for name, value in sorted(os.environ.items())
                if name.startswith(COMPILER_ENV_PREFIX)})
    return out


COMPILER_ENV_PREFIX = "CUTE_DSL_"  # environment variables the compiler reads


def _cache_id(job: Job, fingerprint: str, tools: dict) -> str:
    blob = json.dumps({"key": job.canonical, "arch": job.arch, "src": fingerprint, "tools": tools}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    """Write `path` via a temporary file and os.replace, so readers see the old or the new content.

    Concurrent builds (processes) and threads may write the same cache entry: the temporary
    name carries both the pid and the thread id, so no two writers ever share one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left when writing or replacing failed


def _cache_problem(record, data: bytes) -> str | None:
    """Why a cache entry (json record + cubin bytes) must not be reused, or None when it is sound."""
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str) or "bytes" not in record:
        return "records no cubin sha256/size (written by an older cuteaot or damaged)"
    if len(data) != record["bytes"]:
        return f"cubin is {len(data)} bytes, the entry says {record['bytes']} (half-written or truncated)"
    digest = hashlib.sha256(data).hexdigest()
    if digest != record["sha256"]:
        return f"cubin sha256 {digest[:16]}... differs from the entry's {record['sha256'][:16]}... (corrupt)"
    return None


def _load_cached(meta: Path, blob: Path, warnings: list[str]) -> tuple[dict, bytes] | None:
    """The cached (record, cubin), or None when absent or unusable (then it is rebuilt).

    An unusable entry adds a warning naming it (printed to stderr at once, kept in the report).
    """
    if not meta.is_file():
        return None  # never built: not worth a warning
    try:
        record, data = json.loads(meta.read_text()), blob.read_bytes()
    except (OSError, ValueError) as exc:  # missing cubin, invalid JSON or UTF-8
        problem = f"cannot be read ({type(exc).__name__}: {exc})"
    else:
        problem = _cache_problem(record, data)
    if problem is None:
        return record, data
    warnings.append(f"warning: cache entry {meta} {problem}; rebuilding it")
    print(warnings[-1], file=sys.stderr, flush=True)
    return None


def _compile_job(canonical: str, arch: str) -> tuple[dict, bytes]:
    """Worker entry point (module level so process pools can pickle it)."""
    from .compile import compile_kernel  # imports CuTeDSL: only in processes that compile

    raw = json.loads(canonical)
    compiled = compile_kernel(KernelKey(raw["family"], raw["version"], raw["facts"]), arch)
    return compiled.record, compiled.cubin


def _worker_init(parent: int) -> None:
    """Tie a compile worker's life to the build process `parent` (runs first in every worker).

    Without this a SIGKILLed build leaves its ~500 MB workers (and through their inherited pipe
    the multiprocessing resource tracker) running forever.  PR_SET_PDEATHSIG makes the kernel
    SIGKILL the worker when its parent dies; nothing the parent must still do, so it also holds
    for SIGKILL, unlike a process group (someone alive would have to signal the group).  The
    death signal follows the parent *thread* that spawned the worker: ProcessPoolExecutor spawns
    spawn-context workers from `submit`, i.e. the build's own thread, alive until the pool closes.
    """
    # Ctrl-C signals the terminal's whole process group: the build decides what stops, not each worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    else:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="parent-watch").start()
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(1)


def _watch_parent(parent: int) -> None:
    """Fallback where PR_SET_PDEATHSIG does not exist: exit once re-parented (the build is gone)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


class _Interrupted(BaseException):
    """SIGINT/SIGTERM during a build (a BaseException like KeyboardInterrupt: no `except Exception` eats it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _SignalStop:
    """While entered (main thread only), SIGINT and SIGTERM raise `_Interrupted`; inside `critical()`
    they are held back until its end, so the rename pair that swaps a bundle is never split.

    One instance per process: signal handlers are process-wide state.
    """

    def __init__(self):
        self.depth, self.pending, self.entered, self.previous = 0, None, 0, {}

    def __enter__(self) -> "_SignalStop":
        # only the main thread may install handlers; elsewhere the signals keep their old meaning
        if self.entered == 0 and threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.entered += 1
        return self

    def __exit__(self, *exc) -> None:
        self.entered -= 1
        if self.entered == 0:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
            self.previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.depth:
            self.pending = signum
            return
        raise _Interrupted(signum)

    @contextlib.contextmanager
    def critical(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # handlers run in the main thread only: nothing to hold back (and no shared counter to race)
            return
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending is not None:
                signum, self.pending = self.pending, None
                raise _Interrupted(signum)


_signals = _SignalStop()


def _stop_pool(pool: ProcessPoolExecutor) -> None:
    """Cancel queued jobs and end running workers now: a compile can run for seconds and nothing it
    would produce is wanted any more (what finished is already cached)."""
    if hasattr(pool, "terminate_workers"):  # Python >= 3.14
        pool.terminate_workers()
        return
    procs = list((pool._processes or {}).values())  # no public handle to the workers before 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.join(WORKER_STOP_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


@dataclass
class BuildReport:
    bundle_dir: Path
    built: list[tuple[str, float]] = field(default_factory=list)  # (description, seconds)
    reused: int = 0
    seconds: float = 0.0
    unchanged: bool = False
    spills: list[str] = field(default_factory=list)  # kernels that use local memory / stack
    warnings: list[str] = field(default_factory=list)  # cache entries rebuilt (already printed to stderr)

    def summary(self) -> str:
        counts = f"{len(self.built)} kernels built, {self.reused} reused, {self.seconds:.1f} s"
        if self.unchanged and not self.built:
            # a no-op build repeats nothing the build that wrote the bundle already said
            spills = f"; {len(self.spills)} kernel(s) spill registers (`cuteaot inspect`)" if self.spills else ""
            return f"bundle {self.bundle_dir} unchanged: {counts}{spills}"
        lines = [f"bundle {self.bundle_dir}: {counts}" + (" (bundle unchanged)" if self.unchanged else "")]
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
    pool = ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=ctx,
                               initializer=_worker_init, initargs=(os.getpid(),))
    try:
        futures = {pool.submit(_compile_job, job.canonical, job.arch): job for job in todo}
        for fut in as_completed(futures):
            job = futures[fut]
            try:
                result = fut.result()
            except Exception as exc:  # re-raised with the specialization named
                raise BuildError(f"compiling {job.key.describe()} for {job.arch} failed: {exc}") from exc
            done(job, result)
    except BaseException:  # a failed compile, SIGINT/SIGTERM, a full disk while caching
        _stop_pool(pool)
        raise
    pool.shutdown()
    return results


def _manifest(spec: BundleSpec, planned: PlannedBundle, records: list[dict], fingerprint: str, tools: dict,
              shard) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "bundle": spec.bundle,
        "toolchain": tools,
        "source_fingerprint": fingerprint,
        "plan_fingerprint": plan_fingerprint(),
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
        "resolution": [entry.to_json() for entry in planned.entries],
    }


@contextlib.contextmanager
def _bundle_lock(final: Path):
    """Hold `<out>/.<bundle>.lock` (released by the OS if this process dies): one writer at a time."""
    lock = filelock.FileLock(final.with_name(f".{final.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        print(f"waiting for another build writing {final} (lock {lock.lock_file})", file=sys.stderr, flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _remove_leftovers(final: Path) -> None:
    """Staging and old directories of writers that were killed (under the lock no live writer owns one).  A
    writer killed between its two renames left no bundle at `final` and the previous one as `.old-*`: that
    one is put back, not deleted."""
    olds = sorted(final.parent.glob(f".{final.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if olds and not final.exists():
        os.replace(olds.pop(), final)
    for path in olds + list(final.parent.glob(f".{final.name}.staging-*")):
        shutil.rmtree(path)


def write_bundle(final: Path, manifest: dict, cubins: dict[str, bytes]) -> bool:
    """Write `final` atomically (staging dir + rename); False if it already holds this manifest.

    Concurrent writers of one bundle take turns on the bundle's file lock; SIGINT/SIGTERM never
    split the rename pair, and an interrupted write removes its staging directory.
    """
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    final.parent.mkdir(parents=True, exist_ok=True)
    with _bundle_lock(final):
        _remove_leftovers(final)
        if (final / MANIFEST_NAME).is_file() and (final / MANIFEST_NAME).read_text() == text:
            # the same bundle, byte for byte (a truncated or flipped cubin is rewritten, not kept)
            if all((final / rel).is_file() and (final / rel).read_bytes() == data for rel, data in cubins.items()):
                return False
        staging = final.with_name(f".{final.name}.staging-{os.getpid()}")
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        try:
            for rel, data in cubins.items():
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                (staging / rel).write_bytes(data)
            (staging / MANIFEST_NAME).write_text(text)
            with _signals.critical():  # between these renames there is no bundle at `final`
                if final.exists():
                    os.replace(final, old)
                os.replace(staging, final)
        finally:
            if old.exists() and not final.exists():  # the swap failed half-way: put the previous bundle back
                os.replace(old, final)
            for leftover in (staging, old):  # staging: interrupted or failed before the swap
                if leftover.exists():
                    shutil.rmtree(leftover)
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
    """Build a spec's bundle; `targets` restricts it to some of its device profiles (by name).

    SIGINT/SIGTERM raise BuildError (one line for the CLI): workers stopped, staging removed,
    the previous bundle untouched; kernels that finished compiling stay cached.
    """
    with _stoppable(f"build of {spec_path}", out_root):
        return _build(spec_path, Path(out_root), workers, shard, progress, targets)


@contextlib.contextmanager
def _stoppable(what: str, out_root):
    """SIGINT/SIGTERM inside become one BuildError (the CLI prints it as one line, no traceback)."""
    try:
        with _signals:
            yield
    except _Interrupted as stop:
        name = signal.Signals(stop.signum).name
        raise BuildError(f"{what} interrupted by {name}: workers stopped, {out_root} keeps the bundle it had "
                         "(kernels that finished compiling stay cached)") from None


def _spill_line(record: dict) -> str:
    return (f"{record['arch']} {record['family']} {record['key'][:12]} ({record['registers']} regs, "
            f"{record['stack_bytes']} B stack, {record['local_bytes']} B local)")


def _up_to_date(bundle_dir: Path, spec: BundleSpec, plan_print: str, tools: dict) -> dict | None:
    """The manifest of bundle_dir when it was built from this spec text, these sources and this
    toolchain for the same targets, and every cubin it lists is present and intact (rebuilding would
    reproduce it); else None.  Read under the bundle's lock: a concurrent writer swaps the
    directory, and between its two renames there is no bundle at bundle_dir."""
    bundle_dir.parent.mkdir(parents=True, exist_ok=True)
    with _bundle_lock(bundle_dir):
        try:
            manifest = verify_bundle(bundle_dir)
        except CuteAotError:
            return None
    same = (manifest["spec"] == {"file": Path(spec.file).name, "sha256": spec.sha256}
            and manifest.get("plan_fingerprint") == plan_print and manifest["toolchain"] == tools
            and [t["name"] for t in manifest["targets"]] == [t.name for t in spec.targets]
            and manifest.get("shard") is None)
    return manifest if same else None


def _planning_line(text: str) -> None:
    """Enumeration's report of each planned problem: with large token buckets planning takes minutes."""
    print(text, file=sys.stderr, flush=True)


def _build(spec_path, out_root: Path, workers, shard, progress: bool, targets) -> BuildReport:
    start = time.perf_counter()
    spec = load_spec(spec_path)
    if targets:
        unknown = sorted(set(targets) - {t.name for t in spec.targets})
        if unknown:
            raise BuildError(f"--targets {unknown} are not targets of {spec_path} ({[t.name for t in spec.targets]})")
        spec = dataclasses.replace(spec, targets=tuple(t for t in spec.targets if t.name in targets))
    fingerprint, tools = source_fingerprint(), toolchain()
    name = spec.bundle if shard is None else f"{spec.bundle}.shard-{shard[0]}-of-{shard[1]}"
    current = None if shard is not None else _up_to_date(out_root / name, spec, plan_fingerprint(), tools)
    if current is not None:
        # same spec, sources and toolchain as the bundle there: its plan and kernels stand (no re-planning)
        report = BuildReport(out_root / name, unchanged=True)
        for record in current["kernels"]:
            report.reused += 1
            if record["stack_bytes"] or record["local_bytes"]:
                report.spills.append(_spill_line(record))
        report.seconds = time.perf_counter() - start
        return report
    planned = plan_bundle(spec, progress=_planning_line if progress else None)
    selected = jobs_of(spec, planned)
    if shard is not None:
        index, count = shard
        if not (count >= 1 and 0 <= index < count):
            raise BuildError(f"--shard {index}/{count}: need 0 <= i < N")
        selected = [j for i, j in enumerate(selected) if i % count == index]
        name = f"{spec.bundle}.shard-{index}-of-{count}"
    cache = out_root / ".cache"
    paths = {j: (cache / j.arch / f"{_cache_id(j, fingerprint, tools)}.json") for j in selected}
    report = BuildReport(out_root / name)
    entries = {j: _load_cached(meta, meta.with_suffix(".cubin"), report.warnings) for j, meta in paths.items()}
    todo = [j for j in selected if entries[j] is None]

    def cache_one(job: Job, result: tuple[dict, bytes]) -> None:
        record, cubin = result
        # the entry records its cubin's checksum: a later build reuses it only if the bytes still match
        record = dict(record, sha256=hashlib.sha256(cubin).hexdigest(), bytes=len(cubin))
        _atomic_write(paths[job].with_suffix(".cubin"), cubin)  # cubin first: the json marks it complete
        _atomic_write(paths[job], json.dumps(record, sort_keys=True).encode())
        entries[job] = (record, cubin)
        report.built.append((f"{job.arch} {job.key.family} {job.key.digest[:12]}", record["compile_seconds"]))

    _compile_all(todo, workers or os.cpu_count() or 1, progress, on_done=cache_one)
    report.reused = len(selected) - len(todo)
    records, cubins = [], {}
    for job in selected:
        record, data = entries[job]
        rel = f"{job.arch}/{job.key.digest}.cubin"
        records.append(dict(record, file=rel))
        if record["stack_bytes"] or record["local_bytes"]:
            report.spills.append(_spill_line(dict(record, key=job.key.digest)))
        cubins[rel] = data
    if report.spills and not spec.allow_spills:
        raise BuildError(
            f"{len(report.spills)} kernel(s) spill registers and {Path(spec.file).name} sets `allow_spills: false`: "
            + "; ".join(report.spills[:6]) + (" ..." if len(report.spills) > 6 else "")
            + ". Change the planner's choice for them (codegen/kernels/) or allow spills in the spec."
        )
    shard_info = None if shard is None else {"index": shard[0], "count": shard[1]}
    manifest = _manifest(spec, planned, records, fingerprint, tools, shard_info)
    report.unchanged = not write_bundle(report.bundle_dir, manifest, cubins)
    report.seconds = time.perf_counter() - start
    return report


def merge(shard_dirs: list[str | Path], out_root: str | Path = "generated") -> Path:
    """Join the shards of one build into the full bundle (checks they belong together)."""
    with _stoppable("merge", out_root):
        return _merge(shard_dirs, out_root)


def _merge(shard_dirs: list[str | Path], out_root: str | Path) -> Path:
    if not shard_dirs:
        raise BuildError("merge needs at least one shard directory")
    manifests = [(Path(d), read_manifest(d)) for d in shard_dirs]
    first = manifests[0][1]
    same = ("bundle", "toolchain", "source_fingerprint", "plan_fingerprint", "spec", "targets", "resolution")
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
    built = {(r["arch"], r["key"]) for r in records}
    arch_of = {t["name"]: t["arch"] for t in manifest["targets"]}
    for raw in manifest["resolution"]:  # every row must find its kernels before the bundle is replaced
        for launch in raw["launches"]:
            missing = [d for d in launch["kernels"].values() if (arch_of[raw["profile"]], d) not in built]
            if missing:
                raise BuildError(f"the shards hold no {arch_of[raw['profile']]} kernel {missing[0][:12]} that "
                                 f"{raw['problem']} needs for M {launch['m_min']}..{launch['m_max']}: a shard is "
                                 "missing or from another build")
    final = Path(out_root) / first["bundle"]
    write_bundle(final, manifest, cubins)
    verify_bundle(final)
    return final
