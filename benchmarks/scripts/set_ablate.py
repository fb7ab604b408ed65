"""Write codegen/kernels/w4a16/ablate.py with ABLATE holding some parts, from a copy of the shipped file.

    python3 benchmarks/scripts/set_ablate.py SHIPPED_COPY DST PARTS     # PARTS: "+"-joined, "none" = as shipped

For the build scripts that compile kernels with parts left out (ablate_tile.sh, fence_ab.sh): they copy the
shipped source aside, call this before each build, and move the copy back however the builds end.
"""

import sys

SHIPPED = "ABLATE: frozenset[str] = frozenset()\n"


def main(src: str, dst: str, parts: str) -> None:
    members = ", ".join(repr(p) for p in parts.split("+") if p != "none")
    text = open(src).read()
    if text.count(SHIPPED) != 1:
        raise SystemExit(f"{src}: no single line {SHIPPED.strip()!r} (ABLATE must be the shipped empty set)")
    line = f"ABLATE: frozenset[str] = frozenset({{{members}}})\n" if members else SHIPPED
    open(dst, "w").write(text.replace(SHIPPED, line))
    print(f"== {parts}: ABLATE = {{{members}}}")


if __name__ == "__main__":
    main(*sys.argv[1:])
