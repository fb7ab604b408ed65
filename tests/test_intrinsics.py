"""Every inline-PTX intrinsic compiles for sm_90a and emits the instruction it documents."""

from __future__ import annotations

import dataclasses
import re
import tempfile

import pytest

pytest.importorskip("cutlass")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_stream, make_ptr  # noqa: E402
from cutlass.cutlass_dsl import Float32, Int32, Int64, Uint32  # noqa: E402

from cuteaot.codegen import intrinsics as I  # noqa: E402

pytestmark = pytest.mark.build


class _AllIntrinsics:
    @cute.jit
    def __call__(self, p: cute.Pointer, q: cute.Pointer, stream):
        self.kernel(p, q).launch(grid=(1,1,1), block=[32,1,1], stream=stream)
    @cute.kernel
    def kernel(self, p: cute.Pointer, q: cute.Pointer):
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        @cute.struct
        class S:
            w: cute.struct.Align[cute.struct.MemRange[cutlass.Uint32, 1024], 1024]
        st = smem.allocate(S)
        sb = I.shared_ptr_to_u32(st.w.data_ptr())
        g = I.gmem_address(p)
        x = I.ld_global_nc_u32(g + Int64(tidx) * 4)
        a, b, a2, b2 = I.dequant_e2m1x8_bf16(x)
        c, d, c2, c3 = I.dequant_e2m1x8_f16(x)
        e, f = I.scale_halves_s0e5m3_bf16(x, 0), I.bf16x2_mul_half(x, I.scale_halves_s0e5m3_bf16(x, 1), 1)
        h, i = I.scale_halves_s0e5m3_f16(x, 1), I.f16x2_mul_half(x, I.scale_halves_s0e5m3_f16(x, 0), 0)
        j, k = I.dequant_e8m0x4_bf16(x)
        l, m = I.dequant_e8m0x4_f16(x)
        n0, n1, n2, n3 = I.dequant_nf3_word_bf16(I.nf3_gather(x, a, b))
        r = I.bf16x2_mul(a, b) ^ I.f16x2_mul(c, d) ^ I.pair_broadcast_lane(e, 1) ^ I.pair_broadcast_lane(f, 0)
        r = r ^ I.f32_to_bf16x2_broadcast(Float32(1.5)) ^ I.pack_f32x2_bf16x2(Float32(1.0), Float32(2.0)) ^ I.pack_f32x2_f16x2(Float32(1.0), Float32(2.0))
        y0, y1 = I.bf16x2_to_f32x2(r)
        z0, z1 = I.f16x2_to_f32x2(r)
        d0, d1, d2, d3 = I.mma_bf16_m16n8k16(y0, y1, z0, z1, a, b, c, d, e, f)
        d0, d1, d2, d3 = I.mma_f16_m16n8k16(d0, d1, d2, d3, a, b, c, d, e, f)
        I.st_shared_v4_u32(sb + Int32(tidx) * 16, r ^ a2 ^ b2 ^ c2 ^ c3, h, i, j ^ k ^ l ^ m ^ n0 ^ n1 ^ n2 ^ n3)
        cute.arch.sync_threads()
        l0, l1, l2, l3 = I.ldmatrix_x4(sb + Int32(tidx) * 16)
        m0, m1 = I.ldmatrix_x2(sb + Int32(tidx) * 16)
        I.cp_async_16(sb + 512, g)
        I.cp_async_16_zfill(sb + 1024, g, Int32(tidx))
        I.mbarrier_init(sb + 2048, 1); I.fence_mbarrier_init()
        I.mbarrier_arrive_expect_tx(sb + 2048, 64); I.cp_async_bulk_g2s(sb + 1536, g, 64, sb + 2048)
        I.mbarrier_wait_parity(sb + 2048, Int32(0))
        cute.arch.cp_async_commit_group(); cute.arch.cp_async_wait_group(0)
        s = I.ld_shared_u32(sb) ^ Uint32(I.ld_shared_i32(sb)) 
        v0, v1 = I.ld_shared_v2_u32(sb + 8)
        w0, w1, w2, w3 = I.ld_shared_v4_u32(sb + 16)
        f0, f1, f2, f3 = I.ld_shared_v4_f32(sb + 32)
        fx = I.ld_shared_f32(sb + 4)
        I.st_shared_f32(sb, fx + f0); I.st_shared_i32(sb, Int32(3)); I.st_shared_u32(sb, s)
        I.st_shared_bf16_from_f32(sb, f1); I.st_shared_f16_from_f32(sb + 2, f2)
        I.st_shared_v4_f32(sb + 64, d0, d1, d2, d3)
        go = I.gmem_address(q)
        I.st_global_v4_u32(go, l0 ^ m0, l1 ^ m1, l2 ^ v0 ^ v1, l3 ^ w0 ^ w1 ^ w2 ^ w3)
        g0, g1, g2, g3 = I.ld_global_v4_f32(go + 16)
        I.st_global_v4_f32(go + 32, g0, g1, I.fabs_f32(g2), I.fmax_f32(g3, f3))
        old = I.atom_add_i32(go + 48, Int32(1))
        I.red_add_release_i32(go + 52, old)
        st_v = I.ld_global_acquire_i32(go + 56)
        I.st_global_i32(go + 60, st_v)
        I.st_global_release_i32(go + 64, st_v)
        I.red_add_v4_bf16x2(go + 112, r, r, r, r); I.red_add_v4_f16x2(go + 128, r, r, r, r)
        I.red_max_f32_nonnegative(go + 76, y0)
        flip = I.atom_add_release_i32(go + 84, Int32(1))
        I.prefetch_l2_bulk(g + Int64(256), 1024)
        g64, c64 = I.read_timers()
        I.st_global_v2_i64(go + 96, g64, c64 + Int64(flip))
        wr = I.warp_reduce(y1, "add") + I.warp_reduce(z1, "max") + Float32(I.sync_threads_count(Int32(tidx) & 1))
        I.st_global_v4_f32(go + 80, wr, wr, wr, wr)



