"""Reading a kernel's PTX `.entry`: parameter list and launch directives.

The build compares the parameters with the family's declared signature
(count, size, alignment) and fails on any difference, because the runtime
packs arguments from the declaration alone.  PTX parameters are named by
position (`<symbol>_param_N`), so the names are checked on the Python side
(abi.check_parameter_names).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cuteaot.runtime.abi import Signature
from cuteaot.runtime.errors import AbiMismatchError, BuildError

_SCALAR_SIZES = {"8": 1, "16": 2, "32": 4, "64": 8}
_PARAM = re.compile(
    r"\.param\s+(?:\.(?P<stype>[usbf])(?P<bits>8|16|32|64)(?:\s+\.ptr(?:\s+\.\w+)*)?"
    r"|\.align\s+(?P<align>\d+)\s+\.b8)\s+(?P<name>[\w$]+)(?:\[(?P<count>\d+)\])?"
)


@dataclass(frozen=True)
class PtxParam:
    name: str
    size: int
    align: int


@dataclass(frozen=True)
class PtxEntry:
    symbol: str
    params: tuple[PtxParam, ...]
    reqntid: tuple[int, int, int] | None
    maxntid: tuple[int, int, int] | None
    minnctapersm: int | None


def _dims(text: str) -> tuple[int, int, int]:
    values = [int(x) for x in text.split(",")]
    return tuple(values + [1] * (3 - len(values)))  # type: ignore[return-value]


def parse_entry(ptx: str, symbol: str) -> PtxEntry:
    """The `.entry <symbol>(...)` of a PTX module with its directives."""
    head = re.search(r"\.entry\s+" + re.escape(symbol) + r"\s*\((?P<params>[^)]*)\)(?P<dirs>[^{]*)\{", ptx)
    if head is None:
        raise BuildError(f"PTX has no .entry {symbol}")
    params = []
    for chunk in filter(None, (c.strip() for c in head["params"].split(","))):
        m = _PARAM.search(chunk)
        if m is None:
            raise BuildError(f"cannot read PTX parameter {chunk!r} of {symbol}")
        if m["bits"]:
            size = _SCALAR_SIZES[m["bits"]]
            params.append(PtxParam(m["name"], size, size))
        else:
            params.append(PtxParam(m["name"], int(m["count"] or 1), int(m["align"])))
    dirs = head["dirs"]
    req = re.search(r"\.reqntid\s+([\d,\s]+)", dirs)
    mx = re.search(r"\.maxntid\s+([\d,\s]+)", dirs)
    mn = re.search(r"\.minnctapersm\s+(\d+)", dirs)
    return PtxEntry(
        symbol,
        tuple(params),
        _dims(req[1]) if req else None,
        _dims(mx[1]) if mx else None,
        int(mn[1]) if mn else None,
    )


def check_abi(entry: PtxEntry, signature: Signature, what: str) -> None:
    """Fail unless the PTX parameters equal the declared signature in count, size and alignment."""
    declared = [(p.name, p.kind.size, p.kind.align) for p in signature.params]
    actual = [(p.size, p.align) for p in entry.params]
    problems = []
    if len(declared) != len(actual):
        problems.append(f"{len(actual)} parameters in PTX, {len(declared)} declared")
    for i, ((name, size, align), got) in enumerate(zip(declared, actual)):
        if (size, align) != got:
            problems.append(f"param {i} ({name}): declared size {size} align {align}, PTX size {got[0]} align {got[1]}")
    if problems:
        raise AbiMismatchError(
            f"{what}: kernel {entry.symbol} does not match its declared signature: " + "; ".join(problems)
            + ". Fix the declaration in cuteaot.runtime.kernels or the kernel's arguments."
        )
