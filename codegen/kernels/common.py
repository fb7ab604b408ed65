"""Small helpers shared by the CuTeDSL kernel modules."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_ptr
from cutlass.cutlass_dsl import Float32, Int32, Int64, Uint8, Uint32

from cuteaot.runtime.abi import ParamKind, Pointee
from cuteaot.runtime.kernels.route_pack import IdsDType
from cuteaot.runtime.types import DType

_FIXED_POINTEES = {Pointee.I32: Int32, Pointee.U32: Uint32, Pointee.U8: Uint8, Pointee.F32: Float32}
_SCALARS = {ParamKind.I32: Int32, ParamKind.F32: Float32}
_FAKE_ADDRESS = 16  # any aligned non-null value: cute.compile only reads the pointer's type


def cutlass_dtype(dtype: DType):
    return {DType.BF16: cutlass.BFloat16, DType.FP16: cutlass.Float16}[dtype]


def _pointee_type(pointee: Pointee, spec):
    """The CuTeDSL element type of a pointer parameter of `spec`'s kernel."""
    if pointee is Pointee.ELEM:
        return cutlass_dtype(spec.dtype)
    if pointee is Pointee.IDS:
        # a kernel without an ids_dtype (route packing's scan stage) never reads the ids: int32 then
        return Int64 if getattr(spec, "ids_dtype", None) is IdsDType.INT64 else Int32
    return _FIXED_POINTEES[pointee]


def fake_arguments(spec) -> tuple:
    """The arguments `cute.compile` traces `spec`'s kernel with: one per declared parameter, then the stream.

    Derived from `spec.SIGNATURE` (kind, pointee, alignment), so no family retypes its
    parameter list; pointers are global with the declared alignment (None = the element's size).
    """
    args = []
    for p in spec.SIGNATURE.params:
        if p.kind is ParamKind.PTR:
            elem = _pointee_type(p.pointee, spec)
            align = p.align if p.align is not None else elem.width // 8
            args.append(make_ptr(elem, _FAKE_ADDRESS, cute.AddressSpace.gmem, assumed_align=align))
        else:
            args.append(_SCALARS[p.kind](1))
    return (*args, make_fake_stream())