INSTRUCTIONS = [
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
    "ldmatrix.sync.aligned.m8n8.x2.shared.b16",
    "cp.async.cg.shared.global",
    "ld.global.nc.b32",
    "ld.acquire.gpu.global.b32",
    "red.release.gpu.global.add.s32",
    "st.release.gpu.global.b32",
    "atom.global.add.s32",
    "red.global.add.noftz.v4.bf16x2",
    "red.global.add.noftz.v4.f16x2",
    "red.global.max.s32",
    "atom.release.gpu.global.add.u32",
    "%globaltimer",
    "%clock64",
    "st.global.v2.b64",
    "mul.rn.bf16x2",
    "mul.rn.f16x2",
    "prmt.b32",
    "shfl.sync.bfly",
    "ld.global.cg.v4.f32",
    "st.global.cg.v4.f32",
    "min.u16x2",
    "cvt.rn.bf16x2.f32",
    "cvt.rn.f16x2.f32",
    "ld.shared.v4.b32",
    "st.shared.v4.f32",
    "shl.b32",
    "mad.lo.u32",
    "bar.red.popc.u32",
    "mbarrier.init.shared::cta.b64",
    "fence.mbarrier_init.release.cluster",
    "mbarrier.arrive.expect_tx.shared::cta.b64",
    "mbarrier.try_wait.parity.shared::cta.b64",
    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
    "cp.async.bulk.prefetch.L2.global",
]


@pytest.fixture(scope="module")
def ptx() -> str:
    ptr = make_ptr(cutlass.Uint32, 16, cute.AddressSpace.gmem, assumed_align=16)
    with tempfile.TemporaryDirectory() as d:
        compiled = cute.compile(
            _AllIntrinsics(), ptr, ptr, make_fake_stream(),
            options=f"--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir {d}",
        )
    assert compiled.artifacts.CUBIN
    return compiled.artifacts.PTX


@pytest.mark.parametrize("instruction", INSTRUCTIONS)
def test_instruction_emitted(ptx, instruction):
    assert instruction in ptx


