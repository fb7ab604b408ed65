"""The device code of benchmarks/wgmma_rate.py (CuTeDSL; imported by its `build` step only)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import Float32, Int32, Int64, Uint32

from cuteaot.codegen import intrinsics as I
from cuteaot.codegen.intrinsics import T, _asm, _ir

from .wgmma_rate import GRID_PER_SM, ROWS, SMEM_BYTES, THREADS, TILE_BYTES


def wgmma_ss(acc: list, desc_a: Int64, desc_b: Int64) -> list:
    """acc(64xN) += A(64x16, shared, `desc_a`) * B(16xN, shared, `desc_b`), bf16: the shared-memory-A form."""
    n = len(acc)
    d = ", ".join(f"${i}" for i in range(n))
    ptx = (f"wgmma.mma_async.sync.aligned.m64n{2 * n}k16.f32.bf16.bf16 {{{d}}}, ${2 * n}, ${2 * n + 1}, 1, 1, 1, 0, 0;")
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)] + ["l", "l"])
    args = _ir([Float32(v) for v in acc] + [Int64(desc_a), Int64(desc_b)], None, None)
    return [Float32(v) for v in _asm(n, T.f32, args, ptx, constraints, effects=True, loc=None, ip=None)]


class Rate:
    """One CTA of the probe: `iters` loops of ROWS 16-k rows, each `alu` chain steps then two m64n128k16 (A from
    registers for mode "rs", from shared memory for "ss"), leaving `in_flight` groups running; every thread stores
    its accumulators' sum and its chains' mix (two words) so that nothing is dead code."""

    def __init__(self, mode: str, alu: int, in_flight: int):
        self.mode, self.alu, self.in_flight = mode, alu, in_flight

    @cute.jit
    def __call__(self, out: cute.Pointer, iters: Int32, stream):
        self.kernel(out, iters).launch(grid=(1, 1, 1), block=[THREADS, 1, 1], smem=SMEM_BYTES, stream=stream,
                                       min_blocks_per_mp=GRID_PER_SM, preferred_smem_carveout=100)

    @cute.kernel
    def kernel(self, out: cute.Pointer, iters: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        tid = Int32(tidx)
        smem = I.shared_ptr_to_u32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=16))
        base = (smem + Int32(1023)) & Int32(-1024)
        for i in cutlass.range_constexpr(2 * TILE_BYTES // 4 // THREADS):
            I.st_shared_u32(base + (Int32(i * THREADS) + tid) * Int32(4), Uint32(0))
        I.fence_proxy_async_shared()
        cute.arch.sync_threads()
        desc_b = I.wgmma_desc_sw128(base)
        desc_a = I.wgmma_desc_sw128(base + Int32(TILE_BYTES))
        a = [Uint32(0) for _ in range(4)]
        acc = cute.make_rmem_tensor((2, 64), Float32)
        acc.fill(0.0)
        chains = [Uint32(tid + Int32(c)) for c in range(4)]
        it = Int32(0)
        while it < iters:
            for kk in cutlass.range_constexpr(ROWS):
                for j in cutlass.range_constexpr(self.alu // 4):
                    for c in cutlass.range_constexpr(4):
                        x = chains[c]
                        if cutlass.const_expr(j % 2):
                            chains[c] = ((x >> Uint32(3)) ^ x) * Uint32(5) + Uint32(j + 1)
                        else:
                            chains[c] = (x << Uint32(1)) ^ (x >> Uint32(7))
                regs = I.pin_u32(a)
                I.wgmma_fence()
                for jj in cutlass.range_constexpr(2):
                    d = [acc[jj, i] for i in range(64)]
                    if cutlass.const_expr(self.mode == "rs"):
                        d = I.wgmma_bf16_m64k16_rs(d, regs[0], regs[1], regs[2], regs[3],
                                                   desc_b + Int64(2 * kk))
                    else:
                        d = wgmma_ss(d, desc_a + Int64(2 * kk + 512 * jj), desc_b + Int64(2 * kk))
                    for i in cutlass.range_constexpr(64):
                        acc[jj, i] = d[i]
                I.wgmma_commit_group()
                I.wgmma_wait_group(self.in_flight)
            it += Int32(1)
        I.wgmma_wait_group(0)
        total = Float32(0.0)
        for jj in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(64):
                total = total + acc[jj, i]
        mix = chains[0] ^ chains[1] ^ chains[2] ^ chains[3]  # stored, so the chains are not dead code
        slot = I.gmem_address(out) + Int64(Int32(bidx) * Int32(THREADS) + tid) * Int64(8)
        I.st_global_i32(slot, total.to(Int32))
        I.st_global_i32(slot + Int64(4), mix.to(Int32))

