"""Kernel parameter signatures and the packed argument buffer used to launch them.

Device kernels take only raw global pointers and 32-bit scalars.  Each kernel
family declares its signature once (in ``cuteaot.runtime.kernels``); the build
checks it against the PTX ``.entry`` that CuTeDSL produced, and the runtime packs
arguments with it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from enum import Enum


class ParamKind(str, Enum):
    PTR = "ptr"  # 64-bit global address
    I32 = "i32"
    F32 = "f32"

    @property
    def size(self) -> int:
        return 8 if self is ParamKind.PTR else 4

    @property
    def align(self) -> int:
        return self.size

    @property
    def ctype(self) -> type:
        return {ParamKind.PTR: ctypes.c_uint64, ParamKind.I32: ctypes.c_int32, ParamKind.F32: ctypes.c_float}[self]


@dataclass(frozen=True)
class Param:
    name: str
    kind: ParamKind
    doc: str  # dtype, shape and layout of what it points to

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind.value, "size": self.kind.size, "align": self.kind.align}


@dataclass(frozen=True)
class Signature:
    params: tuple[Param, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def to_json(self) -> list[dict]:
        return [p.to_json() for p in self.params]

    def matches_json(self, recorded: list[dict]) -> bool:
        return self.to_json() == recorded


class ArgBuffer:
    """Storage for one launch's arguments plus the `void*[]` that cuLaunchKernel reads.

    Built once per launch plan; a launch only overwrites the values.  The driver
    copies the parameters during cuLaunchKernel, so reusing the buffer for the
    next launch (also during CUDA-graph capture) is safe.  Not shared between
    threads: callers keep one per thread.
    """

    __slots__ = ("_slots", "_array", "address")

    def __init__(self, signature: Signature):
        self._slots = [p.kind.ctype() for p in signature.params]
        self._array = (ctypes.c_void_p * len(self._slots))(
            *[ctypes.cast(ctypes.pointer(s), ctypes.c_void_p) for s in self._slots]
        )
        self.address = ctypes.addressof(self._array)

    def set(self, *values: int | float) -> int:
        """Store the values (in signature order); return the `void**` address to launch with."""
        for slot, value in zip(self._slots, values, strict=True):
            slot.value = value
        return self.address
