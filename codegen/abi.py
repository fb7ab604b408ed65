"""The build's check of a kernel's Python parameter names against its declared signature.

CuTeDSL names PTX parameters `<symbol>_param_N`, so the PTX check (ptx.check_abi)
sees only count, size and alignment: two pointers swapped pass it.  Names live in
the Python source, so they are checked there, before compiling.  Convention of every
compile target: a `@cute.jit __call__(<declared names>, stream)` that launches
`self.kernel(<declared names>)`, a `@cute.kernel kernel(<declared names>)`.  All
three lists must equal the declaration, in order.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from cuteaot.runtime.abi import Signature
from cuteaot.runtime.errors import AbiMismatchError

_STREAM = "stream"


def parameter_names(function) -> list[str]:
    """Parameter names of a (bound) function, as written in its source."""
    return list(inspect.signature(function).parameters)


def forwarded_names(entry) -> list[str] | None:
    """The argument names `entry.__call__` passes to `self.kernel(...)`; None if it passes other expressions."""
    source = textwrap.dedent(inspect.getsource(type(entry).__call__))
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "kernel"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
            if node.keywords or not all(isinstance(a, ast.Name) for a in node.args):
                return None
            return [a.id for a in node.args]
    return None


def _differences(declared: list[str], actual: list[str] | None) -> str:
    if actual is None:
        return "not a plain list of the parameter names"
    diffs = [f"position {i}: declared {d!r}, takes {a!r}" for i, (d, a) in enumerate(zip(declared, actual)) if d != a]
    if len(declared) != len(actual):
        diffs.append(f"{len(actual)} parameters, {len(declared)} declared")
    return "; ".join(diffs)


def check_parameter_names(entry, signature: Signature, what: str) -> None:
    """Fail unless the compile target's host entry, its launch and its device kernel use the declared names in order."""
    declared = list(signature.names)
    lists = {
        "@cute.jit __call__": (parameter_names(entry.__call__), declared + [_STREAM]),
        "the launch self.kernel(...) in __call__": (forwarded_names(entry), declared),
        "@cute.kernel kernel": (parameter_names(entry.kernel), declared),
    }
    problems = [f"{where}: {_differences(wanted, actual)}" for where, (actual, wanted) in lists.items()
                if actual != wanted]
    if problems:
        raise AbiMismatchError(
            f"{what}: {type(entry).__name__} does not take its declared parameters {declared} in order: "
            + " | ".join(problems)
            + ". The runtime packs launches by these names: fix the kernel's parameter list or the SIGNATURE "
            "declaration in cuteaot.runtime.kernels."
        )
