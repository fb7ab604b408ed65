"""Run a command with codegen/kernels/w4a16/ablate.py's ABLATE holding some parts, then put the shipped line back.

    python3 benchmarks/scripts/set_ablate.py PARTS -- COMMAND...     # PARTS: "+"-joined, "none" = as shipped

For the build scripts that compile kernels with parts left out (ablate_tile.sh, fence_ab.sh). Refuses a source
whose ABLATE is not the shipped empty set (a served bundle must never be built from it), and restores the
source however the command ends; exits with the command's status.
"""

import signal
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "codegen" / "kernels" / "w4a16" / "ablate.py"
SHIPPED = "ABLATE: frozenset[str] = frozenset()\n"


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit(__doc__.strip().splitlines()[2].strip())
    parts, command = argv[0], argv[2:]
    shipped = SOURCE.read_text()
    if shipped.count(SHIPPED) != 1:
        raise SystemExit(f"{SOURCE}: no single line {SHIPPED.strip()!r} (ABLATE must be the shipped empty set)")
    members = ", ".join(repr(p) for p in parts.split("+") if p != "none")
    line = f"ABLATE: frozenset[str] = frozenset({{{members}}})\n" if members else SHIPPED
    print(f"== {parts}: ABLATE = {{{members}}}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a `timeout` or kill): restore below, then exit
    SOURCE.write_text(shipped.replace(SHIPPED, line))
    try:
        return subprocess.call(command)
    finally:
        SOURCE.write_text(shipped)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
