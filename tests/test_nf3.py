"""NF3 weights on the CPU: packing round trips, the device decode emulated bit by bit against
the independent reference dequantizer, quantize_nf3, refusals, planning and one compiled kernel."""

from __future__ import annotations

import pytest
import torch

from cuteaot.runtime.errors import BadInputError
from cuteaot.runtime.nf3 import (
    GATHER_MASKS, NF3_CODEBOOK_BF16, POOL_A, POOL_B, SLAB_ROW_WORDS, X01_PLANE, X2_BASE, X2_PLANE, PackedNf3,
    pack_nf3, prepare_w2_nf3, prepare_w13_nf3, quantize_nf3, unpack_nf3,
)
from cuteaot.runtime.types import WeightFormat
from cuteaot.runtime.weights import SCALE_DECODE_EXPONENT, DType
from tests.reference.nf3 import CODEBOOK, dequantize_nf3, random_nf3


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 (default mode) on Python ints: byte i of the result is byte nibble_i of b:a."""
    pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nibble = (selector >> 4 * i) & 0xF
        byte = pool[nibble & 7]
        if nibble & 8:  # sign-replicate mode: never used by the NF3 decode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


def _decode_word(y: int) -> list[int]:
    """codegen/intrinsics.dequant_nf3_word_bf16, instruction by instruction."""
    regs = []
    for w in (y, y >> 2):
        t = (w & 0x23232323) | 0x40404040  # m bits 0, 1 and the sign kept; the high nibble's pool-B bit
        s = ((w & 0x02020202) * 8 + t) & 0xFFFFFFFF  # m's high bit copied to bit 4
        regs += [_prmt(POOL_A, POOL_B, s & 0xFFFF), _prmt(POOL_A, POOL_B, s >> 16)]
    return regs


def _gather(x0: int, x1: int, x2: int) -> int:
    m0, m1, m2 = GATHER_MASKS
    return ((x0 >> 4) & m0) | ((x1 >> 3) & m1) | ((x2 << 1) & m2 & 0xFFFFFFFF)


def _bf16(bits: int) -> float:
    return torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).item()


def emulate_device_weights(packed: PackedNf3) -> torch.Tensor:
    """The weights the GEMM multiplies: each lane's words decoded as the kernel does, placed at the
    (column, k) its MMA fragments stand for (docs/layouts.md), times the scale and global scale."""
    e_count, ns, ks = packed.num_experts, packed.n_stored, packed.k_stored
    words = (packed.qweight.to(torch.int64) & 0xFFFFFFFF).tolist()
    w = torch.empty(e_count, ns, ks)
    for e in range(e_count):
        for row in range(ks // 32):
            line = words[e][row]
            for slab in range(ns // 64):
                base = slab * SLAB_ROW_WORDS
                for kk in range(2):
                    for lane in range(32):
                        x0 = line[base + kk * X01_PLANE + 2 * lane]
                        x1 = line[base + kk * X01_PLANE + 2 * lane + 1]
                        x2 = line[base + X2_BASE + kk * X2_PLANE + lane]
                        g, t = lane // 4, lane % 4
                        for jj, y in enumerate((x0, x1, x2, _gather(x0, x1, x2))):
                            for j, reg in enumerate(_decode_word(y)):
                                col = 64 * slab + 16 * jj + 8 * (j // 2) + g
                                k = 32 * row + 16 * kk + 2 * t + 8 * (j % 2)
                                w[e, col, k] = _bf16(reg)
                                w[e, col, k + 1] = _bf16(reg >> 16)
    codes, scales, scale_2 = unpack_nf3(packed)
    block = torch.nn.functional.pad(scales.float(), (0, (ks - packed.k) // 32, 0, ns - packed.n), value=1.0)
    return (w * block.repeat_interleave(32, -1) * scale_2.view(-1, 1, 1))[:, : packed.n, : packed.k]


def test_codebook_bf16_and_pools():
    assert NF3_CODEBOOK_BF16.float().tolist() == torch.tensor(CODEBOOK).to(torch.bfloat16).float().tolist()
    for m in range(4):  # every magnitude's bf16 bits from the two pools
        lo, hi = (POOL_A >> 8 * m) & 0xFF, (POOL_B >> 8 * (m >> 1)) & 0xFF
        assert _bf16(hi << 8 | lo) == NF3_CODEBOOK_BF16[4 + m].item()


@pytest.mark.parametrize("n, k", [(128, 128), (192, 160), (8, 32)])
def test_pack_round_trip_and_device_decode(n, k):
    """Logical tails (N, K not multiples of 128) included: the padding is never read."""
    g = torch.Generator().manual_seed(n + k)
    codes, scales, scale_2 = random_nf3(2, n, k, g)
    packed = pack_nf3(codes, scales, scale_2)
    assert packed.qweight.shape == (2, packed.k_stored // 32, 3 * packed.n_stored)
    back = unpack_nf3(packed)
    assert torch.equal(back[0], codes) and torch.equal(back[1].view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(back[2], scale_2)
    # the kernel's decode of the packed words is the reference's value with bf16 code points
    want = dequantize_nf3(codes, scales, scale_2)
    got = emulate_device_weights(packed)
    book16 = NF3_CODEBOOK_BF16.float()
    exact = book16[codes.long()] * scales.float().repeat_interleave(32, -1) * scale_2.view(-1, 1, 1)
    assert torch.equal(got, exact)
    assert torch.allclose(got, want, rtol=2**-8, atol=0)


def test_global_scale_carries_the_decode_compensation():
    codes, scales, scale_2 = random_nf3(1, 64, 64, torch.Generator().manual_seed(0), scale_2=0.25)
    packed = pack_nf3(codes, scales, scale_2)
    assert packed.global_scale.item() == 0.25 * 2.0 ** -SCALE_DECODE_EXPONENT[DType.BF16]
    assert packed.weights is WeightFormat.NF3 and packed.layout == "nf3" and packed.scale_format == "e4m3_k32"


def test_w13_orders_and_bias_rows():
    g = torch.Generator().manual_seed(5)
    codes, scales, scale_2 = random_nf3(2, 128, 64, g)
    bias = torch.randn(2, 128, generator=g)
    plain = prepare_w13_nf3(codes, scales, scale_2, bias=bias)
    swapped = prepare_w13_nf3(torch.cat((codes[:, 64:], codes[:, :64]), 1),
                              torch.cat((scales[:, 64:], scales[:, :64]), 1), scale_2, order="up_gate",
                              bias=torch.cat((bias[:, 64:], bias[:, :64]), 1))
    assert torch.equal(plain.qweight, swapped.qweight) and torch.equal(plain.bias, swapped.bias)
    inter = prepare_w13_nf3(torch.stack((codes[:, :64], codes[:, 64:]), 2).flatten(1, 2),
                            torch.stack((scales[:, :64], scales[:, 64:]), 2).flatten(1, 2), scale_2,
                            order="interleaved")
    assert torch.equal(plain.qweight, inter.qweight)


def test_quantize_nf3_error_and_contract():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 64, 256, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)
    w[0, :4, :32] = 0.0  # an all-zero block: the smallest scale, never a zero one
    codes, scales, scale_2 = quantize_nf3(w)
    assert codes.dtype == torch.uint8 and int(codes.max()) < 8 and scales.dtype == torch.float8_e4m3fn
    assert bool((scales.float() > 0).all())
    back = dequantize_nf3(codes, scales, scale_2)
    err = float((back - w).norm() / w.norm())
    assert err < 0.2, err  # a 3-bit codebook on Gaussian weights: ~0.1 relative error
    prepare_w2_nf3(codes, scales, scale_2)  # what quantize_nf3 returns packs as it is



def test_quantize_nf3_keeps_zeros_zero_on_average():
    """NF3 has no zero code: an all-zero expert takes scale_2 = 0 (exact zeros), and zeros inside a live
    block alternate between +-0.1275 along k (no bias in a dot product)."""
    w = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(4))
    w[0] = 0.0
    w[1, :, 32:64] = torch.where(torch.arange(32) < 4, 1.0, 0.0)  # 28 zeros beside values in one block
    codes, scales, scale_2 = quantize_nf3(w)
    assert float(scale_2[0]) == 0.0 and float(scale_2[1]) > 0
    back = dequantize_nf3(codes, scales, scale_2)
    assert not bool(back[0].any())
    zeros = back[1, :, 36:64]
    assert bool((zeros != 0).all()) and float(zeros.sum()) == 0.0  # as many up as down
    prepare_w2_nf3(codes, scales, scale_2)  # a zero global scale packs

def test_refusals():
    g = torch.Generator().manual_seed(1)
    codes, scales, scale_2 = random_nf3(1, 64, 64, g)
    with pytest.raises(BadInputError, match="indices 0..7"):
        pack_nf3(codes | 8, scales, scale_2)
    with pytest.raises(BadInputError, match="zero block scale"):
        pack_nf3(codes, scales.float().mul(0).to(torch.float8_e4m3fn), scale_2)
    with pytest.raises(BadInputError, match=r"\[E, N, K/32\]"):
        pack_nf3(codes, scales[..., :1].contiguous(), scale_2)
    with pytest.raises(BadInputError, match="K % 32"):
        pack_nf3(codes[..., :48].contiguous(), scales[..., :1].contiguous(), scale_2)
    packed = pack_nf3(codes, scales, scale_2)
    from cuteaot.runtime.weights import unpack_nvfp4

    with pytest.raises(BadInputError, match="use unpack_nf3"):
        unpack_nvfp4(packed)
    with pytest.raises(BadInputError, match="bf16 activations only"):
        PackedNf3(packed.qweight, packed.scales, packed.global_scale, 1, 64, 64, DType.FP16)


def test_planner_keeps_nf3_on_the_mma_sync_loop():
    from cuteaot.codegen.kernels.w4a16.fused_planning import fused_spec_for, plan_layer, split_layer
    from cuteaot.runtime.devices import PROFILES
    from cuteaot.runtime.resolution import MoeLayerFacts

    facts = MoeLayerFacts(dtype="bf16", hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8,
                          activation="silu", weights="nf3")
    for m in (1, 8, 64, 256, 4096, 16384):
        spec = fused_spec_for(plan_layer(m, facts, PROFILES["h200"]), facts)
        assert spec.mainloop.value == "mma_sync" and spec.fc1_gemm.nf3 and spec.fc2_gemm.scale_format == "e4m3_k32"
        assert split_layer(m, facts, PROFILES["h200"]) is None
    with pytest.raises(BadInputError, match="bf16 activations only"):
        MoeLayerFacts(dtype="fp16", hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8,
                      activation="silu", weights="nf3")


def test_spec_validates_nf3_combinations(tmp_path):
    from cuteaot.codegen.spec import SpecError, load_spec

    base = ("bundle: t\ntargets: [h200]\nmoe:\n  - name: p\n    hidden_size: 512\n    intermediate_size: 256\n"
            "    num_experts: 8\n    top_k: 2\n    activation: silu\n    tokens: [1, 64]\n")
    cases = {"dtype: fp16\n    weights: nf3\n    fused: true\n": "bf16 activations only",
             "dtype: bf16\n    weights: nf3\n    gemm: true\n    fused: true\n": "read NVFP4",
             "dtype: bf16\n    weights: nf3\n": "need fused layers"}
    for extra, message in cases.items():
        path = tmp_path / "s.yaml"
        path.write_text(base + "    " + extra)
        with pytest.raises(SpecError, match=message):
            load_spec(path)
    path.write_text(base + "    dtype: bf16\n    weights: [nvfp4, nf3]\n    fused: true\n")
    problem = load_spec(path).moe[0]
    assert {f.weights for f in problem.layer_facts()} == {WeightFormat.NVFP4, WeightFormat.NF3}


def test_nf3_kernels_compile_without_spills():
    from cuteaot.codegen.compile import compile_kernel
    from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

    for block, routes, tile_n, tile_k, bps in ((8, "direct", 128, 128, 2), (64, "packed", 128, 64, 2)):
        spec = GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=tile_n, tile_k=tile_k, moe_block_size=block,
                        blocks_per_sm=bps, mul_topk_weights=True, routes=routes, layout="nf3",
                        scale_format="e4m3_k32")
        record = compile_kernel(spec.key(), "sm_90a").record
        assert record["local_bytes"] == 0 and record["stack_bytes"] == 0, record
        assert record["dynamic_smem_bytes"] == spec.shared_bytes
    with pytest.raises(BadInputError, match="mma.sync loop for bf16"):
        GemmSpec(dtype="fp16", n=512, k=512, top_k=2, tile_n=128, tile_k=128, moe_block_size=8, blocks_per_sm=2,
                 layout="nf3", scale_format="e4m3_k32")
