"""Build robustness without CuTeDSL: a fake compile stands in for `_compile_job` (issue 17, items 3-5, 10).

* a corrupt or half-written cache entry is rebuilt with a warning, never shipped;
* SIGKILL of a build takes its compile workers with it; SIGINT/SIGTERM stop it cleanly;
* concurrent writers of one bundle (processes or threads) leave a bundle that verifies;
* planning prints progress on stderr during a build, never in `cuteaot list`;
* a no-op build does not repeat the spill warning.

The process tests run `_drive` in a child Python (`python -c`), whose spawn-context workers
import this module by name to find `fake_compile`.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import importlib

build_mod = importlib.import_module("cuteaot.codegen.build")  # the package re-exports the function `build`
from cuteaot.codegen.build import INLINE_JOBS, _atomic_write, build, write_bundle
from cuteaot.codegen.cli import main as cli
from cuteaot.runtime.errors import BuildError
from cuteaot.runtime.keys import KernelKey
from cuteaot.runtime.manifest import read_manifest, verify_bundle

ROOT = Path(__file__).resolve().parents[1]
TINY_SPEC = ROOT / "specs" / "tiny.yaml"  # 36 jobs: more than INLINE_JOBS, so a build uses workers
TINY_JOBS = 36
SLEEP_ENV = "CUTEAOT_TEST_FAKE_SLEEP"  # seconds each fake compile sleeps
MARKS_ENV = "CUTEAOT_TEST_FAKE_MARKS"  # directory where each fake compile leaves its pid
SPILL_ENV = "CUTEAOT_TEST_FAKE_SPILL"  # family whose fake kernels report stack use


def fake_cubin(canonical: str, arch: str) -> bytes:
    return hashlib.sha256(f"{canonical}/{arch}".encode()).digest() * 16


def fake_compile(canonical: str, arch: str) -> tuple[dict, bytes]:
    """What `_compile_job` returns, without CuTeDSL: a deterministic cubin per (key, arch)."""
    marks = os.environ.get(MARKS_ENV)
    if marks:
        Path(marks, str(os.getpid())).touch()
    time.sleep(float(os.environ.get(SLEEP_ENV, "0")))
    raw = json.loads(canonical)
    key = KernelKey(raw["family"], raw["version"], raw["facts"])
    spills = 16 if key.family == os.environ.get(SPILL_ENV) else 0
    record = {
        "key": key.digest, "family": key.family, "version": key.version, "facts": dict(key.facts), "arch": arch,
        "symbol": f"kernel_fake_{key.family}_0", "params": [], "block": [256, 1, 1], "dynamic_smem_bytes": 0,
        "static_smem_bytes": 0, "registers": 32, "stack_bytes": spills, "local_bytes": 0,
        "min_blocks_per_sm": None, "compiler": "fake", "compile_seconds": 0.0,
    }
    return record, fake_cubin(canonical, arch)


def _drive(out: str, workers: int, repeat: int = 1, targets: str = "") -> None:
    """Child process: build the tiny spec with the fake compile (through the CLI when repeat == 1)."""
    build_mod._compile_job = fake_compile
    if repeat == 1:
        argv = ["build", str(TINY_SPEC), "--out", out, "-j", str(workers), "-q"]
        sys.exit(cli(argv + (["--targets", targets] if targets else [])))
    for _ in range(repeat):
        build(TINY_SPEC, out, workers=workers, progress=False, targets=targets.split(",") if targets else None)


def _start(out: Path, env: dict, workers: int = 2, repeat: int = 1, targets: str = "",
           new_session: bool = False) -> subprocess.Popen:
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_build_robustness as t; " \
           f"t._drive({str(out)!r}, {workers}, {repeat}, {targets!r})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=new_session)


def _children(pid: int) -> set[int]:
    """Live direct children of `pid`, from /proc."""
    kids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited while we looked
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.add(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    """Running or sleeping; an exited process not yet reaped by its new parent (zombie) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _slow_build(tmp_path: Path, new_session: bool = False) -> tuple[subprocess.Popen, set[int]]:
    """A build whose 2 workers hang in compile; returns it with its child pids once both compile."""
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = _start(tmp_path / "gen", {SLEEP_ENV: "600", MARKS_ENV: str(marks)}, new_session=new_session)
    try:
        _wait_until(lambda: len(list(marks.iterdir())) >= 2 or proc.poll() is not None, 120, "2 compiling workers")
    except AssertionError:
        proc.kill()
        raise
    assert proc.poll() is None, proc.communicate()
    workers = {int(p.name) for p in marks.iterdir()}
    children = _children(proc.pid)  # the workers and the multiprocessing resource tracker
    assert workers <= children and len(children) >= 3
    return proc, children


