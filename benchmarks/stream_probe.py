"""What can 16-byte cp.async feed from HBM at the GEMM's occupancy, and do bulk copies do better?

    python -m benchmarks.stream_probe build [--out generated/stream-probe]   # here (needs CuTeDSL)
    python -m benchmarks.stream_probe run [--dir generated/stream-probe]     # on the GPU

A question about the hardware, not a product kernel, so it bypasses the bundle machinery:
`build` compiles a few variants of one streaming kernel to cubins, `run` loads them with
cuModuleLoadData and launches them raw.  Every variant runs the packed 8-row GEMM's grid
(4 CTAs of 128 threads per SM) and streams 4 KB stages (one k-tile of a 128x64 weight
tile) through shared memory, `stages` deep, touching one word per thread per stage:

* cp16: every thread issues 16-byte `cp.async`s, `cp.async.wait_group` + bar.sync per stage;
* cp16 + proxy fence: the same with `fence.proxy.async.shared::cta` between the wait and the
  barrier, as the wgmma loop publishes a stage to the tensor cores (`_wg_publish`).  ptxas lowers
  that fence to `MEMBAR.ALL.CTA; FENCE.VIEW.ASYNC.S`: if the membar also waited for the thread's
  copies still in flight, the stream would fall to about one stage in flight;
* bulk: `cp.async.bulk` of 1 KB rows (or the whole 4 KB) issued by 4 (1) threads,
  completion counted on one mbarrier per stage.

Timed like the GEMM benchmark (`device_us`: launches captured in a CUDA graph).  If cp16
streams well above the GEMM's share of HBM here, the GEMM's small-M ceiling is its own
per-stage work, not how it requests memory (docs/benchmarks.md, 2026-11-29 small-M study).
No `from __future__ import annotations`: CuTeDSL evaluates the kernel's annotations, and
cutlass is imported inside `build` only, so `run` works where CuTeDSL is not installed.
"""

import argparse
import json
import os

STAGE = 4096  # bytes per stage
THREADS = 128
CTAS_PER_SM = 4
VARIANTS = {  # name: (mode, stages, bulk copies per stage, proxy fence after each wait)
    "cp16 4 stages": ("cp16", 4, 0, False),
    "cp16 4 stages + proxy fence": ("cp16", 4, 0, True),
    "cp16 8 stages": ("cp16", 8, 0, False),
    "cp16 8 stages + proxy fence": ("cp16", 8, 0, True),
    "bulk 4 stages 4x1K": ("bulk", 4, 4, False),
    "bulk 8 stages 4x1K": ("bulk", 8, 4, False),
    "bulk 4 stages 1x4K": ("bulk", 4, 1, False),
}


