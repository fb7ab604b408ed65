"""Canonical specialization keys.

A key is a kernel family, its version and the facts that change the generated
code, as plain JSON values.  The canonical text is sorted, compact JSON; its
sha256 names the cubin.  The same facts give the same key on any machine.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar, Mapping, Optional, Union

from .errors import BadInputError

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


class SpecKey:
    """`key()` and `from_facts` of a frozen spec dataclass, derived from its fields once.

    Every dataclass field is a fact under its own name (an Enum by its value).  A family
    adds the constants its kernels bake in without a field in `CONSTANT_FACTS` (e.g. the
    vector width), and names in `KEY_OMITS_NONE` the optional fields left out of the key
    while None (a field added later, so the keys that existed before keep their digests).
    `from_facts` turns enum values back into the field's Enum and ignores the constants:
    a key whose constants differ is not a current key, which `spec.key() != key` shows.
    """

    FAMILY: ClassVar[str]
    VERSION: ClassVar[int]
    CONSTANT_FACTS: ClassVar[Mapping[str, Fact]] = {}
    KEY_OMITS_NONE: ClassVar[frozenset[str]] = frozenset()

    def key(self) -> KernelKey:
        facts: dict[str, Fact] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None and f.name in self.KEY_OMITS_NONE:
                continue
            facts[f.name] = value.value if isinstance(value, Enum) else value
        facts.update(self.CONSTANT_FACTS)
        return KernelKey(self.FAMILY, self.VERSION, facts)

    @classmethod
    def from_facts(cls, facts: Mapping[str, Fact]):
        enums = _field_enums(cls)
        unknown = sorted(set(facts) - set(enums) - set(cls.CONSTANT_FACTS))
        missing = sorted(set(_required_fields(cls)) - set(facts))
        if unknown or missing:
            raise BadInputError(
                f"{cls.FAMILY} facts must name the fields of {cls.__name__} {sorted(enums)} (and the constants "
                f"{sorted(cls.CONSTANT_FACTS)}); unknown {unknown}, missing {missing}. Rebuild the key with this version."
            )
        values = {}
        for name, enum in enums.items():
            if name in facts:
                value = facts[name]
                values[name] = enum(value) if enum is not None and value is not None else value
        return cls(**values)


def _enum_of(annotation) -> Optional[type]:
    """The Enum class of a field annotated `E`, `Optional[E]` or `E | None`; None for other types."""
    if isinstance(annotation, type):
        return annotation if issubclass(annotation, Enum) else None
    if typing.get_origin(annotation) in (Union, types.UnionType):
        enums = [a for a in typing.get_args(annotation) if a is not type(None) and _enum_of(a)]
        return enums[0] if len(enums) == 1 else None
    return None


@functools.cache
def _field_enums(cls: type) -> dict[str, Optional[type]]:
    hints = typing.get_type_hints(cls)
    return {f.name: _enum_of(hints[f.name]) for f in dataclasses.fields(cls)}


@functools.cache
def _required_fields(cls: type) -> tuple[str, ...]:
    return tuple(
        f.name for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