def _reap(pids: set[int]) -> None:
    """Kill what a failed test left behind (these are our own processes, by pid)."""
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _mark_stale(bundle_dir: Path) -> None:
    """Make an intact bundle look planned by other sources, so a rebuild does not take it as up to date."""
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    manifest["plan_fingerprint"] = "0" * 64
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(build_mod, "_compile_job", fake_compile)
    for env in (SLEEP_ENV, MARKS_ENV, SPILL_ENV):
        monkeypatch.delenv(env, raising=False)


# ---- item 3: corrupt cache entries ----------------------------------------------------------------

def _cache_entries(out: Path) -> list[Path]:
    return sorted((out / ".cache").rglob("*.json"))


def test_corrupt_cache_entries_are_rebuilt_with_a_warning(fake, tmp_path, capsys):
    out = tmp_path / "gen"
    assert len(build(TINY_SPEC, out, workers=1, progress=False).built) == TINY_JOBS
    flipped, truncated, bad_json, no_sum = _cache_entries(out)[:4]
    cubin = flipped.with_suffix(".cubin")
    data = bytearray(cubin.read_bytes())
    data[10] ^= 0x01  # same size, different bytes: only the checksum can tell
    cubin.write_bytes(bytes(data))
    truncated.with_suffix(".cubin").write_bytes(truncated.with_suffix(".cubin").read_bytes()[:7])
    bad_json.write_text(bad_json.read_text()[:20])  # a half-written json
    record = json.loads(no_sum.read_text())
    del record["sha256"]
    no_sum.write_text(json.dumps(record))
    capsys.readouterr()

    (out / "tiny" / "manifest.json").unlink()  # the bundle is written afresh from the cache
    report = build(TINY_SPEC, out, workers=1, progress=False)
    assert len(report.built) == 4 and report.reused == TINY_JOBS - 4
    err = capsys.readouterr().err
    for entry, why in ((flipped, "corrupt"), (truncated, "half-written"), (bad_json, "cannot be read"),
                       (no_sum, "no cubin sha256")):
        assert f"cache entry {entry}" in err and why in err.split(str(entry), 1)[1].splitlines()[0]
    assert len(report.warnings) == 4 and err.count("rebuilding it") == 4
    manifest = verify_bundle(out / "tiny")
    for k in manifest["kernels"]:  # every shipped cubin is what the compile produced, not the damaged copy
        canonical = KernelKey(k["family"], k["version"], k["facts"]).canonical
        assert (out / "tiny" / k["file"]).read_bytes() == fake_cubin(canonical, k["arch"])
    again = build(TINY_SPEC, out, workers=1, progress=False)  # the rebuilt entries are sound again
    assert again.built == [] and again.warnings == [] and again.unchanged


# ---- item 4: workers die with the build; SIGINT/SIGTERM stop it cleanly ----------------------------

def test_sigkill_of_the_build_takes_its_workers_and_tracker_with_it(tmp_path):
    assert TINY_JOBS > INLINE_JOBS
    proc, children = _slow_build(tmp_path)
    try:
        proc.kill()
        proc.wait()
        _wait_until(lambda: not any(_alive(p) for p in children), 10, f"children {sorted(children)} to exit")
    finally:
        _reap(children)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to the process group (Ctrl-C)"])