def test_gemm_kernel_compiles_without_spills():
    """One GEMM of each path (8-row direct, 8-row packed, 64-row packed) for sm_90a: ABI checked, no spills."""
    from cuteaot.codegen.compile import compile_kernel
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

    for block, routes, tile_n, tile_k, bps in ((8, "direct", 128, 128, 2), (8, "packed", 128, 128, 2),
                                               (64, "packed", 128, 64, 2), (48, "packed", 256, 64, 1)):
        spec = GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=tile_n, tile_k=tile_k, moe_block_size=block,
                        blocks_per_sm=bps, mul_topk_weights=True, routes=routes)
        record = compile_kernel(spec.key(), "sm_90a").record
        assert record["local_bytes"] == 0 and record["stack_bytes"] == 0, record
        assert record["registers"] * spec.threads * bps <= 65536
        assert record["dynamic_smem_bytes"] == spec.shared_bytes
        assert record["min_blocks_per_sm"] == bps


def _compiled_ptx(spec, threads: int, per_sm: int) -> str:
    """Compile a GEMM spec for sm_90a, check what the manifest will record (no spills, launch shape,
    co-residency, shared bytes) and return its PTX."""
    from cuteaot.codegen.compile import compile_kernel
    from cuteaot.codegen.kernels.w4a16.device import build_gemm

    record = compile_kernel(spec.key(), "sm_90a").record
    assert record["local_bytes"] == 0 and record["stack_bytes"] == 0, record
    assert record["block"] == [threads, 1, 1] and record["min_blocks_per_sm"] == per_sm
    assert record["registers"] * threads * per_sm <= 65536
    assert record["dynamic_smem_bytes"] == spec.shared_bytes
    kernel, args = build_gemm(spec)
    with tempfile.TemporaryDirectory() as d:
        return cute.compile(kernel, *args, options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {d}").artifacts.PTX


def test_wgmma_gemm_kernel_compiles():
    """The sm_90a large-M loop: register-A wgmma for every row variant, async-proxy fence, no spills."""
    from cuteaot.codegen.kernels.w4a16.wgmma import GROUPS_IN_FLIGHT
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

    # (16- to 48-row blocks: wgmma N = the block, the 128-wide tile at up to 4 CTAs an SM)
    for dtype, kind, block, tile_n, per_sm in (("bf16", "bf16", 64, 256, 2), ("fp16", "f16", 64, 128, 3),
                                               ("bf16", "bf16", 128, 128, 2), ("bf16", "bf16", 256, 128, 1),
                                               ("bf16", "bf16", 16, 128, 4), ("fp16", "f16", 48, 128, 3),
                                               ("bf16", "bf16", 128, 256, 1)):
        spec = GemmSpec(dtype=dtype, n=512, k=512, top_k=2, tile_n=tile_n, tile_k=64, moe_block_size=block,
                        blocks_per_sm=per_sm, mul_topk_weights=True, mainloop="wgmma")
        threads = 256 if block * tile_n == 256 * 128 else 128  # 256-row blocks, 128 x 256: two warpgroups
        assert spec.threads == threads
        ptx = _compiled_ptx(spec, threads, per_sm)
        # 128- and 256-row blocks: one main loop per row variant (the valid rows pick the narrowest N
        # covering them), in steps of 32 and 64
        step = {128: 32, 256: 64}.get(block, block)
        for n in range(step, block + 1, step):
            assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind}" in ptx, n
        assert f"m64n{block + 32}k16" not in ptx
        for instruction in ("wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned",
                            f"wgmma.wait_group.sync.aligned {GROUPS_IN_FLIGHT}", "fence.proxy.async.shared::cta"):
            assert instruction in ptx


