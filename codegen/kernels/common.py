"""Small helpers shared by the CuTeDSL kernel modules."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_ptr
from cutlass.cutlass_dsl import Float32, Int32, Int64, Uint8, Uint32

from cuteaot.runtime.abi import ParamKind, Pointee
from cuteaot.runtime.kernels.route_pack import IdsDType
from cuteaot.runtime.types import DType

from .. import intrinsics as I

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


def after_prior_grids(*, persistent: bool = False) -> None:
    """A production kernel's first step: wait until the kernels before it on the stream have finished
    (they may still run: the runtime launches kernels whose PTX waits with programmatic stream
    serialization).  Nothing may read or write global memory before it.

    A small grid (route packing, the top-k sum, the activation) then lets the next kernel launch at
    once, so that its CTAs are resident on the idle SMs when this one finishes.  A `persistent` grid
    (the GEMM, the fused layer) fills every SM: the next grid's CTAs could only take the slots its own
    tail frees, and letting them in early measured 1-2 % slower at M >= 1024 (H200; docs/benchmarks.md,
    "Programmatic dependent launch"), so it lets them launch as it exits."""
    I.wait_for_prior_grids()
    if not persistent:
        I.launch_dependents()


@cute.jit
def grid_barrier(barrier: Int64, tid: Int32, grid_x: Int32, while_waiting=None):
    """Every CTA of the (co-resident) grid meets here; each sees the writes the others made before it.

    One atomic a CTA on the word at `barrier` (its low 31 bits zero between barriers): after the CTA's own
    writes (bar.sync), thread 0 adds 1 with release semantics, CTA 0 adds 2**31 - (grid_x - 1) instead, so
    the word's top bit flips exactly when the last CTA arrives; each thread 0 then spins on acquire loads
    until the top bit differs from what its own add returned.  The low bits are back at zero after every
    barrier and the top bit is whatever the last one left, so the word stays usable across launches.  A
    CTA that runs ahead into the next barrier adds without flipping the bit again before everyone has
    arrived there, so no CTA can miss a flip.  (The sense-reversal barrier before it took one release
    fence, a load and an atomic on the way in, and a store, a fence and a release add to open: ~1.8 us on
    the H200 from the last arrival to the release, docs/benchmarks.md "thirteenth session".)

    `while_waiting` (optional): a function every thread calls between its CTA's arrival and the release (thread
    0 after its add, so the release fence does not wait for what it reads); its result is returned.  For reads
    that do not depend on the other CTAs' writes: they then overlap the wait instead of following it.
    """
    cute.arch.sync_threads()
    if cutlass.const_expr(while_waiting is None):
        if tid == Int32(0):
            _spin_until_released(barrier, _arrive(barrier, grid_x))
        cute.arch.sync_threads()
        return None
    old = Int32(0)
    if tid == Int32(0):
        old = _arrive(barrier, grid_x)
    result = while_waiting()
    if tid == Int32(0):
        _spin_until_released(barrier, old)
    cute.arch.sync_threads()
    return result


@cute.jit
def _arrive(barrier: Int64, grid_x: Int32) -> Int32:
    """grid_barrier's add (release): 1, or for CTA 0 2**31 - (grid_x - 1); the word's value before it."""
    add = Int32(1)
    cta, _, _ = cute.arch.block_idx()
    if cta == Int32(0):
        add = Int32(-(1 << 31)) - (grid_x - Int32(1))  # 2**31 - (grid_x - 1), modulo 2**32
    return I.atom_add_release_i32(barrier, add)


@cute.jit
def _spin_until_released(barrier: Int64, old: Int32):
    """Acquire loads of the barrier word until its top bit differs from the one `old` (this CTA's add) saw."""
    flipped = Int32(0)
    while flipped == Int32(0):
        flipped = (I.ld_global_acquire_i32(barrier) ^ old) & Int32(-(1 << 31))


TIMELINE_RECORD_BYTES = 256  # a CTA's timeline record in c_tmp: 16 slots of (%globaltimer, %clock64)


def store_clocks(c_tmp: Int64, slot: int, clocks: tuple[Int64, Int64]) -> None:
    """Timeline probe (w4a16/fused.py TIMELINE, benchmarks/decode_timeline.py): store the two clocks
    (`intrinsics.read_timers`) in slot `slot` of this CTA's record; one thread calls it."""
    cta, _, _ = cute.arch.block_idx()
    I.st_global_v2_i64(c_tmp + Int64(cta) * Int64(TIMELINE_RECORD_BYTES) + Int64(16 * slot), *clocks)