def test_signal_stops_the_build_cleanly_and_keeps_the_previous_bundle(fake, tmp_path, how):
    out = tmp_path / "gen"
    build(TINY_SPEC, out, workers=1, progress=False)
    _mark_stale(out / "tiny")  # a bundle of other planner sources: the next build must redo it ...
    before = (out / "tiny" / "manifest.json").read_bytes()
    for entry in _cache_entries(out):
        entry.unlink()  # ... and compile
    proc, children = _slow_build(tmp_path, new_session=True)
    try:
        if how == "SIGTERM":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        _wait_until(lambda: not any(_alive(p) for p in children), 10, f"children {sorted(children)} to exit")
    finally:
        _reap(children | {proc.pid})
    name = "SIGTERM" if how == "SIGTERM" else "SIGINT"
    assert proc.returncode == 1, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and f"interrupted by {name}" in err
    assert (out / "tiny" / "manifest.json").read_bytes() == before
    verify_bundle(out / "tiny")
    assert not list(out.glob(".tiny.staging-*")) and not list(out.glob(".tiny.old-*"))


class _InterruptedMidway(dict):
    """Cubins whose iteration is interrupted after the first file (Ctrl-C while staging)."""

    def items(self):
        items = iter(super().items())
        yield next(items)
        raise KeyboardInterrupt


def test_interrupted_write_removes_its_staging_and_keeps_the_bundle(fake, tmp_path):
    out = tmp_path / "gen"
    build(TINY_SPEC, out, workers=1, progress=False)
    before = (out / "tiny" / "manifest.json").read_bytes()
    manifest = dict(read_manifest(out / "tiny"), bundle="changed")
    with pytest.raises(KeyboardInterrupt):
        write_bundle(out / "tiny", manifest, _InterruptedMidway({"sm_90a/a.cubin": b"a", "sm_90a/b.cubin": b"b"}))
    assert not list(out.glob(".tiny.staging-*"))
    assert (out / "tiny" / "manifest.json").read_bytes() == before and verify_bundle(out / "tiny")


def test_a_signal_inside_the_bundle_swap_is_held_until_it_ends():
    previous, swapped = signal.getsignal(signal.SIGTERM), []
    with pytest.raises(build_mod._Interrupted) as info:
        with build_mod._signals:
            with build_mod._signals.critical():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler runs here, in the main thread, and must only take note
                swapped.append(True)
    assert swapped == [True] and info.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous  # the build's handlers are gone again


# ---- item 4: concurrent writers -------------------------------------------------------------------

def test_concurrent_cache_writes_from_threads(tmp_path):
    path = tmp_path / "entry.cubin"
    payloads = [bytes([i]) * 4096 for i in range(8)]
    errors = []

    def writer(data: bytes) -> None:
        try:
            for _ in range(100):
                _atomic_write(path, data)
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and path.read_bytes() in payloads and sorted(tmp_path.iterdir()) == [path]


def test_concurrent_bundle_writes_from_threads_take_turns(fake, tmp_path):
    out = tmp_path / "gen"
    build(TINY_SPEC, out, workers=1, progress=False)
    first = read_manifest(out / "tiny")
    cubins = {k["file"]: (out / "tiny" / k["file"]).read_bytes() for k in first["kernels"]}
    variants = [dict(first, description=str(i)) for i in range(2)]  # two different manifests, same cubins
    errors = []

    def writer(manifest: dict) -> None:
        try:
            for _ in range(40):
                write_bundle(out / "tiny", manifest, cubins)
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(m,)) for m in variants]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert read_manifest(out / "tiny") in variants and verify_bundle(out / "tiny")
    assert not list(out.glob(".tiny.staging-*")) and not list(out.glob(".tiny.old-*"))


def test_two_build_processes_racing_into_one_out_dir(tmp_path):
    out = tmp_path / "gen"
    env = {SLEEP_ENV: "0.01"}
    procs = [_start(out, env, workers=1, repeat=15, targets=t) for t in ("h200", "rtx-pro-6000")]
    results = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    manifest = verify_bundle(out / "tiny")
    assert [t["name"] for t in manifest["targets"]] in (["h200"], ["rtx-pro-6000"])
    assert not list(out.glob(".tiny.staging-*")) and not list(out.glob(".tiny.old-*"))


# ---- item 5: planning progress ---------------------------------------------------------------------

FUSED_SPEC = """\
bundle: demo
targets: [h200, rtx-pro-6000]
moe:
  - name: demo-fused
    hidden_size: 512
    intermediate_size: 256
    num_experts: 16
    top_k: 4
    activation: silu
    dtype: bf16
    tokens: [1, 8, 64]
    fused: true
"""


