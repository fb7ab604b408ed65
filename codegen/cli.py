"""`cuteaot` command line: build, list, merge, inspect, verify.

`inspect` and `verify` use only the runtime (no CuTeDSL, no GPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cuteaot.runtime.errors import CuteAotError


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _facts(facts: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in facts.items() if v is not None)


def cmd_build(args) -> int:
    from .build import build

    shard = None
    if args.shard:
        i, _, n = args.shard.partition("/")
        if not (i.isdigit() and n.isdigit()):
            raise SystemExit(f"--shard takes i/N (e.g. 0/4), got {args.shard!r}")
        shard = (int(i), int(n))
    for spec in args.spec:
        targets = args.targets.split(",") if args.targets else None
        report = build(spec, args.out, workers=args.jobs, shard=shard, progress=not args.quiet, targets=targets)
        print(report.summary())
    return 0


def cmd_list(args) -> int:
    from .enumerate import jobs
    from .spec import load_spec

    for path in args.spec:
        spec = load_spec(path)
        by_key: dict[str, tuple] = {}
        for job in jobs(spec):
            by_key.setdefault(job.key.digest, (job.key, []))[1].append(job.arch)
        rows = [[d[:12], k.family, k.version, " ".join(a), _facts(k.facts)] for d, (k, a) in by_key.items()]
        print(f"{spec.bundle}: {len(by_key)} specializations, {sum(len(a) for _, a in by_key.values())} kernels")
        print(_table(["key", "family", "v", "archs", "facts"], rows))
    return 0


def cmd_merge(args) -> int:
    from .build import merge

    print(f"merged {len(args.shards)} shards into {merge(args.shards, args.out)}")
    return 0


def cmd_inspect(args) -> int:
    from cuteaot.runtime.manifest import read_manifest

    m = read_manifest(args.bundle)
    print(f"bundle {m['bundle']}  schema {m['schema_version']}  spec {m['spec']['file']} ({m['spec']['sha256'][:12]})")
    print("toolchain: " + ", ".join(f"{k} {v}" for k, v in m["toolchain"].items()))
    print("targets: " + ", ".join(f"{t['name']} ({t['arch']}, {t['sm_count']} SMs)" for t in m["targets"]))
    for arch in sorted({k["arch"] for k in m["kernels"]}):
        ks = [k for k in m["kernels"] if k["arch"] == arch]
        print(f"\n{arch}: {len(ks)} kernels, {sum(k['bytes'] for k in ks) / 1024:.0f} KiB")
        rows = [
            [
                k["key"][:12], k["family"], "x".join(map(str, k["block"])), k["dynamic_smem_bytes"],
                k["registers"], k.get("stack_bytes", "?"), k["bytes"], _facts(k["facts"]), k["symbol"][:48],
            ]
            for k in ks
        ]
        print(_table(["key", "family", "block", "smem", "regs", "stack", "bytes", "facts", "symbol"], rows))
    return 0


def cmd_verify(args) -> int:
    from cuteaot.runtime.manifest import verify_bundle

    m = verify_bundle(args.bundle)
    print(f"{args.bundle}: OK — schema {m['schema_version']}, {len(m['kernels'])} cubins match their sha256, "
          f"{len(m['resolution'])} resolution rows resolve")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cuteaot", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="compile spec(s) into generated/<bundle>")
    p.add_argument("spec", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("generated"), help="output root (default: generated)")
    p.add_argument("--jobs", "-j", type=int, default=None, help="worker processes (default: CPU count)")
    p.add_argument("--shard", help="build only shard i of N (i/N); join with `cuteaot merge`")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument("--targets", help="build only these of the spec's device profiles (comma-separated names)")
    p.set_defaults(run=cmd_build)
    p = sub.add_parser("list", help="print the specializations a spec enumerates")
    p.add_argument("spec", nargs="+", type=Path)
    p.set_defaults(run=cmd_list)
    p = sub.add_parser("merge", help="join shard bundles into one")
    p.add_argument("shards", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("generated"))
    p.set_defaults(run=cmd_merge)
    p = sub.add_parser("inspect", help="table of a bundle's kernels per arch")
    p.add_argument("bundle", type=Path)
    p.set_defaults(run=cmd_inspect)
    p = sub.add_parser("verify", help="check a bundle's schema and checksums (no GPU needed)")
    p.add_argument("bundle", type=Path)
    p.set_defaults(run=cmd_verify)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except CuteAotError as exc:
        print(f"cuteaot {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
