"""Kernel parameter signatures and the packed argument buffer used to launch them.

Device kernels take only raw global pointers and 32-bit scalars.  Each kernel
family declares its signature once (in ``cuteaot.runtime.kernels``) and every
other view of the ABI is derived from that declaration:

* codegen builds the fake arguments ``cute.compile`` needs from each parameter's
  kind, pointee and alignment (``cuteaot.codegen.kernels.common.fake_arguments``);
* the build checks the kernel's Python parameter names and the PTX ``.entry``
  (count, size, alignment) against it (``cuteaot.codegen.ptx``);
* the runtime packs a launch's keyword arguments by name into it (`ArgBuffer`,
  `Signature.order`), so a value cannot land in another parameter's slot.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import struct
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Mapping, Optional

from .errors import LaunchArgumentError


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


class Pointee(str, Enum):
    """The element a pointer parameter addresses: what codegen gives `cute.compile` for it.

    ELEM and IDS depend on the specialization (its `dtype` / `ids_dtype` fact); the
    others are fixed.  The runtime only passes addresses, so this never changes packing.
    """

    ELEM = "elem"  # the spec's activation dtype (bf16 | fp16)
    IDS = "ids"  # the spec's topk_ids dtype (int32 | int64)
    I32 = "i32"
    U32 = "u32"
    U8 = "u8"
    F32 = "f32"


@dataclass(frozen=True)
class Param:
    """One kernel parameter; build them with `ptr`, `i32` and `f32`."""

    name: str
    kind: ParamKind
    doc: str  # dtype, shape and layout of what it points to
    pointee: Optional[Pointee] = None  # pointers only
    # pointers only: the address alignment (bytes) the kernel may assume; None = the element's own size
    align: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"parameter name must be a Python identifier, got {self.name!r}")
        if (self.pointee is not None) != (self.kind is ParamKind.PTR):
            raise ValueError(f"parameter {self.name!r}: a pointee is given for pointers and only for pointers")
        if self.align is not None and (self.kind is not ParamKind.PTR or self.align & (self.align - 1)):
            raise ValueError(f"parameter {self.name!r}: align is a power of two, for pointers only; got {self.align}")

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind.value, "size": self.kind.size, "align": self.kind.align}


def ptr(name: str, pointee: Pointee, doc: str, *, align: Optional[int] = 16) -> Param:
    """A global pointer parameter; `align` = what the kernel may assume (16: vector loads)."""
    return Param(name, ParamKind.PTR, doc, Pointee(pointee), align)


def i32(name: str, doc: str) -> Param:
    return Param(name, ParamKind.I32, doc)


def f32(name: str, doc: str) -> Param:
    return Param(name, ParamKind.F32, doc)


@dataclass(frozen=True)
class Signature:
    params: tuple[Param, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"a signature names each parameter once; repeated: {repeated}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def to_json(self) -> list[dict]:
        return [p.to_json() for p in self.params]

    def matches_json(self, recorded: list[dict]) -> bool:
        return self.to_json() == recorded

    @functools.cached_property
    def getter(self) -> Callable[[Mapping], tuple]:
        """values -> the declared names' values in declaration order (KeyError if one is missing).

        One C-level call per launch; callers also compare the count, so that an
        undeclared name cannot slip through (see `order`).
        """
        getter = operator.itemgetter(*self.names)
        if len(self.params) == 1:  # itemgetter of one name returns the value, not a 1-tuple
            return lambda values: (getter(values),)
        return getter

    def order(self, values: Mapping[str, int | float]) -> tuple:
        """The values of a launch in declaration order; every declared name exactly once."""
        try:
            ordered = self.getter(values)
        except KeyError:
            raise self.mismatch(values) from None
        if len(values) != len(self.params):
            raise self.mismatch(values)
        return ordered

    def mismatch(self, values: Mapping[str, object]) -> LaunchArgumentError:
        missing = [n for n in self.names if n not in values]
        unknown = sorted(set(values) - set(self.names))
        return LaunchArgumentError(
            f"a launch must pass every declared parameter by name: {list(self.names)}; "
            f"missing {missing}, not declared {unknown}. Pass the declared names (see the family's SIGNATURE)."
        )


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

    __slots__ = ("_buffer", "_array", "_layout", "_offsets", "address", "pack", "signature")

    def __init__(self, signature: Signature):
        fmt, offsets, offset = "=", [], 0
        for p in signature.params:
            pad = -offset % p.kind.align
            fmt += "x" * pad + _STRUCT_CODES[p.kind]
            offsets.append(offset + pad)
            offset += pad + p.kind.size
        layout = struct.Struct(fmt)
        self.signature, self._layout, self._offsets = signature, layout, tuple(offsets)
        # whole 8-byte words, so that `writer`'s typed views of the buffer cover it
        self._buffer = ctypes.create_string_buffer(max(-(-layout.size // 8) * 8, 8))
        base = ctypes.addressof(self._buffer)
        self._array = (ctypes.c_void_p * len(offsets))(*[base + o for o in offsets])
        self.address = ctypes.addressof(self._array)
        self.pack = functools.partial(layout.pack_into, self._buffer, 0)  # values in declaration order

    def values(self) -> tuple:
        """The packed values, in declaration order."""
        return self._layout.unpack_from(self._buffer, 0)

    def writer(self, slots: tuple[int, ...]):
        """`write(*values)`: store values into the parameters at `slots` (declaration indices) and leave the
        others as packed; one typed memoryview store each, in a function generated once (a call costs
        about a third of packing every parameter).  A wrong count is a TypeError, a value the parameter's
        type cannot hold a TypeError or ValueError."""
        params = self.signature.params
        views = {code: memoryview(self._buffer).cast("B").cast(code)
                 for code in {_STRUCT_CODES[params[i].kind] for i in slots}}
        stores = [f"view_{_STRUCT_CODES[params[i].kind]}[{self._offsets[i] // params[i].kind.size}] = v{j}"
                  for j, i in enumerate(slots)]
        arguments = [f"v{j}" for j in range(len(slots))] + (["*"] if views else []) + [f"view_{c}=view_{c}" for c in views]
        source = f"def write({', '.join(arguments)}):\n    " + ("\n    ".join(stores) or "pass") + "\n"
        namespace = {f"view_{code}": view for code, view in views.items()}
        exec(source, namespace)  # noqa: S102 -- source built from indices and type codes only
        return namespace["write"]

    def set(self, **values: int | float) -> int:
        """Store the values, given by parameter name; return the `void**` address to launch with."""
        self.pack(*self.signature.order(values))
        return self.address