def test_planning_progress_goes_to_stderr_during_a_build_only(fake, tmp_path, capsys):
    spec = tmp_path / "demo.yaml"
    spec.write_text(textwrap.dedent(FUSED_SPEC))
    build(spec, tmp_path / "gen", workers=1, progress=True)
    captured = capsys.readouterr()
    assert "planning demo: problem 1/2 fused demo-fused on h200, 1..64 tokens; " in captured.err
    assert "planning demo: problem 2/2 fused demo-fused on rtx-pro-6000, 1..64 tokens; nothing measured on " \
        "rtx-pro-6000: the rule alone" in captured.err
    assert "planning" not in captured.out
    build(spec, tmp_path / "gen", workers=1, progress=False)
    assert "planning" not in capsys.readouterr().err
    assert cli(["list", str(spec)]) == 0
    listed = capsys.readouterr()
    assert "planning" not in listed.out and listed.err == ""


# ---- item 10: a no-op build is quiet about spills -------------------------------------------------

def test_spill_warning_only_when_the_bundle_changed(fake, tmp_path, monkeypatch):
    monkeypatch.setenv(SPILL_ENV, "moe_topk_sum")
    first = build(TINY_SPEC, tmp_path / "gen", workers=1, progress=False)
    assert first.spills and "warning:" in first.summary() and "spill registers" in first.summary()
    again = build(TINY_SPEC, tmp_path / "gen", workers=1, progress=False)
    text = again.summary()
    assert again.unchanged and "warning:" not in text and len(text.splitlines()) == 1
    assert "unchanged" in text and "0 kernels built, 36 reused" in text and "`cuteaot inspect`" in text


def test_interrupt_message_is_a_build_error(fake, tmp_path, monkeypatch):
    """`build` turns SIGINT/SIGTERM into BuildError, which the CLI prints as one line."""
    def interrupted(*args, **kwargs):
        raise build_mod._Interrupted(signal.SIGINT)

    monkeypatch.setattr(build_mod, "_build", interrupted)
    with pytest.raises(BuildError, match="interrupted by SIGINT"):
        build(TINY_SPEC, tmp_path / "gen")


def test_a_spill_fails_a_build_whose_spec_refuses_spills(fake, tmp_path, monkeypatch):
    spec = tmp_path / "tiny-no-spills.yaml"
    spec.write_text("allow_spills: false\n" + TINY_SPEC.read_text())
    monkeypatch.setenv(SPILL_ENV, "moe_topk_sum")
    with pytest.raises(BuildError, match=r"kernel\(s\) spill registers and tiny-no-spills.yaml sets `allow_spills: false`"):
        build(spec, tmp_path / "gen", workers=1, progress=False)
    assert not (tmp_path / "gen" / "tiny").exists()  # nothing was written
    monkeypatch.delenv(SPILL_ENV)  # kernels that fit their registers: the same spec builds
    assert build(spec, tmp_path / "gen2", workers=1, progress=False).spills == []


