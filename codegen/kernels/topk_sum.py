"""CuTeDSL top-k sum kernel (ported from the seed's W4A16TopKSumKernel, vectorised).

Each thread owns VECTOR consecutive columns of one token and accumulates the
token's top_k routed rows in float32 (the route loop is unrolled):

    v = block * THREADS + thread  (< M * H / VECTOR)
    m = v // (H / VECTOR),  col = (v % (H / VECTOR)) * VECTOR
    out[m, col:col+VECTOR] = sum_k fc2[m, k, col:col+VECTOR]

The accumulating variant (spec.accumulate) starts from out's row instead of zero.
The masked variant (spec.ids_dtype set) sums only routes k with
0 <= topk_ids[m, k] < num_experts: the other rows were not written by FC2 (dropped
routes), so they may hold anything, NaN included.  All threads of a token read the
same ids, so the extra loads are served by one cache line per token.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import Int32, Int64

from cuteaot.runtime.kernels.route_pack import IdsDType
from cuteaot.runtime.kernels.topk_sum import VECTOR, TopKSumSpec

from .common import after_prior_grids, cutlass_dtype, fake_arguments

THREADS = 256


class TopKSumKernel:
    def __init__(self, spec: TopKSumSpec):
        self.spec = spec
        self.elem = cutlass_dtype(spec.dtype)
        self.hidden = spec.hidden_size
        self.top_k = spec.top_k
        self.vectors_per_row = spec.hidden_size // VECTOR
        self.masked = spec.ids_dtype is not None
        self.accumulate = bool(spec.accumulate)
        self.ids_type = Int64 if spec.ids_dtype is IdsDType.INT64 else Int32

    @cute.jit
    def __call__(self, fc2: cute.Pointer, out: cute.Pointer, tokens: Int32, stream):
        self.kernel(fc2, out, tokens).launch(grid=(1, 1, 1), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, fc2: cute.Pointer, out: cute.Pointer, tokens: Int32):
        after_prior_grids()
        self._sum(fc2, out, tokens, fc2, Int32(0))  # the ids are never read (not masked)

    @cute.jit
    def _sum(self, fc2: cute.Pointer, out: cute.Pointer, tokens: Int32, topk_ids: cute.Pointer, num_experts: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        v = Int64(bidx) * THREADS + Int64(tidx)
        if v < Int64(tokens) * self.vectors_per_row:
            m = v // self.vectors_per_row
            col = (v - m * self.vectors_per_row) * VECTOR
            acc = cute.make_rmem_tensor(VECTOR, cutlass.Float32)
            acc.fill(0.0)
            x = cute.make_rmem_tensor(VECTOR, self.elem)
            if cutlass.const_expr(self.accumulate):  # out += the sum, added in float32
                x.store(cute.make_tensor(out + (m * self.hidden + col), cute.make_layout(VECTOR)).load())
                for i in cutlass.range_constexpr(VECTOR):
                    acc[i] = x[i].to(cutlass.Float32)
            keep = [None] * self.top_k
            if cutlass.const_expr(self.masked):
                for k in cutlass.range_constexpr(self.top_k):  # all ids first: their loads overlap
                    expert = cute.make_tensor(topk_ids + (m * self.top_k + k), cute.make_layout(1))[0]
                    keep[k] = (expert >= self.ids_type(0)) & (expert < self.ids_type(num_experts))
            for k in cutlass.range_constexpr(self.top_k):
                # The row is loaded even when the route is dropped (it is in bounds, only stale), so the
                # loads stay as independent as in the plain kernel; a select, not a multiply by 0,
                # discards it, as a stale row may hold NaN or Inf.
                src = cute.make_tensor(fc2 + ((m * self.top_k + k) * self.hidden + col), cute.make_layout(VECTOR))
                x.store(src.load())
                for i in cutlass.range_constexpr(VECTOR):
                    term = x[i].to(cutlass.Float32)
                    if cutlass.const_expr(self.masked):
                        term = cutlass.Float32(cutlass.select_(keep[k], term, cutlass.Float32(0.0)))
                    acc[i] = acc[i] + term
            y = cute.make_rmem_tensor(VECTOR, self.elem)
            y.store(acc.load().to(self.elem))
            dst = cute.make_tensor(out + (m * self.hidden + col), cute.make_layout(VECTOR))
            dst.store(y.load())


class MaskedTopKSumKernel(TopKSumKernel):
    """The masked variant (spec.ids_dtype set): its entry and kernel also take the ids and the expert count."""

    @cute.jit
    def __call__(self, fc2: cute.Pointer, out: cute.Pointer, tokens: Int32, topk_ids: cute.Pointer,
                 num_experts: Int32, stream):
        self.kernel(fc2, out, tokens, topk_ids, num_experts).launch(
            grid=(1, 1, 1), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, fc2: cute.Pointer, out: cute.Pointer, tokens: Int32, topk_ids: cute.Pointer,
               num_experts: Int32):
        after_prior_grids()
        self._sum(fc2, out, tokens, topk_ids, num_experts)


def build(spec: TopKSumSpec):
    kernel = TopKSumKernel(spec) if spec.ids_dtype is None else MaskedTopKSumKernel(spec)
    return kernel, fake_arguments(spec)