def test_producer_warp_gemm_kernel_compiles():
    """The wgmma loop with a producer warpgroup: setmaxnreg splits the registers, full / empty mbarriers
    (cp.async arrives) and the compute warps' own named barrier; no spills, at launch within the CTA count."""
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec
    from cuteaot.runtime.kernels.w4a16.geometry import (PRODUCER_REGISTERS, WGMMA_WS_STAGES,
                                                        wgmma_ws_compute_registers)

    for dtype, block, per_sm, extra in (("bf16", 128, 2, dict(epilogue="silu", fast_math=True)),
                                        ("fp16", 256, 1, dict(k_in=488, mul_topk_weights=True))):
        spec = GemmSpec(dtype=dtype, n=512, k=512, top_k=2, tile_n=128, tile_k=64, moe_block_size=block,
                        blocks_per_sm=per_sm, mainloop="wgmma", producer_warp=True, stages=WGMMA_WS_STAGES[block],
                        **extra)
        threads = block + 128  # one or two compute warpgroups, one producer warpgroup
        assert spec.threads == threads
        ptx = _compiled_ptx(spec, threads, per_sm)
        # the setmaxnreg split stays within what the CTA holds at launch
        compute = wgmma_ws_compute_registers(block, per_sm)
        assert compute * block + PRODUCER_REGISTERS * 128 <= 65536 // per_sm
        for instruction in (f"setmaxnreg.dec.sync.aligned.u32 {PRODUCER_REGISTERS}",
                            f"setmaxnreg.inc.sync.aligned.u32 {compute}",
                            "cp.async.mbarrier.arrive.noinc.shared::cta.b64", "mbarrier.try_wait.parity.shared::cta.b64",
                            f"bar.sync 1, {block};", "bar.sync 2, 128;", "fence.proxy.async.shared::cta"):
            assert instruction in ptx, instruction
        assert re.search(rf"bar\.red\.popc\.u32 %r\d+, 1, {block}, ", ptx)  # the route count, compute warps only


def test_wgmma_spec_is_validated():
    from cuteaot.runtime import BadInputError
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

    with pytest.raises(BadInputError, match="mainloop=wgmma implements"):
        GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=128, tile_k=128, moe_block_size=64,
                 blocks_per_sm=2, mainloop="wgmma")
    with pytest.raises(BadInputError, match="moe_block_size must be one of"):  # wgmma N = 8 is not built
        GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=256, tile_k=64, moe_block_size=8,
                 blocks_per_sm=2, mainloop="wgmma")
    # 128 rows x 256 columns: two warpgroups (the measured "tallwide" choice), never with a producer warpgroup
    two = GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=256, tile_k=64, moe_block_size=128,
                   blocks_per_sm=1, mainloop="wgmma")
    assert two.threads == 256 and two.shared_bytes == 2064 + 1024 + 4 * (16384 + 8192 + 1024)
    with pytest.raises(BadInputError, match="producer_warp must be None or True"):
        GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=256, tile_k=64, moe_block_size=128,
                 blocks_per_sm=1, mainloop="wgmma", producer_warp=True)
    with pytest.raises(BadInputError, match="moe_block_size must be one of"):  # mma.sync: no 128, no 256
        GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=128, tile_k=64, moe_block_size=128, blocks_per_sm=2)
    with pytest.raises(BadInputError, match="moe_block_size must be one of"):
        GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=128, tile_k=64, moe_block_size=256, blocks_per_sm=1)
    with pytest.raises(BadInputError, match="mainloop=wgmma implements"):  # 256 rows: the 128-wide tile only
        GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=256, tile_k=64, moe_block_size=256,
                 blocks_per_sm=1, mainloop="wgmma")
    wide = GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=128, tile_k=64, moe_block_size=256,
                    blocks_per_sm=1, mainloop="wgmma")
    assert wide.threads == 256 and wide.shared_bytes == 154640  # route metadata + align + 4 x 37376-byte stages
    ws = GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=128, tile_k=64, moe_block_size=256,
                  blocks_per_sm=1, mainloop="wgmma", producer_warp=True)
    # + the ring counters, 2 x 4 mbarriers, 256 source rows, and the 256 x 272-byte output tile
    assert ws.threads == 384 and ws.shared_bytes == 154640 + 16 + 64 + 1024 + 256 * 272
    assert ws.key() != wide.key() and "producer_warp" not in wide.key().facts
    for bad in (dict(moe_block_size=64, tile_n=256, blocks_per_sm=2), dict(mainloop="mma_sync", moe_block_size=64),
                dict(producer_warp=False)):
        args = dict(dtype="bf16", n=512, k=512, top_k=2, tile_n=128, tile_k=64, moe_block_size=256, blocks_per_sm=1,
                    mainloop="wgmma", producer_warp=True) | bad
        with pytest.raises(BadInputError, match="producer_warp must be None or True"):
            GemmSpec(**args)
    # 128-row blocks of a 256-row packing (a layer's FC2 after FC1 on 256-row blocks): its own key fact
    args = dict(dtype="bf16", n=512, k=512, top_k=1, tile_n=128, tile_k=64, moe_block_size=128, blocks_per_sm=2,
                mainloop="wgmma")
    viewed = GemmSpec(**args, packing_block=256)
    assert viewed.key() != GemmSpec(**args).key() and "packing_block" not in GemmSpec(**args).key().facts
    for bad in (128, 384, 64, True, "256"):
        with pytest.raises(BadInputError, match="packing_block must be None"):
            GemmSpec(**args, packing_block=bad)