def _runtime_imports(top: str, rel: Path) -> set[str]:
    """The runtime modules (paths under runtime/) that one fingerprinted file imports from."""
    import ast

    base = build_mod.CODEGEN_DIR if top == "codegen" else build_mod.RUNTIME_DIR
    found = set()
    for node in ast.walk(ast.parse((base / rel).read_text(), str(rel))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level and top == "runtime":  # relative to the file's package
            package = list(rel.parent.parts)[: len(rel.parent.parts) - (node.level - 1)]
            modules = ([package + node.module.split(".")] if node.module
                       else [package + [alias.name] for alias in node.names])  # from . import x
        elif (node.module or "").startswith("cuteaot.runtime"):
            modules = [node.module.split(".")[2:]]
        else:
            continue
        for parts in modules:
            for candidate in ([Path(*parts).with_suffix(".py")] if parts else []) + [Path(*parts, "__init__.py")]:
                if (build_mod.RUNTIME_DIR / candidate).is_file():
                    found.add(candidate.as_posix())
                    break
    return found


def test_the_compile_fingerprint_covers_every_runtime_module_compiled_code_reads():
    """A cached cubin is reused while the fingerprint is unchanged, so every runtime module that a
    fingerprinted file imports (the weight layouts' constants, the specs' geometry) is fingerprinted
    itself, unless it is listed as launch-side only. runtime/nf3.py, whose pools and masks the NF3
    decode compiles in, was once left out."""
    files = build_mod._source_files()
    covered = {rel.as_posix() for top, rel in files if top == "runtime"}
    for top, rel in files:
        left_out = _runtime_imports(top, rel) - covered - set(build_mod.LAUNCH_ONLY_SOURCES)
        assert not left_out, f"{top}/{rel} imports runtime/{sorted(left_out)}, which the fingerprint does not cover"
    assert "nf3.py" in covered and "weights.py" in covered


def test_planners_change_plans_not_kernels():
    """The planners are outside the compile fingerprint (a planner edit re-plans, compiles nothing), which
    is only sound while no compiled module imports them: every module the fingerprint covers is checked."""
    import ast

    planner_modules = {Path(name).stem for name in build_mod.PLANNER_SOURCES}
    files = build_mod._source_files()
    assert not {rel.as_posix() for top, rel in files if top == "codegen"} & set(build_mod.PLANNER_SOURCES)
    for top, rel in files:
        base = build_mod.CODEGEN_DIR if top == "codegen" else build_mod.RUNTIME_DIR
        tree = ast.parse((base / rel).read_text(), str(rel))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or "", *(a.name for a in node.names)] if isinstance(node, ast.ImportFrom)
                     else [])
            hit = [n for n in names if set(n.split(".")) & planner_modules]
            assert not hit, f"{top}/{rel} imports {hit}: a compiled module may not depend on the planners"
    # and both fingerprints still see a planner edit where it matters: the plan's
    plan_files = [name for top, name in build_mod.PLAN_SOURCES if top == "codegen"]
    assert set(build_mod.PLANNER_SOURCES) <= set(plan_files)


def test_a_rebuild_rewrites_a_damaged_cubin_of_the_same_bundle(fake, tmp_path):
    """The same manifest and a truncated cubin on disk: the bundle is rewritten, not left as 'unchanged'."""
    out = tmp_path / "gen"
    build(TINY_SPEC, out, workers=1, progress=False)
    manifest = read_manifest(out / "tiny")
    cubins = {k["file"]: (out / "tiny" / k["file"]).read_bytes() for k in manifest["kernels"]}
    assert write_bundle(out / "tiny", manifest, cubins) is False  # intact: nothing to do
    damaged = out / "tiny" / manifest["kernels"][0]["file"]
    damaged.write_bytes(b"BAD")
    assert write_bundle(out / "tiny", manifest, cubins) is True
    assert damaged.read_bytes() == cubins[manifest["kernels"][0]["file"]] and verify_bundle(out / "tiny")


def test_a_writer_killed_between_its_renames_leaves_the_previous_bundle_restored(fake, tmp_path):
    """SIGKILL between `final -> .old-<pid>` and `staging -> final` leaves no bundle and the old one aside: the
    next writer puts it back (and then writes), it does not delete the only copy."""
    out = tmp_path / "gen"
    build(TINY_SPEC, out, workers=1, progress=False)
    manifest = read_manifest(out / "tiny")
    cubins = {k["file"]: (out / "tiny" / k["file"]).read_bytes() for k in manifest["kernels"]}
    os.replace(out / "tiny", out / ".tiny.old-99999")  # as the killed writer left it
    assert write_bundle(out / "tiny", manifest, cubins) is False  # restored, and it already is this bundle
    assert verify_bundle(out / "tiny") and not list(out.glob(".tiny.old-*"))


def test_cutedsl_settings_of_the_environment_are_part_of_the_toolchain(monkeypatch):
    """CUTE_DSL_* variables change the cubins (line info, assertions, optimisation level): they key the cache
    and the bundle's up-to-date check through the toolchain."""
    from cuteaot.codegen.build import toolchain

    for name in [n for n in os.environ if n.startswith("CUTE_DSL_")]:
        monkeypatch.delenv(name)
    plain = toolchain()
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    assert toolchain() == dict(plain, **{"env CUTE_DSL_LINEINFO": "1"})
