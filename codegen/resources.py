"""Registers, stack and shared memory of a compiled kernel, read from its cubin.

Uses `cuobjdump --dump-resource-usage` (PyPI `nvidia-cuda-cuobjdump`).  The
cubin does not keep ptxas's spill counters; spilled registers live in the
stack frame, so `stack_bytes == 0` and `local_bytes == 0` mean no spills.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cuteaot.runtime.errors import BuildError


@dataclass(frozen=True)
class Resources:
    registers: int
    stack_bytes: int
    local_bytes: int
    static_smem_bytes: int


def cuobjdump_path() -> str:
    for base in map(Path, sys.path):
        candidate = base / "nvidia" / "cu13" / "bin" / "cuobjdump"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("cuobjdump")
    if found is None:
        raise BuildError("cuobjdump not found: `pip install nvidia-cuda-cuobjdump` (part of cuteaot[codegen])")
    return found


def _cuobjdump(cubin: bytes, option: str, what: str) -> str:
    """What `cuobjdump <option>` prints for a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([cuobjdump_path(), option, f.name], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"cuobjdump failed on {what}: {proc.stderr.strip()}")
    return proc.stdout


def read_sass(cubin: bytes) -> str:
    """The cubin's SASS (`cuobjdump -sass`), for checks of what ptxas made of a kernel."""
    return _cuobjdump(cubin, "-sass", "a cubin")


# PTX that keeps wgmma groups in flight (`wgmma.wait_group N`, N >= 1), and the SASS wait that shows they stay
# in flight: ptxas, short of registers or facing a wgmma in divergent code (warnings C7510-C7520, which CuTeDSL
# does not pass on), instead waits for every group right after it is issued (`WARPGROUP.DEPBAR.LE gsb0, 0x0`
# everywhere): correct, and the main loop then runs one MMA at a time.
_KEEPS_GROUPS_IN_FLIGHT = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+[1-9]")
_WAITS_WITH_GROUPS_IN_FLIGHT = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x[1-9a-f]")


def wgmma_serialized(ptx: str, cubin: bytes) -> bool:
    """True if the PTX leaves wgmma groups running but ptxas made every wait wait for all of them."""
    return bool(_KEEPS_GROUPS_IN_FLIGHT.search(ptx)) and not _WAITS_WITH_GROUPS_IN_FLIGHT.search(read_sass(cubin))


def read_resources(cubin: bytes, symbol: str) -> Resources:
    listing = _cuobjdump(cubin, "--dump-resource-usage", symbol)
    block = re.search(r"Function " + re.escape(symbol) + r":\s*\n\s*(?P<line>[^\n]+)", listing)
    if block is None:
        raise BuildError(f"cuobjdump lists no resource usage for {symbol}")
    fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", block["line"]))
    return Resources(
        registers=int(fields["REG"]),
        stack_bytes=int(fields["STACK"]),
        local_bytes=int(fields["LOCAL"]),
        static_smem_bytes=int(fields["SHARED"]),
    )
