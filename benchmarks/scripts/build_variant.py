"""Build a bundle with planner constants set, for an A/B (`compare_layer --base A --new B`).

    python benchmarks/scripts/build_variant.py SPEC OUT [module.NAME=VALUE ...]

Each assignment sets a constant of a module under cuteaot.codegen.kernels.w4a16 (`VALUE` a Python
literal, e.g. `planning.WGMMA_WIDE_MIN_ROUTES=256` or `fused_planning.FUSED_GATED_EPILOGUE=False`) in
this process before the build plans anything, so the bundle's resolution table, and the kernels it
names, follow the changed rule.  Constants read while compiling (in the build's worker processes) are
not affected: change those in the source.  Only h200 is built (the bench bundles run there).  The
assignments are part of the bundle's plan fingerprint, so building a variant over another build of the
spec (a copy made to reuse its cubins) plans again instead of finding that bundle up to date.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import sys

PACKAGE = "cuteaot.codegen.kernels.w4a16"


def apply(assignments: list[str]) -> None:
    """Set each `module.NAME=VALUE`; an unknown module or constant, or a value that is not a literal, is an error."""
    for assignment in assignments:
        target, sep, literal = assignment.partition("=")
        module_name, _, name = target.rpartition(".")
        if not sep or not module_name:
            raise SystemExit(f"{assignment!r}: expected module.NAME=VALUE")
        module = importlib.import_module(f"{PACKAGE}.{module_name}")
        if not hasattr(module, name):
            raise SystemExit(f"{module.__name__} has no constant {name}")
        try:
            value = ast.literal_eval(literal)
        except (ValueError, SyntaxError) as exc:
            raise SystemExit(f"{assignment!r}: VALUE must be a Python literal ({exc})") from None
        setattr(module, name, value)


def fingerprint_with(assignments: list[str]) -> None:
    """Make the build's plan fingerprint cover `assignments` (the planner sources alone do not show them)."""
    build = importlib.import_module("cuteaot.codegen.build")  # (the package's `build` is the function)
    plain = build.plan_fingerprint
    if assignments:
        build.plan_fingerprint = lambda: hashlib.sha256("\0".join([plain(), *assignments]).encode()).hexdigest()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    from cuteaot.codegen import cli

    apply(argv[2:])
    fingerprint_with(argv[2:])
    return cli.main(["build", argv[0], "--out", argv[1], "-j", "2", "--targets", "h200"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
