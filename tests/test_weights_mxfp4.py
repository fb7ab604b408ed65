"""MXFP4 (gpt-oss) preparation and per-expert biases: exactness through the device-decode emulation.

The packed MXFP4 weights must decode (as the GEMM decodes them, tests/reference/nvfp4.py) to
exactly the checkpoint's values (tests/reference/mxfp4.py, written from the format's definition).
"""

from __future__ import annotations

import pytest
import torch

from cuteaot.runtime import BadInputError
from cuteaot.runtime.weights import (
    MXFP4_EXPONENT_WINDOW,
    PackedNvfp4,
    prepare_w2,
    prepare_w2_mxfp4,
    prepare_w13,
    prepare_w13_mxfp4,
    unpack_nvfp4,
)

from tests.reference.mxfp4 import dequantize_mxfp4, random_mxfp4
from tests.reference.nvfp4 import decode_packed_like_device, quantize_nvfp4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _decode(packed: PackedNvfp4, dtype: str) -> torch.Tensor:
    full = decode_packed_like_device(packed.qweight, packed.scales, packed.global_scale, dtype)
    assert not full[:, packed.n:].any() and not full[:, :, packed.k:].any(), "padding must decode to zero"
    return full[:, : packed.n, : packed.k]


def _interleave(gate_up: torch.Tensor) -> torch.Tensor:
    """[gate | up] rows (dim 1) -> gate, up, gate, up, ... (gpt-oss's order)."""
    half = gate_up.shape[1] // 2
    return torch.stack((gate_up[:, :half], gate_up[:, half:]), dim=2).flatten(1, 2)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("experts,n,k", [(2, 64, 64), (3, 72, 96), (1, 200, 160)])  # N, K tails: padded storage
def test_w2_mxfp4_decodes_exactly(dtype, experts, n, k):
    blocks, scales = random_mxfp4(experts, n, k, _gen(n + k), spread=8)
    packed = prepare_w2_mxfp4(blocks, scales, dtype)
    assert (packed.n, packed.k, packed.num_experts) == (n, k, experts)
    assert torch.equal(_decode(packed, dtype), dequantize_mxfp4(blocks, scales))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_w13_mxfp4_deinterleaves_gate_and_up(dtype):
    experts, inter, hidden = 3, 40, 64
    blocks, scales = random_mxfp4(experts, 2 * inter, hidden, _gen(7))
    packed = prepare_w13_mxfp4(blocks, scales, dtype)  # gpt-oss: interleaved
    want = dequantize_mxfp4(blocks, scales)
    want = torch.cat((want[:, 0::2], want[:, 1::2]), dim=1)  # [gate | up]
    assert torch.equal(_decode(packed, dtype), want)
    gate_first = prepare_w13_mxfp4(blocks, scales, dtype, order="gate_up")
    assert torch.equal(_decode(gate_first, dtype), dequantize_mxfp4(blocks, scales))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_widest_allowed_scale_span_is_exact_and_one_more_is_refused(dtype):
    lo, hi = MXFP4_EXPONENT_WINDOW[dtype]
    blocks, scales = random_mxfp4(2, 64, 128, _gen(3), spread=0, center=127)
    blocks[..., 0] = 0x21  # every block holds codes 1 and 2 (0.5, 1.0): none is all-zero
    scales[0, 0, 0], scales[0, 1, 0] = 140, 140 - (hi - lo)  # expert 0 spans exactly the window
    packed = prepare_w2_mxfp4(blocks, scales, dtype)
    assert torch.equal(_decode(packed, dtype), dequantize_mxfp4(blocks, scales))
    scales[1, 0, 0], scales[1, 1, 0] = 140, 140 - (hi - lo) - 1
    with pytest.raises(BadInputError, match=rf"expert 1 span .* allows {hi - lo + 1} octaves"):
        prepare_w2_mxfp4(blocks, scales, dtype)


def test_all_zero_blocks_do_not_count_against_the_span():
    blocks, scales = random_mxfp4(1, 64, 64, _gen(4), spread=2)
    blocks[0, 0, 0] = 0x88  # +-0 codes only (sign bits set): no value, any scale
    scales[0, 0, 0] = 1  # 2**-126, 120 octaves below the others
    packed = prepare_w2_mxfp4(blocks, scales, "bf16")
    assert torch.equal(_decode(packed, "bf16"), dequantize_mxfp4(blocks, scales))


def test_mxfp4_bad_inputs_are_refused():
    blocks, scales = random_mxfp4(2, 64, 64, _gen(5))
    with pytest.raises(BadInputError, match="NaN scale"):
        bad = scales.clone()
        bad[1, 3, 0] = 0xFF
        prepare_w2_mxfp4(blocks, bad, "bf16")
    with pytest.raises(BadInputError, match=r"\[E, N, K/32\]"):
        prepare_w2_mxfp4(blocks, scales[:, :, :1].contiguous(), "bf16")
    with pytest.raises(BadInputError, match=r"\[E, N, K/32, 16\]"):
        prepare_w2_mxfp4(blocks.view(2, 64, 1, 32), scales[:, :, :1].contiguous(), "bf16")
    with pytest.raises(BadInputError, match="uint8"):
        prepare_w2_mxfp4(blocks.to(torch.int32), scales, "bf16")
    with pytest.raises(BadInputError, match="multiple of 8"):
        prepare_w13_mxfp4(blocks[:, :63].contiguous(), scales[:, :63].contiguous(), "bf16")


