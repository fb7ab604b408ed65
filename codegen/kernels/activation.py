"""CuTeDSL activation kernel (ported from the seed's W4A16ActivationKernel, vectorised).

Each thread owns VECTOR consecutive output columns of one row: one 16-byte
load of the gate half, one of the up half (gated) and one 16-byte store.  The
row/column split divides by the compile-time constant I / VECTOR.  Offsets are
64-bit so rows * 2I may exceed 2^31 elements.

    thread t of block b  ->  v = b * THREADS + t   (a vector index, < rows * I / VECTOR)
    row = v // (I / VECTOR),  col = (v % (I / VECTOR)) * VECTOR
    gate = fc1[row, col : col + VECTOR],  up = fc1[row, I + col : I + col + VECTOR]
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import Int32, Int64

from cuteaot.runtime.kernels.activation import VECTOR, ActivationSpec
from cuteaot.runtime.types import Activation

from .. import intrinsics as I
from .common import after_prior_grids, cutlass_dtype, fake_arguments

THREADS = 256


class ActivationKernel:
    """Compile-time facts only in __init__; __call__ launches; kernel is device code."""

    def __init__(self, spec: ActivationSpec):
        self.spec = spec
        self.elem = cutlass_dtype(spec.dtype)
        self.inter = spec.intermediate_size
        self.width = spec.input_width
        self.vectors_per_row = spec.intermediate_size // VECTOR
        self.gated = spec.activation.is_gated
        self.oai = spec.activation is Activation.SWIGLUOAI
        self.limit = spec.swiglu_limit

    @cute.jit
    def __call__(self, fc1: cute.Pointer, out: cute.Pointer, rows: Int32, stream):
        self.kernel(fc1, out, rows).launch(grid=(1, 1, 1), block=[THREADS, 1, 1], stream=stream)

    @cute.jit
    def _silu_times_up(self, g: cutlass.Float32, u: cutlass.Float32) -> cutlass.Float32:
        if cutlass.const_expr(self.limit is not None):
            g = cute.arch.fmin(g, cutlass.Float32(self.limit))
            u = cute.arch.fmax(cute.arch.fmin(u, cutlass.Float32(self.limit)), cutlass.Float32(-self.limit))
        arg = g
        if cutlass.const_expr(self.oai):
            arg = cutlass.Float32(self.spec.swiglu_alpha) * g
            u = u + cutlass.Float32(self.spec.swiglu_beta)
        e = cute.math.exp(-arg, fastmath=self.spec.fast_math)
        if cutlass.const_expr(self.spec.fast_math):  # (the FC1 epilogue computes this once per output)
            s = I.div_approx_f32(g, cutlass.Float32(1.0) + e)
        else:
            s = g / (cutlass.Float32(1.0) + e)
        if cutlass.const_expr(not self.oai):
            # the seed rounds silu(g) and up to the element type before the product
            s = s.to(self.elem).to(cutlass.Float32)
            u = u.to(self.elem).to(cutlass.Float32)
        return s * u

    @cute.kernel
    def kernel(self, fc1: cute.Pointer, out: cute.Pointer, rows: Int32):
        after_prior_grids()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        v = Int64(bidx) * THREADS + Int64(tidx)
        if v < Int64(rows) * self.vectors_per_row:
            self.apply_vector(fc1, out, v)

    @cute.jit
    def apply_vector(self, fc1: cute.Pointer, out: cute.Pointer, v: Int64):
        """Activate the VECTOR outputs of vector v (also called by the fused MoE kernel)."""
        row = v // self.vectors_per_row
        col = (v - row * self.vectors_per_row) * VECTOR
        x_src = cute.make_tensor(fc1 + (row * self.width + col), cute.make_layout(VECTOR))
        x = cute.make_rmem_tensor(VECTOR, self.elem)
        x.store(x_src.load())
        y = cute.make_rmem_tensor(VECTOR, self.elem)
        if cutlass.const_expr(self.gated):
            u_src = cute.make_tensor(fc1 + (row * self.width + self.inter + col), cute.make_layout(VECTOR))
            u = cute.make_rmem_tensor(VECTOR, self.elem)
            u.store(u_src.load())
            for i in cutlass.range_constexpr(VECTOR):
                y[i] = self._silu_times_up(x[i].to(cutlass.Float32), u[i].to(cutlass.Float32)).to(self.elem)
        else:
            for i in cutlass.range_constexpr(VECTOR):
                r = cute.arch.fmax(x[i].to(cutlass.Float32), cutlass.Float32(0.0))
                y[i] = (r * r).to(self.elem)
        dst = cute.make_tensor(out + (row * self.inter + col), cute.make_layout(VECTOR))
        dst.store(y.load())

def build(spec: ActivationSpec):
    return ActivationKernel(spec), fake_arguments(spec)