def build(out: str) -> None:
    import glob
    import re
    import shutil
    import tempfile

    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_ptr
    from cutlass.cutlass_dsl import Int32, Int64, Uint32

    from cuteaot.codegen import intrinsics as I

    class StreamKernel:
        def __init__(self, mode: str, stages: int, copies: int, fence: bool):
            self.mode, self.stages, self.copies, self.fence = mode, stages, copies, fence

        @cute.jit
        def __call__(self, src: cute.Pointer, sink: cute.Pointer, iters: Int32, stream):
            self.kernel(src, sink, iters).launch(
                grid=(1, 1, 1), block=[THREADS, 1, 1], smem=self.stages * (STAGE + 8),
                min_blocks_per_mp=CTAS_PER_SM, stream=stream, preferred_smem_carveout=100)

        @cute.jit
        def issue(self, smem: Int32, bars: Int32, base: Int64, tid: Int32, p: cutlass.Constexpr[int], it: Int32):
            """Request stage `it` of this CTA's range into buffer p."""
            g = base + Int64(it) * Int64(STAGE)
            if cutlass.const_expr(self.mode == "cp16"):
                for i in cutlass.range_constexpr(STAGE // 16 // THREADS):
                    off = tid + Int32(i * THREADS)
                    I.cp_async_16(smem + Int32(p * STAGE) + off * Int32(16), g + Int64(off) * Int64(16))
                cute.arch.cp_async_commit_group()
            else:
                chunk = STAGE // self.copies
                if tid == Int32(0):
                    I.mbarrier_arrive_expect_tx(bars + Int32(8 * p), STAGE)
                if tid < Int32(self.copies):
                    I.cp_async_bulk_g2s(smem + Int32(p * STAGE) + tid * Int32(chunk), g + Int64(tid) * Int64(chunk),
                                        chunk, bars + Int32(8 * p))

        @cute.kernel
        def kernel(self, src: cute.Pointer, sink: cute.Pointer, iters: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            tid, cta = Int32(tidx), Int32(bidx)
            smem = I.shared_ptr_to_u32(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=128))
            bars = smem + Int32(self.stages * STAGE)
            base = I.gmem_address(src) + Int64(cta) * Int64(iters) * Int64(STAGE)
            if cutlass.const_expr(self.mode == "bulk"):
                if tid == Int32(0):
                    for p in cutlass.range_constexpr(self.stages):
                        I.mbarrier_init(bars + Int32(8 * p), 1)
                    I.fence_mbarrier_init()
                cute.arch.sync_threads()
            for p in cutlass.range_constexpr(self.stages - 1):
                self.issue(smem, bars, base, tid, p, Int32(p))
            acc = Uint32(0)
            it = Int32(0)
            while it < iters:
                for p in cutlass.range_constexpr(self.stages):
                    if it < iters:
                        if cutlass.const_expr(self.mode == "cp16"):
                            cute.arch.cp_async_wait_group(self.stages - 2)
                            if cutlass.const_expr(self.fence):
                                I.fence_proxy_async_shared()
                        else:
                            I.mbarrier_wait_parity(bars + Int32(8 * p), (it // Int32(self.stages)) & Int32(1))
                        cute.arch.sync_threads()  # data visible to all; buffer p - 1 free to refill
                        acc = acc ^ I.ld_shared_u32(smem + Int32(p * STAGE) + tid * Int32(32))
                        nxt = it + Int32(self.stages - 1)
                        if nxt < iters:
                            self.issue(smem, bars, base, tid, (p + self.stages - 1) % self.stages, nxt)
                        elif cutlass.const_expr(self.mode == "cp16"):
                            cute.arch.cp_async_commit_group()
                        it += Int32(1)
            if acc == Uint32(0x9E3779B9):  # keeps the reads; practically never stores
                I.st_global_i32(I.gmem_address(sink) + Int64(cta) * Int64(4), Int32(acc))

    os.makedirs(out, exist_ok=True)
    ptr = make_ptr(cutlass.Uint8, 16, cute.AddressSpace.gmem, assumed_align=16)
    index = {}
    for name, (mode, stages, copies, fence) in VARIANTS.items():
        with tempfile.TemporaryDirectory() as d:
            cute.compile(StreamKernel(mode, stages, copies, fence), ptr, ptr, Int32(1), make_fake_stream(),
                         options=f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir {d}")
            ptx = open(glob.glob(f"{d}/**/*.ptx", recursive=True)[0]).read()
            file = name.replace(" ", "_") + ".cubin"
            shutil.copy(glob.glob(f"{d}/**/*.cubin", recursive=True)[0], os.path.join(out, file))
        index[name] = {"cubin": file, "symbol": re.search(r"\.entry\s+(\w+)", ptx).group(1),
                       "smem": stages * (STAGE + 8)}
        print(f"built {name}", flush=True)
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)


def run(directory: str, iters: int) -> None:
    import torch
    from cuda.bindings import driver as cu

    from benchmarks.common import device_us, hbm_copy_bandwidth
    from cuteaot.runtime.abi import ArgBuffer, Pointee, Signature, i32, ptr
    from cuteaot.runtime.bundle import check_cu

    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    signature = Signature((ptr("src", Pointee.U8, "u8 stream"), ptr("sink", Pointee.I32, "i32 [ctas]"),
                           i32("iters", "stages per CTA")))
    ctas = CTAS_PER_SM * torch.cuda.get_device_properties(0).multi_processor_count
    src = torch.randint(0, 255, (ctas * iters * STAGE,), dtype=torch.uint8, device="cuda")
    sink = torch.zeros(ctas, dtype=torch.int32, device="cuda")
    hbm = hbm_copy_bandwidth()
    print(f"HBM copy {hbm / 1e12:.2f} TB/s; {ctas} CTAs x {THREADS} threads stream {src.numel() / 1e6:.0f} MB")
    print("| variant | µs | GB/s | % of HBM copy |\n| --- | ---: | ---: | ---: |")
    for name, entry in index.items():
        with open(os.path.join(directory, entry["cubin"]), "rb") as f:
            module = check_cu(cu.cuModuleLoadData(f.read()), "cuModuleLoadData")
        function = check_cu(cu.cuModuleGetFunction(module, entry["symbol"].encode()), "cuModuleGetFunction")
        check_cu(cu.cuFuncSetAttribute(function, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       entry["smem"]), "cuFuncSetAttribute")
        args = ArgBuffer(signature)

        def launch():
            check_cu(cu.cuLaunchKernel(function, ctas, 1, 1, THREADS, 1, 1, entry["smem"],
                                       torch.cuda.current_stream().cuda_stream,
                                       args.set(src=src.data_ptr(), sink=sink.data_ptr(), iters=iters), 0), "cuLaunchKernel")

        us = device_us(launch, iters=10, reps=9)
        print(f"| {name} | {us:.1f} | {src.numel() / us / 1e3:.0f} | {100 * src.numel() / (us * 1e-6) / hbm:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", default="generated/stream-probe")
    r = sub.add_parser("run")
    r.add_argument("--dir", default="generated/stream-probe")
    r.add_argument("--iters", type=int, default=256, help="4 KB stages per CTA")
    args = ap.parse_args()
    if args.cmd == "build":
        build(args.out)
    else:
        run(args.dir, args.iters)


if __name__ == "__main__":
    main()
