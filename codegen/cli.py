"""`cuteaot` command line: spec, build, list, merge, inspect, verify.

`inspect` and `verify` use only the runtime's dependencies (no CuTeDSL, no PyYAML, no GPU),
so they run on a serving machine; this module imports nothing else at module level.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from cuteaot.runtime.errors import CuteAotError
from cuteaot.runtime.manifest import SCHEMA_VERSION

from . import CODEGEN_EXTRA_MODULES

DESCRIPTION = """\
Ahead-of-time CuTeDSL kernels for LLM serving.  A spec (YAML) lists the kernels of your MoE layers;
`build` compiles them into a bundle (cubins + manifest.json) on a machine with or without a GPU, and
the runtime (cuteaot.runtime) serves it with no compiler.  Typical flow:

  cuteaot spec path/to/model -o specs/my-model.yaml     # a spec from the model's config.json
  cuteaot build specs/my-model.yaml --targets h200      # -> generated/my-model
  cuteaot inspect --plans generated/my-model            # what each token count launches
  cuteaot verify generated/my-model                     # checksums; runs on the serving machine too
"""

LINE_WIDTH = 160  # `inspect` keeps its lines within this; `-v` prints the long facts wrapped
PLANS_HEADING = "plans (what each token range launches, decided when the bundle was built):"


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _facts(facts: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in facts.items() if v is not None)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _jobs(text: str) -> int:
    """argparse type of --jobs: a worker count of at least one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of worker processes (1 or more), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a number of worker processes (1 or more), got {value}; leave --jobs out to use every CPU"
        )
    return value