def test_bias_epilogue_compiles_without_spills():
    """The per-expert bias epilogue on each loop (8-row direct with the fused top-k sum, 64-row
    mma.sync with relu2, wgmma): one 16-byte bias load per stored chunk, no spills."""
    from cuteaot.codegen.compile import compile_kernel
    from cuteaot.codegen.kernels.w4a16.device import build_gemm
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

    specs = (
        GemmSpec(dtype="fp16", n=512, k=512, top_k=1, tile_n=128, tile_k=128, moe_block_size=8, blocks_per_sm=2,
                 mul_topk_weights=True, routes="direct", sum_topk=4, n_out=504, bias=True),
        GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=128, tile_k=64, moe_block_size=64, blocks_per_sm=2,
                 epilogue="relu2", bias=True),
        GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=256, tile_k=64, moe_block_size=64, blocks_per_sm=2,
                 mul_topk_weights=True, mainloop="wgmma", bias=True),
    )
    for spec in specs:
        record = compile_kernel(spec.key(), "sm_90a").record
        assert record["local_bytes"] == 0 and record["stack_bytes"] == 0, record
        kernel, args = build_gemm(spec)
        with tempfile.TemporaryDirectory() as d:
            ptx = cute.compile(kernel, *args, options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {d}").artifacts.PTX
        assert "ld.global.nc.v4.b32" in ptx
        if spec.sum_topk:  # the top-k sum adds each 16-byte chunk with one vector reduction
            assert "red.global.add.noftz.v4.f16x2" in ptx and "red.global.add.noftz.f16x2" not in ptx
        plain = dataclasses.replace(spec, bias=False)
        kernel, args = build_gemm(plain)
        with tempfile.TemporaryDirectory() as d:
            ptx = cute.compile(kernel, *args, options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {d}").artifacts.PTX
        assert "ld.global.nc.v4.b32" not in ptx  # without bias the epilogue reads nothing more


def test_masked_tail_tiles_compile_without_spills():
    """N and K = 64 (mod 128), stored unpadded: the last 128-wide N tile and 128-deep k-tile are masked
    (weight and scale copies there zero-filled without a read) on the mma.sync loop (8-row direct with the
    fused top-k sum, 64-row packed) and the wgmma loop; no spills, and kernels without tails copy as before."""
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

    zfill = re.compile(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\d+B)? \[[^]]+\], \[[^]]+\], (16|8|4), ")

    def zero_filled_copies(spec) -> int:
        return len(zfill.findall(_compiled_ptx(spec, spec.threads, spec.blocks_per_sm)))

    specs = (
        GemmSpec(dtype="bf16", n=576, k=320, top_k=1, tile_n=128, tile_k=128, moe_block_size=8, blocks_per_sm=2,
                 mul_topk_weights=True, routes="direct", sum_topk=4),
        GemmSpec(dtype="fp16", n=576, k=320, top_k=2, tile_n=128, tile_k=64, moe_block_size=64, blocks_per_sm=2,
                 epilogue="relu2"),
        GemmSpec(dtype="bf16", n=576, k=320, top_k=2, tile_n=128, tile_k=64, moe_block_size=64, blocks_per_sm=3,
                 mul_topk_weights=True, mainloop="wgmma"),
        # read as stored (modelopt): the rows of a last N tile past N; its k-tiles are 64 deep where K = 64 mod 128
        GemmSpec(dtype="bf16", n=576, k=320, top_k=1, tile_n=128, tile_k=64, moe_block_size=8, blocks_per_sm=4,
                 mul_topk_weights=True, routes="direct", layout="modelopt", scale_exponent=15),
        GemmSpec(dtype="fp16", n=576, k=320, top_k=2, tile_n=128, tile_k=64, moe_block_size=32, blocks_per_sm=2,
                 epilogue="relu2", layout="modelopt", scale_exponent=0),
        GemmSpec(dtype="bf16", n=576, k=320, top_k=2, tile_n=128, tile_k=64, moe_block_size=128, blocks_per_sm=2,
                 mul_topk_weights=True, mainloop="wgmma", layout="modelopt", scale_exponent=15),
    )
    for spec in specs:
        assert spec.n_tail and spec.n_tiles == 5 and spec.k_tail == (spec.tile_k == 128)
        whole = dataclasses.replace(spec, n=640, k=384)  # the same kernel on whole tiles
        assert not (whole.n_tail or whole.k_tail)
        # the activation copies zero-fill rows past the block's routes either way; a tail adds the weight and
        # scale copies
        assert zero_filled_copies(spec) > zero_filled_copies(whole)


