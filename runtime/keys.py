"""Canonical specialization keys.

A key is a kernel family, its version and the facts that change the generated
code, as plain JSON values.  The canonical text is sorted, compact JSON; its
sha256 names the cubin.  The same facts give the same key on any machine.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Mapping, Union

Fact = Union[str, int, float, bool, None]


def _check_fact(name: str, value: object) -> Fact:
    if value is None or isinstance(value, (str, bool, int)):
        return value  # type: ignore[return-value]
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"fact {name!r} must be finite, got {value!r}")
        return value
    raise TypeError(f"fact {name!r} must be a str, int, float, bool or None, got {type(value).__name__}")


@dataclass(frozen=True)
class KernelKey:
    family: str
    version: int
    facts: Mapping[str, Fact] = field(hash=False)

    def __post_init__(self) -> None:
        clean = {str(k): _check_fact(k, v) for k, v in self.facts.items()}
        object.__setattr__(self, "facts", dict(sorted(clean.items())))

    @property
    def canonical(self) -> str:
        return json.dumps(
            {"family": self.family, "version": self.version, "facts": self.facts},
            sort_keys=True,
            separators=(",", ":"),
        )

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical.encode()).hexdigest()

    def __hash__(self) -> int:
        return hash(self.canonical)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KernelKey) and self.canonical == other.canonical

    def describe(self) -> str:
        facts = ", ".join(f"{k}={v}" for k, v in self.facts.items())
        return f"{self.family} v{self.version} ({facts})"
