"""CuTeDSL top-k sum kernel (ported from the seed's W4A16TopKSumKernel, vectorised).

Each thread owns VECTOR consecutive columns of one token and accumulates the
token's top_k routed rows in float32 (the route loop is unrolled):

    v = block * THREADS + thread  (< M * H / VECTOR)
    m = v // (H / VECTOR),  col = (v % (H / VECTOR)) * VECTOR
    out[m, col:col+VECTOR] = sum_k fc2[m, k, col:col+VECTOR]
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_ptr
from cutlass.cutlass_dsl import Int32, Int64

from cuteaot.runtime.kernels.topk_sum import VECTOR, TopKSumSpec

from .common import cutlass_dtype

THREADS = 256


class TopKSumKernel:
    def __init__(self, spec: TopKSumSpec):
        self.spec = spec
        self.elem = cutlass_dtype(spec.dtype)
        self.hidden = spec.hidden_size
        self.top_k = spec.top_k
        self.vectors_per_row = spec.hidden_size // VECTOR

    @cute.jit
    def __call__(self, fc2: cute.Pointer, out: cute.Pointer, tokens: Int32, stream):
        self.kernel(fc2, out, tokens).launch(grid=(1, 1, 1), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, fc2: cute.Pointer, out: cute.Pointer, tokens: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        v = Int64(bidx) * THREADS + Int64(tidx)
        if v < Int64(tokens) * self.vectors_per_row:
            m = v // self.vectors_per_row
            col = (v - m * self.vectors_per_row) * VECTOR
            acc = cute.make_rmem_tensor(VECTOR, cutlass.Float32)
            acc.fill(0.0)
            x = cute.make_rmem_tensor(VECTOR, self.elem)
            for k in cutlass.range_constexpr(self.top_k):
                src = cute.make_tensor(fc2 + ((m * self.top_k + k) * self.hidden + col), cute.make_layout(VECTOR))
                x.store(src.load())
                for i in cutlass.range_constexpr(VECTOR):
                    acc[i] = acc[i] + x[i].to(cutlass.Float32)
            y = cute.make_rmem_tensor(VECTOR, self.elem)
            y.store(acc.load().to(self.elem))
            dst = cute.make_tensor(out + (m * self.hidden + col), cute.make_layout(VECTOR))
            dst.store(y.load())


def build(spec: TopKSumSpec):
    elem = cutlass_dtype(spec.dtype)
    ptr = make_ptr(elem, 16, cute.AddressSpace.gmem, assumed_align=16)
    return TopKSumKernel(spec), (ptr, ptr, Int32(1), make_fake_stream())