def test_masked_tails_only_where_a_loop_masks_them():
    from cuteaot.runtime import BadInputError
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

    base = dict(dtype="bf16", n=576, k=512, top_k=2, tile_n=128, tile_k=64, moe_block_size=64, blocks_per_sm=2)
    assert GemmSpec(**base).n_tail
    with pytest.raises(BadInputError, match="multiples of 64"):
        GemmSpec(**base | dict(n=544))
    assert GemmSpec(**base | dict(layout="modelopt", scale_exponent=15)).n_tail  # N rows masked as stored
    with pytest.raises(BadInputError, match="the modelopt layout N only"):
        GemmSpec(**base | dict(n=512, k=576, tile_k=128, layout="modelopt", scale_exponent=15))
    with pytest.raises(BadInputError, match="the modelopt layout N only"):
        GemmSpec(**base | dict(n=512, k=576, tile_k=128, layout="nf3", scale_format="e4m3_k32", moe_block_size=16))
    with pytest.raises(BadInputError, match="whole tiles of gate"):  # a gated tile stages whole gate | up pairs
        GemmSpec(**base | dict(n=640, tile_n=256, mainloop="wgmma", epilogue="silu", fast_math=True))


def test_decode_kernel_reads_fc2s_first_route_while_waiting_at_the_grid_barrier():
    """The fused decode kernel (direct routes) reads FC2's first route (expert id, router weight) and prefetches
    its first tile's first stages into L2 between its arrival at the grid barrier and the spin on the release:
    after the add, so the release fence does not wait for them, and before the spin.  The packed plan's kernel
    (same shape) does neither: its barrier is as before."""
    from cuteaot.codegen.compile import BUILDERS, compile_kernel
    from cuteaot.runtime.kernels.w4a16.fused_spec import FusedSpec

    decode = FusedSpec("bf16", 512, 256, 4, "silu", 128, 128, 128, 128, 8, 1, decode=True)
    packed = dataclasses.replace(decode, decode=False)
    for spec in (decode, packed):
        record = compile_kernel(spec.key(), "sm_90a").record
        assert record["local_bytes"] == 0 and record["stack_bytes"] == 0, record
        obj, args = BUILDERS[spec.FAMILY](spec)
        with tempfile.TemporaryDirectory() as d:
            ptx = cute.compile(obj, *args, options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {d}").artifacts.PTX
        arrive = ptx.index("atom.release.gpu.global.add.u32")
        spin = ptx.index("ld.acquire.gpu.global.b32", arrive)
        between = ptx[arrive:spin]
        if spec.decode:
            assert between.count("cp.async.bulk.prefetch.L2.global") == 2  # a weight row and a scale row
            assert "ld.global.nc.b32" in between and "ld.global.nc.f32" in between  # expert, router weight
        else:
            assert "cp.async.bulk.prefetch.L2" not in ptx and "ld.global" not in between