@pytest.mark.parametrize("order", ["gate_up", "up_gate", "interleaved"])
def test_w13_bias_follows_the_weight_rows(order):
    experts, inter, hidden = 2, 32, 64
    gen = _gen(11)
    weight, weight_scale, scale_2 = quantize_nvfp4(torch.randn(experts, 2 * inter, hidden, generator=gen))
    gate_up_bias = torch.randn(experts, 2 * inter, generator=gen).to(torch.bfloat16)  # [gate | up]
    if order == "up_gate":
        stored = torch.cat((gate_up_bias[:, inter:], gate_up_bias[:, :inter]), dim=1)
        weight, weight_scale = (torch.cat((t[:, inter:], t[:, :inter]), dim=1) for t in (weight, weight_scale))
    elif order == "interleaved":
        stored = _interleave(gate_up_bias)
        weight, weight_scale = _interleave(weight), _interleave(weight_scale)
    else:
        stored = gate_up_bias
    packed = prepare_w13(weight, weight_scale, scale_2, "bf16", order=order, bias=stored)
    assert torch.equal(packed.bias, gate_up_bias)
    blocks, scales = random_mxfp4(experts, 2 * inter, hidden, gen)
    mx = prepare_w13_mxfp4(blocks, scales, "bf16", order=order, bias=stored)
    assert torch.equal(mx.bias, gate_up_bias)


def test_bias_is_converted_checked_and_moved_with_the_weights():
    gen = _gen(12)
    weight, weight_scale, scale_2 = quantize_nvfp4(torch.randn(2, 64, 64, generator=gen))
    bias = torch.randn(2, 64, generator=gen)  # float32 checkpoint bias -> the activation dtype
    packed = prepare_w2(weight, weight_scale, scale_2, "fp16", bias=bias)
    assert packed.bias.dtype == torch.float16 and torch.equal(packed.bias, bias.half())
    assert torch.equal(packed.to("cpu").bias, packed.bias)
    with pytest.raises(BadInputError, match=r"shape \(E, N\) = \(2, 64\)"):
        prepare_w2(weight, weight_scale, scale_2, "bf16", bias=bias[:, :32])
    with pytest.raises(BadInputError, match="finite in fp16"):
        prepare_w2(weight, weight_scale, scale_2, "fp16", bias=bias * 1e6)
    with pytest.raises(BadInputError, match="floating-point"):
        prepare_w2(weight, weight_scale, scale_2, "bf16", bias=torch.zeros(2, 64, dtype=torch.int32))
    with pytest.raises(BadInputError, match="PackedNvfp4.bias"):
        PackedNvfp4(packed.qweight, packed.scales, packed.global_scale, 2, 64, 64, packed.dtype,
                    bias=torch.zeros(2, 64, dtype=torch.bfloat16))  # fp16 weights, bf16 bias


def test_scales_whose_global_scale_overflows_name_the_e8m0_limit():
    blocks = torch.full((1, 64, 2, 16), 0x22, dtype=torch.uint8)
    for dtype, top in (("bf16", 32), ("fp16", 127)):  # the largest e8m0 exponent each dtype packs
        prepare_w2_mxfp4(blocks, torch.full((1, 64, 2), 127 + top, dtype=torch.uint8), dtype)
    with pytest.raises(BadInputError, match=r"w2_scales of expert 0 reach 2\*\*33; bf16 layers take e8m0 block "
                                            r"scales up to 2\*\*32"):
        prepare_w2_mxfp4(blocks, torch.full((1, 64, 2), 127 + 33, dtype=torch.uint8), "bf16")


def test_unpacking_mxfp4_weights_e4m3_cannot_hold_is_refused():
    blocks = torch.full((1, 64, 2, 16), 0x22, dtype=torch.uint8)
    scales = torch.full((1, 64, 2), 127, dtype=torch.uint8)
    scales[0, 0, 0] = 127 - 3  # 2**-3 relative: an e4m3 value, so ModelOpt tensors hold it
    weight, weight_scale, _ = unpack_nvfp4(prepare_w2_mxfp4(blocks, scales, "bf16"))
    assert weight.shape == (1, 64, 32) and weight_scale.shape == (1, 64, 4)
    scales[0, 0, 0] = 127 - 20  # below e4m3's smallest subnormal relative to the largest scale
    with pytest.raises(BadInputError, match="e4m3 cannot express"):
        unpack_nvfp4(prepare_w2_mxfp4(blocks, scales, "bf16"))
