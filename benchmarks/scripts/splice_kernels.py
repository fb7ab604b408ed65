"""Recompile some kernels of a built bundle from the current sources into a copy of it (an A/B of a kernel change).

    python benchmarks/scripts/splice_kernels.py BUNDLE OUT [--where FACT=VALUE ...] [--key PREFIX ...]
                                                [--patch DIR] [-j 2]

A kernel-source change invalidates every cached kernel (`moe-models` takes ~8 minutes to rebuild on two cores),
while an A/B usually needs only the kernels it changes, at the points it measures.  This copies BUNDLE to OUT and
recompiles there the kernels selected by `--where` (facts equal to Python literals, all of them, e.g.
`mainloop='wgmma' moe_block_size=128`; `family` and `arch` count as facts) and `--key` (key prefixes: one of them),
replacing their cubins
and manifest records.  The resolution table stays BUNDLE's, so OUT serves the same plans with the changed kernels:
`benchmarks.compare_layer --base BUNDLE --new x=OUT`.  Its fingerprints are marked spliced, so `cuteaot build`
never takes OUT for a build of its spec.  `--patch DIR` also writes what differs from BUNDLE (the manifest and
the changed cubins) for carrying to the GPU machine alone: there, copy BUNDLE and then DIR over the copy.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def _compile(record: dict) -> tuple[dict, bytes]:
    """(manifest record, cubin) of the kernel `record` names, compiled from the sources `cuteaot` imports now (the
    checkout the editable install points at)."""
    from cuteaot.codegen.compile import compile_kernel
    from cuteaot.runtime.keys import KernelKey

    compiled = compile_kernel(KernelKey(record["family"], record["version"], record["facts"]), record["arch"])
    return compiled.record, compiled.cubin


def _where(assignments: list[str]) -> dict:
    out = {}
    for text in assignments:
        name, sep, literal = text.partition("=")
        if not sep:
            raise SystemExit(f"--where {text!r}: expected FACT=VALUE")
        try:
            out[name] = ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--where {text!r}: VALUE must be a Python literal (quote strings)") from None
    return out


def selected(kernels: list[dict], where: dict, keys: list[str]) -> list[dict]:
    """The records that match every `where` fact (family and arch count as facts) and whose key starts with one of
    `keys`, each condition where given (one of them must be)."""
    if not where and not keys:
        raise SystemExit("select kernels with --where and / or --key")

    def matches(record):
        facts = {**record["facts"], "family": record["family"], "arch": record["arch"]}
        return (all(facts.get(name) == value for name, value in where.items())
                and (not keys or any(record["key"].startswith(k) for k in keys)))

    return [r for r in kernels if matches(r)]


def splice(bundle: Path, out: Path, where: dict, keys: list[str], jobs: int = 2, patch: Path | None = None,
           compile_fn=_compile) -> list[tuple[str, str, str]]:
    """Write OUT (and the patch); (key, old sha256, new sha256) of every recompiled kernel."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    chosen = selected(manifest["kernels"], where, keys)
    if not chosen:
        raise SystemExit(f"no kernel of {bundle} matches --where {where} --key {keys}")
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            compiled = list(pool.map(compile_fn, chosen))
    else:
        compiled = [compile_fn(r) for r in chosen]
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(bundle, out)
    changes = []
    for record, (fresh, cubin) in zip(chosen, compiled):
        old = record["sha256"]
        record.update(fresh, file=record["file"], sha256=hashlib.sha256(cubin).hexdigest(), bytes=len(cubin))
        path = out / record["file"]
        path.unlink()  # (the copy may be read-only, as a bundle's files are)
        path.write_bytes(cubin)
        changes.append((record["key"], old, record["sha256"]))
    for name in ("source_fingerprint", "plan_fingerprint"):
        manifest[name] = f"spliced ({len(chosen)} kernels recompiled over {manifest[name][:16]})"
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if patch is not None:
        if patch.exists():
            shutil.rmtree(patch)
        patch.mkdir(parents=True)
        shutil.copy(out / "manifest.json", patch / "manifest.json")
        changed = {key for key, old, new in changes if old != new}
        for record in chosen:
            if record["key"] in changed:
                (patch / record["file"]).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(out / record["file"], patch / record["file"])
    return changes


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--where", nargs="*", default=[], help="FACT=VALUE (a Python literal); all must hold")
    ap.add_argument("--key", nargs="*", default=[], help="key prefixes")
    ap.add_argument("--patch", type=Path, default=None, help="also write the manifest and the changed cubins here")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    changes = splice(args.bundle, args.out, _where(args.where), args.key, args.jobs, args.patch)
    for key, old, new in changes:
        print(f"{key[:12]} {old[:8]} -> {new[:8]}{'  (unchanged)' if old == new else ''}")
    print(f"{args.out}: {sum(o != n for _, o, n in changes)} of {len(changes)} recompiled kernels changed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