def _shard(text: str) -> tuple[int, int]:
    """argparse type of --shard: `i/N` with 0 <= i < N."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected i/N (shard i of N, e.g. 0/4), got {text!r}")
    index, count = int(match[1]), int(match[2])
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"expected i/N with 0 <= i < N (e.g. 0/4 ... 3/4), got {text!r}")
    return index, count


def _arch_order(arch: str) -> tuple[int, str]:
    """sm_90a < sm_100a < sm_120a: by compute capability, not by text."""
    match = re.fullmatch(r"sm_(\d+)(a?)", arch)  # read_manifest has checked this pattern
    return int(match[1]), match[2]


def _version() -> str:
    try:
        package = metadata.version("cuteaot")
    except metadata.PackageNotFoundError:
        package = "(not installed as a package: `pip install -e .`)"
    return f"cuteaot {package}, manifest schema_version {SCHEMA_VERSION}"


def cmd_build(args) -> int:
    from .build import build

    for spec in args.spec:
        targets = [t.strip().lower() for t in args.targets.split(",")] if args.targets else None
        report = build(spec, args.out, workers=args.jobs, shard=args.shard, progress=not args.quiet, targets=targets)
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


def _kernel_rows(kernels: list[dict], width: int) -> tuple[list[str], list[list], bool]:
    """The per-arch table and whether any facts were cut so that lines stay within `width`."""
    headers = ["key", "family", "block", "smem", "regs", "stack", "bytes", "facts"]
    rows = [
        [
            k["key"][:12], k["family"], "x".join(map(str, k["block"])), k["dynamic_smem_bytes"],
            k["registers"], k.get("stack_bytes", "?"), k["bytes"], _facts(k["facts"]),
        ]
        for k in kernels
    ]
    others = _table(headers[:-1], [r[:-1] for r in rows]).splitlines()
    room = max(width - max(map(len, others)) - 2, len("facts"))
    cut = any(len(r[-1]) > room for r in rows)
    return headers, [r[:-1] + [_clip(r[-1], room)] for r in rows], cut


def _kernel_details(kernel: dict, width: int) -> str:
    """Everything `-v` adds about one kernel, wrapped to `width`."""
    indent = " " * 4
    lines = [f"{kernel['key'][:12]}  {kernel['family']} v{kernel['version']}  {kernel['file']}"]
    for label, text in (("facts", _facts(kernel["facts"])), ("symbol", kernel["symbol"])):
        lines += textwrap.wrap(
            f"{label}: {text}", width, initial_indent=indent, subsequent_indent=indent * 2,
            break_long_words=True, break_on_hyphens=False,
        )
    return "\n".join(lines)


def cmd_inspect(args) -> int:
    from cuteaot.runtime.manifest import read_manifest

    m = read_manifest(args.bundle)
    spec = m["spec"]
    print(f"bundle {m['bundle']}  schema {m['schema_version']}  spec {spec.get('file', '?')} "
          f"({str(spec.get('sha256', '?'))[:12]})")
    if m.get("shard") is not None:
        print(f"shard {m['shard']['index']} of {m['shard']['count']} (join the shards with `cuteaot merge`)")
    print("toolchain: " + ", ".join(f"{k} {v}" for k, v in m["toolchain"].items()))
    print("targets: " + ", ".join(f"{t['name']} ({t['arch']}, {t['sm_count']} SMs)" for t in m["targets"]))
    any_cut = False
    for arch in sorted({k["arch"] for k in m["kernels"]}, key=_arch_order):
        ks = [k for k in m["kernels"] if k["arch"] == arch]
        print(f"\n{arch}: {len(ks)} kernels, {sum(k['bytes'] for k in ks) / 1024:.0f} KiB")
        headers, rows, cut = _kernel_rows(ks, LINE_WIDTH)
        print(_table(headers, rows))
        any_cut |= cut
        if args.verbose:
            print("\n" + "\n".join(_kernel_details(k, LINE_WIDTH) for k in ks))
    if any_cut and not args.verbose:
        print("\n(facts cut to fit; `cuteaot inspect -v` prints every kernel's facts, file and symbol)")
    if args.plans:
        print(f"\n{PLANS_HEADING}\n")
        text, found = _plans(m, args.problem)
        print(text)
        return 0 if found else 1
    return 0


def _entry_title(entry, arch: str) -> str:
    """A resolution entry's problem, target and variant: the shape, then dtype, activation and every option
    that differs from its default (MoeLayerFacts'), or for a GEMM its weight layout and scale format."""
    from dataclasses import MISSING, fields

    f = entry.to_json()["facts"]
    where = f"{entry.problem} on {entry.profile} ({arch})"
    if entry.op != "moe_layer":
        return (f"{where}: {entry.op} N {f['n']} K {f['k']}, {f['num_experts']} experts top-{f['top_k']}, "
                f"{f['dtype']} {f['layout']} {f['scale_format']}")
    defaults = {d.name: getattr(d.default, "value", d.default) for d in fields(entry.facts) if d.default is not MISSING}
    options = [k if v is True else f"{k}={v}" for k, v in f.items() if k in defaults and v != defaults[k]]
    return (f"{where}: H {f['hidden_size']} I {f['intermediate_size']}, {f['num_experts']} experts "
            f"top-{f['top_k']}, {f['dtype']} {f['activation']}" + "".join(f" {o}" for o in options))


def _plan_text(launch, op: str, specs: dict) -> str:
    """What one launch range of the table runs (runtime.moe.describe_launch for MoE layers)."""
    from cuteaot.runtime.moe import describe_launch

    if op == "moe_layer":
        return describe_launch(launch, specs)
    routes = "direct routes" if launch.direct else f"b{launch.route_block}"
    return f"{routes} grid {launch.grid_x}: " + "; ".join(
        f"{variant} {s.mainloop.value} {s.tile_n}x{s.tile_k}" for variant, s in specs.items())


def _launch_text(launch, op: str, arch: str, records: dict, shard) -> str:
    """_plan_text of one launch, or what keeps it from being described (a kernel another shard holds, a
    family this cuteaot does not know, kernels that do not fit their roles)."""
    from cuteaot.runtime.kernels import FAMILIES as families

    found = {role: records.get((arch, digest)) for role, digest in launch.kernels.items()}
    missing = [launch.kernels[role][:12] for role, r in found.items() if r is None]
    if missing:
        return f"kernel {missing[0]} is not in this {'shard' if shard else 'bundle'}"
    unknown = sorted({r["family"] for r in found.values() if r["family"] not in families})
    if unknown:
        return f"kernel family {unknown[0]!r} is unknown to this cuteaot"
    try:
        specs = {role: families[r["family"]].from_facts(r["facts"]) for role, r in found.items()}
        return _plan_text(launch, op, specs)
    except (AttributeError, KeyError, TypeError, ValueError, CuteAotError) as exc:
        return f"the table's kernels do not fit this launch ({type(exc).__name__}: {exc})"


def _plans(m: dict, problems: list[str] | None) -> tuple[str, bool]:
    """Per resolution entry (optionally only `problems`), which plan each token range runs; and whether every
    problem asked for has entries."""
    from cuteaot.runtime.resolution import Entry

    arches = {t["name"]: t["arch"] for t in m["targets"]}
    records = {(k["arch"], k["key"]): k for k in m["kernels"]}
    blocks = []
    for entry in map(Entry.from_json, m["resolution"]):
        if problems and entry.problem not in problems:
            continue
        arch = arches.get(entry.profile, "?")
        rows = []
        for launch in entry.launches:
            tokens = str(launch.m_min) if launch.m_min == launch.m_max else f"{launch.m_min}-{launch.m_max}"
            rows.append([tokens, _launch_text(launch, entry.op, arch, records, m.get("shard"))])
        blocks.append(_entry_title(entry, arch) + "\n" + _table(["tokens", "plan"], rows))
    known = sorted({r["problem"] for r in m["resolution"]})
    unknown = [p for p in problems or () if p not in known]
    if unknown or not blocks:
        wanted = f" for {', '.join(unknown)}" if unknown else ""
        blocks.append(f"no resolution entries{wanted} (the bundle's problems: {', '.join(known) or 'none'})")
    return "\n\n".join(blocks), not unknown


def cmd_spec(args) -> int:
    from .from_config import notes_of, write_spec

    text, written = write_spec(args.model, args.out, name=args.name, dtype=args.dtype, targets=tuple(args.targets),
                               tp=tuple(args.tp or ()), ep=args.ep, weights=args.weights, max_tokens=args.max_tokens)
    if written is None:
        print(text, end="")
    else:
        for note in notes_of(text):  # what the header says about the checkpoint, where the user sees it
            print(f"note: {note}", file=sys.stderr)
        print(f"wrote {written}; build it with: cuteaot build {written}")
    return 0


def _names(choices) -> Callable[[str], list[str]]:
    """argparse type of a comma-separated list of names from `choices` (any case)."""
    def parse(text: str) -> list[str]:
        names = [n.strip().lower() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected names from {sorted(choices)}, got {text!r}")
        return names
    return parse


def _ints(text: str) -> list[int]:
    """argparse type of a comma-separated list of positive integers."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas (e.g. 1,2,4), got {text!r}")
    return values


def cmd_verify(args) -> int:
    from cuteaot.runtime.manifest import verify_bundle

    m = verify_bundle(args.bundle)
    shard = m.get("shard")
    table = (f"{len(m['resolution'])} resolution entries resolve" if shard is None else
             f"shard {shard['index']} of {shard['count']}: its resolution table is checked by `cuteaot merge`")
    print(f"{args.bundle}: OK — schema {m['schema_version']}, {len(m['kernels'])} cubins match their sha256, {table}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cuteaot", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="compile spec(s) into generated/<bundle>")
    p.add_argument("spec", nargs="+", type=Path, help="spec YAML file(s), e.g. specs/qwen3-30b-a3b.yaml")
    p.add_argument("--out", type=Path, default=Path("generated"), help="output root (default: generated)")
    p.add_argument("--jobs", "-j", type=_jobs, default=None, help="worker processes, 1 or more (default: CPU count)")
    p.add_argument("--shard", type=_shard, help="build only shard i of N (i/N, 0 <= i < N); join with `cuteaot merge`")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument("--targets", help="build only these of the spec's device profiles (comma-separated, e.g. h200)")
    p.set_defaults(run=cmd_build)
    p = sub.add_parser("list", help="print the specializations a spec enumerates")
    p.add_argument("spec", nargs="+", type=Path, help="spec YAML file(s)")
    p.set_defaults(run=cmd_list)
    p = sub.add_parser("merge", help="join shard bundles into one")
    p.add_argument("shards", nargs="+", type=Path, help="the bundles of `build --shard 0/N` ... `N-1/N`")
    p.add_argument("--out", type=Path, default=Path("generated"), help="output root (default: generated)")
    p.set_defaults(run=cmd_merge)
    p = sub.add_parser("inspect", help="table of a bundle's kernels per arch")
    p.add_argument("bundle", type=Path, help="a bundle folder, e.g. generated/qwen3-30b-a3b")
    p.add_argument("--verbose", "-v", action="store_true", help="also every kernel's full facts, file and symbol")
    p.add_argument("--plans", action="store_true",
                   help="also the resolution table: the plan (path, main loop, tiles, grid) of each token range")
    p.add_argument("--problem", action="append", metavar="NAME",
                   help="with --plans, only this problem's entries (repeatable)")
    p.set_defaults(run=cmd_inspect)
    from cuteaot.runtime.devices import PROFILES
    from cuteaot.runtime.types import DType, WeightFormat

    from .from_config import DEFAULT_MAX_TOKENS, DEFAULT_TARGETS

    p = sub.add_parser("spec", help="write the spec of a Hugging Face MoE model from its config.json")
    p.add_argument("model", type=Path, help="the model's directory (its config.json) or a config file")
    p.add_argument("--out", "-o", type=Path, help="write the spec here (default: print it)")
    p.add_argument("--name", help="bundle and problem name (default: the model directory's name)")
    p.add_argument("--targets", type=_names(PROFILES), default=list(DEFAULT_TARGETS),
                   help=f"device profiles, comma-separated (default: {','.join(DEFAULT_TARGETS)})")
    p.add_argument("--tp", type=_ints, help="tensor-parallel degrees to build, e.g. 1,2,4 (problems <name>-tp<N>)")
    p.add_argument("--ep", action="store_true", help="also the expert-parallel (expert_map) layers")
    p.add_argument("--weights", choices=[w.value for w in WeightFormat if w is not WeightFormat.NF3],
                   default=WeightFormat.NVFP4.value,
                   help="nvfp4 (repacked at load, default) or modelopt / modelopt_w31 (read as stored)")
    p.add_argument("--dtype", choices=[d.value for d in DType], help="activations' dtype (default: the config's)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"largest token bucket (default: {DEFAULT_MAX_TOKENS})")
    p.set_defaults(run=cmd_spec)
    p = sub.add_parser("verify", help="check a bundle's schema and checksums (no GPU needed)")
    p.add_argument("bundle", type=Path, help="a bundle folder, e.g. generated/qwen3-30b-a3b")
    p.set_defaults(run=cmd_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "problem", None) and not args.plans:
        parser.error("--problem selects entries of --plans; add --plans")
    try:
        code = args.run(args)
        sys.stdout.flush()  # a reader that left shows up here, not in the interpreter's last flush
        return code
    except BrokenPipeError:  # `cuteaot inspect ... | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CuteAotError as exc:
        print(f"cuteaot {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:  # build/list/merge on a machine without the codegen extra
        if exc.name is None or exc.name.split(".")[0] not in CODEGEN_EXTRA_MODULES:
            raise
        print(
            f"cuteaot {args.command}: needs the codegen extra (module {exc.name!r} is not installed): "
            "pip install 'cuteaot[codegen]'; `verify` and `inspect` work without it",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
