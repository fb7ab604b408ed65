"""Kernel parameter signatures and the packed argument buffer used to launch them.

Device kernels take only raw global pointers and 32-bit scalars.  Each kernel
family declares its signature once (in ``cuteaot.runtime.kernels``); the build
checks it against the PTX ``.entry`` that CuTeDSL produced, and the runtime packs
arguments with it.
"""

from __future__ import annotations

import ctypes
import functools
import struct
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

    def to_json(self) -> list[dict]:
        return [p.to_json() for p in self.params]

    def matches_json(self, recorded: list[dict]) -> bool:
        return self.to_json() == recorded


_STRUCT_CODES = {ParamKind.PTR: "Q", ParamKind.I32: "i", ParamKind.F32: "f"}


class ArgBuffer:
    """One launch's packed arguments plus the `void*[]` that cuLaunchKernel reads.

    The values live in one byte buffer laid out with each parameter's alignment;
    `kernelParams[i]` points at parameter i inside it.  A launch packs all values
    with a single `struct.pack_into` and passes `address`.  The driver copies the
    parameters during cuLaunchKernel, so the buffer can be reused for the next
    launch (also during CUDA-graph capture).  Not shared between threads: the
    driver call releases the GIL, so callers keep one buffer per thread.
    """

    __slots__ = ("_buffer", "_array", "address", "pack")

    def __init__(self, signature: Signature):
        fmt, offsets, offset = "=", [], 0
        for p in signature.params:
            pad = -offset % p.kind.align
            fmt += "x" * pad + _STRUCT_CODES[p.kind]
            offsets.append(offset + pad)
            offset += pad + p.kind.size
        layout = struct.Struct(fmt)
        self._buffer = ctypes.create_string_buffer(max(layout.size, 1))
        base = ctypes.addressof(self._buffer)
        self._array = (ctypes.c_void_p * len(offsets))(*[base + o for o in offsets])
        self.address = ctypes.addressof(self._array)
        self.pack = functools.partial(layout.pack_into, self._buffer, 0)

    def set(self, *values: int | float) -> int:
        """Store the values (in signature order); return the `void**` address to launch with."""
        self.pack(*values)
        return self.address
