"""NVFP4 weight preparation: round trip, device-decode emulation against ModelOpt, W13/W2, errors."""

from __future__ import annotations

import warnings

import pytest
import torch

from cuteaot.runtime import BadInputError, DType
from cuteaot.runtime.weights import (
    stored_dims,
    PackedNvfp4,
    pack_nvfp4,
    prepare_w2,
    prepare_w13,
    unpack_nvfp4,
)

from tests.reference.nvfp4 import decode_packed_like_device, dequantize_modelopt, quantize_nvfp4

COMPENSATION = {"bf16": 2.0**103, "fp16": 2.0**7}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_modelopt(experts, n, k, *, min_scale_byte, seed=0):
    """Arbitrary bit patterns: every nibble, and e4m3 scales from `min_scale_byte` up to 448 (0x7E)."""
    gen = _gen(seed)
    weight = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
    scale_bytes = torch.randint(min_scale_byte, 0x7F, (experts, n, k // 16), generator=gen, dtype=torch.uint8)
    scale_bytes[..., 0] = 0  # a zero scale encodes to byte 0 and must come back as zero
    scale_2 = torch.rand(experts, generator=gen) * 1e-2 + 1e-5
    return weight, scale_bytes.view(torch.float8_e4m3fn), scale_2


def _realistic_weights(experts, n, k, seed=0):
    """Gaussian weights whose blocks span two decades of magnitude (varied block scales)."""
    gen = _gen(seed)
    w = torch.randn(experts, n, k, generator=gen)
    block_gain = 10.0 ** (-2 * torch.rand(experts, n, k // 16, 1, generator=gen))
    expert_gain = torch.rand(experts, 1, 1, 1, generator=gen) * 0.1 + 0.01
    return (w.view(experts, n, k // 16, 16) * block_gain * expert_gain).view(experts, n, k)


def _assert_same_packed(a: PackedNvfp4, b: PackedNvfp4):
    assert torch.equal(a.qweight, b.qweight)
    assert torch.equal(a.scales, b.scales)
    assert torch.equal(a.global_scale, b.global_scale)
    assert (a.n, a.k, a.num_experts, a.dtype) == (b.n, b.k, b.num_experts, b.dtype)



def _decode(packed, dtype):
    """The device-decode emulation of the stored (padded) matrix, cropped to the logical N x K;
    the padding must decode to exact zeros."""
    full = decode_packed_like_device(packed.qweight, packed.scales, packed.global_scale, dtype)
    assert not full[:, packed.n :].any() and not full[:, :, packed.k :].any(), "padding must be zero"
    return full[:, : packed.n, : packed.k]

@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("experts,n,k", [(1, 64, 64), (3, 128, 192), (2, 320, 128), (2, 40, 48), (2, 128, 320)])
def test_pack_unpack_round_trip_is_bit_exact(dtype, experts, n, k):
    weight, scale, scale_2 = _random_modelopt(experts, n, k, min_scale_byte=0x00, seed=n + k)
    packed = pack_nvfp4(weight, scale, scale_2, dtype)
    n_stored, k_stored = stored_dims(n, k)  # zero-padded to multiples of 64
    assert packed.qweight.shape == (experts, k_stored // 16, 2 * n_stored) and packed.qweight.dtype == torch.int32
    assert packed.scales.shape == (experts, k_stored // 16, n_stored) and packed.scales.dtype == torch.uint8
    assert (packed.n, packed.k) == (n, k)
    assert packed.dtype is DType(dtype)
    assert (packed.layout, packed.scale_format) == ("packed", "e4m3_k16")
    w_back, s_back, s2_back = unpack_nvfp4(packed)
    zero_block = (scale.view(torch.uint8) == 0).repeat_interleave(8, dim=-1)  # 16 k = 8 bytes a scale
    assert zero_block.any() and not zero_block.all()
    assert torch.equal(w_back, weight.masked_fill(zero_block, 0))  # zero-scale blocks store zero codes
    assert torch.equal(s_back.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(s2_back, scale_2)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("experts,n,k", [(2, 64, 128), (3, 192, 256)])
def test_device_decode_emulation_matches_modelopt_exactly(dtype, experts, n, k):
    weight, scale, scale_2 = quantize_nvfp4(_realistic_weights(experts, n, k, seed=k))
    packed = pack_nvfp4(weight, scale, scale_2.view(-1, 1), dtype)  # (E, 1) is accepted too
    decoded = _decode(packed, dtype)
    reference = dequantize_modelopt(weight, scale, scale_2)
    assert reference.abs().amax() > 0 and (reference != 0).float().mean() > 0.5
    # Every product in the decode is exact (see docs/layouts.md), so float32 results are identical.
    assert torch.equal(decoded, reference)


def test_emulation_uses_arbitrary_nibbles_and_scales():
    # Every nibble pattern (incl. -0) and every e4m3 scale, subnormals included, not only quantizer output.
    for dtype in ("bf16", "fp16"):
        weight, scale, scale_2 = _random_modelopt(2, 128, 64, min_scale_byte=0x00, seed=7)
        packed = pack_nvfp4(weight, scale, scale_2, dtype)
        decoded = _decode(packed, dtype)
        assert torch.equal(decoded, dequantize_modelopt(weight, scale, scale_2)), dtype


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_packing_in_slices_of_experts_is_the_whole_packing(dtype, monkeypatch):
    """A large layer packs a few experts at a time (bounded temporaries): slices of one, two and three
    experts give the words and scales of one pass, and unpack the same way."""
    from cuteaot.runtime import weights

    weight, scale, scale_2 = _random_modelopt(7, 128, 192, min_scale_byte=0x00, seed=11)
    whole = pack_nvfp4(weight, scale, scale_2, dtype)
    for experts in (1, 2, 3):
        monkeypatch.setattr(weights, "_CHUNK_BYTES", experts * 128 * 192 // 2)
        assert len(weights._expert_slices(7, 128 * 192 // 2)) == -(-7 // experts)
        _assert_same_packed(pack_nvfp4(weight, scale, scale_2, dtype), whole)
        assert torch.equal(unpack_nvfp4(whole)[0], unpack_nvfp4(pack_nvfp4(weight, scale, scale_2, dtype))[0])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_global_scale_carries_the_decode_compensation(dtype):
    weight, scale, scale_2 = _random_modelopt(3, 64, 64, min_scale_byte=0x08)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]  # torch dtypes are accepted too
    packed = pack_nvfp4(weight, scale, scale_2, torch_dtype)
    assert torch.equal(packed.global_scale, scale_2 * COMPENSATION[dtype])


def _with_small_scales():
    weight, scale, scale_2 = _random_modelopt(2, 64, 64, min_scale_byte=0x08, seed=3)
    raw = scale.view(torch.uint8).clone()
    raw[0, 0, 1] = 0x01  # 2**-9, e4m3 subnormal
    raw[1, 5, 2] = 0x07  # 7 * 2**-9, largest subnormal
    raw[1, 9, 3] = 0x05
    return weight, raw.view(torch.float8_e4m3fn), scale_2


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_small_scales_are_kept_exactly(dtype):
    weight, scale, scale_2 = _with_small_scales()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packed = pack_nvfp4(weight, scale, scale_2, dtype)
    assert torch.equal(unpack_nvfp4(packed)[1].view(torch.uint8), scale.view(torch.uint8))
    decoded = _decode(packed, dtype)
    assert torch.equal(decoded, dequantize_modelopt(weight, scale, scale_2))
    assert decoded[0, 0, 16:32].abs().max() > 0  # the 2**-9 block is not flushed



@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_negative_zero_block_scale_packs_as_zero(dtype):
    """e4m3 -0 (byte 0x80) is a valid zero scale: its block must decode to zeros, not to S0E5M3 inf."""
    weight, scale, scale_2 = quantize_nvfp4(_realistic_weights(2, 64, 64, seed=5))
    scale.view(torch.uint8)[1, 3, 1] = 0x80
    decoded = _decode(pack_nvfp4(weight, scale, scale_2, dtype), dtype)
    assert not bool(decoded[1, 3, 16:32].any())
    assert torch.equal(decoded, dequantize_modelopt(weight, scale, scale_2))


def test_rescaled_block_scales_round_once_to_nearest():
    """s * own / larger goes to e4m3 in one rounding (torch's float64 -> float8 rounds twice, through
    float32: a value just above a midpoint may tie down); checked against every e4m3 midpoint."""
    from cuteaot.runtime.weights import _e4m3_rounded_once

    values = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # 0 .. 448
    mid = (values[1:] + values[:-1]) / 2
    x = torch.cat([mid, mid * (1 + 2.0**-40), mid * (1 - 2.0**-40), values, torch.rand(5000, generator=_gen(3),
                                                                                         dtype=torch.float64) * 448])
    distance = (x.view(-1, 1) - values.view(1, -1)).abs()
    nearest = distance == distance.min(dim=1, keepdim=True).values
    byte = torch.arange(0x7F)
    rank = torch.where(nearest, (byte % 2) * 1000 + byte, 10**6)  # ties to the even byte
    assert torch.equal(_e4m3_rounded_once(x).double(), values[rank.argmin(dim=1)])
    # through prepare_w13: gate scale 2 with global scales (own, larger) whose ratio makes 1.0625000443
    own, larger = 0.0031407866, 0.0059120688
    scale = torch.full((1, 128, 4), 2.0).to(torch.float8_e4m3fn)
    pair = torch.tensor([[own, larger]], dtype=torch.float32)
    assert 1.0625 < 2.0 * float(pair[0, 0].double() / pair[0, 1].double()) < 1.0625 + 1e-7
    folded = unpack_nvfp4(prepare_w13(torch.full((1, 128, 32), 0x22, dtype=torch.uint8), scale, pair, "bf16"))[1]
    assert float(folded[0, 0, 0].float()) == 1.125 and float(folded[0, 64, 0].float()) == 2.0

# ---- fused gate/up and down projections ----------------------------------------------------------


def _w13_halves(experts=2, inter=96, hidden=128, up_gain=1.0):
    gate = _realistic_weights(experts, inter, hidden, seed=11)
    up = _realistic_weights(experts, inter, hidden, seed=12) * up_gain
    return gate, up


def test_w13_shared_global_scale_is_exact_in_both_orders():
    gate, up = _w13_halves()
    weight, scale, scale_2 = quantize_nvfp4(torch.cat((gate, up), dim=1))  # one scale_2 per expert
    packed = prepare_w13(weight, scale, scale_2, "bf16")
    assert (packed.n, packed.k) == (192, 128)
    decoded = _decode(packed, "bf16")
    assert torch.equal(decoded, dequantize_modelopt(weight, scale, scale_2))

    inter = gate.shape[1]
    swapped_w = torch.cat((weight[:, inter:], weight[:, :inter]), dim=1)
    swapped_s = torch.cat((scale[:, inter:], scale[:, :inter]), dim=1)
    _assert_same_packed(prepare_w13(swapped_w, swapped_s, scale_2, "bf16", order="up_gate"), packed)
    pair = scale_2.view(-1, 1).expand(-1, 2).contiguous()  # equal (gate, up) values: still exact
    _assert_same_packed(prepare_w13(weight, scale, pair, "bf16"), packed)
    # gpt-oss interleaves the rows (g0, u0, g1, u1, ...): de-interleaved at preparation
    mixed_w = torch.stack((weight[:, :inter], weight[:, inter:]), dim=2).reshape(weight.shape)
    mixed_s = torch.stack((scale[:, :inter], scale[:, inter:]), dim=2).reshape(scale.shape)
    assert torch.equal(mixed_w[:, 1], weight[:, inter])
    _assert_same_packed(prepare_w13(mixed_w, mixed_s, scale_2, "bf16", order="interleaved"), packed)


@pytest.mark.parametrize("order", ["gate_up", "up_gate"])
def test_w13_different_gate_up_scales_fold_into_block_scales(order):
    gate, up = _w13_halves(up_gain=3.0)  # a ratio that is not a power of two: rescaling rounds
    gw, gs, gs2 = quantize_nvfp4(gate)
    uw, us, us2 = quantize_nvfp4(up)
    reference = torch.cat((dequantize_modelopt(gw, gs, gs2), dequantize_modelopt(uw, us, us2)), dim=1)
    first, second = ((gw, gs), (uw, us)) if order == "gate_up" else ((uw, us), (gw, gs))
    weight = torch.cat((first[0], second[0]), dim=1)
    scale = torch.cat((first[1], second[1]), dim=1)
    pair = torch.stack((gs2, us2), dim=1)  # columns are (gate, up) whatever the row order
    assert bool((us2 > gs2).all())

    packed = prepare_w13(weight, scale, pair, "fp16", order=order)
    assert torch.equal(packed.global_scale, us2 * COMPENSATION["fp16"])
    decoded = _decode(packed, "fp16")
    inter = gate.shape[1]
    assert torch.equal(decoded[:, inter:], reference[:, inter:])  # the half that owns the global scale
    # The gate half's block scales were re-rounded to e4m3: at most half a step (2**-4 relative)
    # for normal results, plus the e4m3 subnormal spacing 2**-9 times |e2m1| * global scale.
    error = (decoded[:, :inter] - reference[:, :inter]).abs()
    bound = reference[:, :inter].abs() * 2.0**-4 + 6 * 2.0**-10 * us2.view(-1, 1, 1)
    assert bool((error <= bound).all())
    assert bool((error > 0).any())  # it is lossy, as documented


def test_w2_packs_down_projection():
    weight, scale, scale_2 = quantize_nvfp4(_realistic_weights(2, 128, 64, seed=5))  # (E, H, I)
    packed = prepare_w2(weight, scale, scale_2, DType.FP16)
    assert (packed.n, packed.k, packed.num_experts) == (128, 64, 2)
    decoded = _decode(packed, "fp16")
    assert torch.equal(decoded, dequantize_modelopt(weight, scale, scale_2))
    moved = packed.to("cpu")
    _assert_same_packed(moved, packed)


# ---- errors --------------------------------------------------------------------------------------


def _ok(experts=2, n=64, k=64):
    return _random_modelopt(experts, n, k, min_scale_byte=0x08)


def _bad_scale_value(byte):
    weight, scale, scale_2 = _ok()
    raw = scale.view(torch.uint8).clone()
    raw[1, 2, 3] = byte
    return weight, raw.view(torch.float8_e4m3fn), scale_2


@pytest.mark.parametrize(
    "args,match",
    [
        ((_ok()[0].float(), *_ok()[1:]), "weight must have dtype torch.uint8"),
        ((_ok()[0], _ok()[1].float(), _ok()[2]), "weight_scale must have dtype torch.float8_e4m3fn"),
        ((_ok()[0][0], *_ok()[1:]), r"3-D \[E, N, K/2\]"),
        (_ok(n=100), "N = weight.shape.1. = 100 must be a multiple of 8"),
        ((torch.zeros(2, 64, 12, dtype=torch.uint8), *_ok()[1:]), "= 24 must be a multiple of 16"),
        ((_ok()[0], _ok(n=128)[1], _ok()[2]), r"weight_scale must have shape \[E, N, K/16\] = \(2, 64, 4\)"),
        ((_ok(n=128)[0][:, ::2], *_ok()[1:]), "contiguous"),
        ((*_ok()[:2], torch.ones(2, 2)), r"prepare_w13"),
        ((*_ok()[:2], torch.ones(2, dtype=torch.float64)), "weight_scale_2 must have dtype torch.float32"),
        ((*_ok()[:2], torch.tensor([1.0, float("inf")])), "finite and >= 0"),
        ((*_ok()[:2], torch.tensor([1.0, -1.0])), "finite and >= 0"),
        (_bad_scale_value(0x7F), r"1 NaN block scale\(s\) \(first at index \[1, 2, 3\]\)"),
        (_bad_scale_value(0x88), "1 negative block scale"),
    ],
)
def test_pack_rejects_bad_input_with_a_clear_message(args, match):
    with pytest.raises(BadInputError, match=match):
        pack_nvfp4(*args, "bf16")


def test_dtype_and_overflow_errors():
    weight, scale, scale_2 = _ok()
    with pytest.raises(BadInputError, match=r"dtype \(the activations' dtype\) must be one of"):
        pack_nvfp4(weight, scale, scale_2, "fp32")
    assert pack_nvfp4(weight, scale, scale_2, "bfloat16").dtype is pack_nvfp4(weight, scale, scale_2, "bf16").dtype
    with pytest.raises(BadInputError, match="must be one of"):
        pack_nvfp4(weight, scale, scale_2, torch.float32)
    big = torch.tensor([1.0, 2.0**26])  # 2**26 * 2**103 overflows float32
    with pytest.raises(BadInputError, match="overflows float32; bf16 needs weight_scale_2 <"):
        pack_nvfp4(weight, scale, big, "bf16")
    assert pack_nvfp4(weight, scale, big, "fp16").global_scale[1] == 2.0**26 * 2**7


def test_w13_and_w2_errors_name_their_tensors():
    weight, scale, scale_2 = _ok(n=97)
    with pytest.raises(BadInputError, match=r"w13_weight has 97 rows; \[gate \| up\] needs an even count"):
        prepare_w13(weight, scale, scale_2, "bf16")
    weight, scale, scale_2 = _ok(n=128)
    with pytest.raises(BadInputError, match="order must be one of"):
        prepare_w13(weight, scale, scale_2, "bf16", order="w31")
    with pytest.raises(BadInputError, match=r"w13_weight_scale_2 must have shape \(2,\) or \(2, 1\) or \(2, 2\)"):
        prepare_w13(weight, scale, torch.ones(2, 3), "bf16")
    with pytest.raises(BadInputError, match="w2_weight_scale must have dtype"):
        prepare_w2(weight, scale.float(), scale_2, "bf16")
    with pytest.raises(BadInputError, match=r"w2_weight_scale_2 must have shape \(2,\) or \(2, 1\)"):
        prepare_w2(weight, scale, torch.ones(2, 2), "bf16")


def test_packed_object_checks_its_tensors():
    packed = pack_nvfp4(*_ok(), "bf16")
    with pytest.raises(BadInputError, match=r"PackedNvfp4.scales must be a torch.uint8 tensor of shape \(2, 4, 64\)"):
        PackedNvfp4(packed.qweight, packed.scales[:, :2], packed.global_scale, 2, 64, 64, DType.BF16)
    with pytest.raises(BadInputError, match="packed must be a PackedNvfp4"):
        unpack_nvfp4(packed.qweight)


def test_prepared_weights_print_as_shapes_not_tensors():
    from cuteaot.runtime.modelopt import prepare_w13_modelopt
    from cuteaot.runtime.nf3 import prepare_w13_nf3, quantize_nf3

    weight, scale, scale_2 = _ok()
    packed = pack_nvfp4(weight, scale, scale_2, "bf16")
    text = repr(packed)
    assert text.startswith(f"PackedNvfp4(nvfp4, experts={packed.num_experts}, n={packed.n}, k={packed.k}, bf16, cpu, ")
    assert "tensor(" not in text and packed.nbytes == sum(t.numel() * t.element_size() for t in (
        packed.qweight, packed.scales, packed.global_scale))
    assert repr(prepare_w13_modelopt(weight, scale, scale_2, "bf16", gated=False)).startswith("ModelOptNvfp4(modelopt,")
    codes, nf3_scales, nf3_scale_2 = quantize_nf3(torch.randn(2, 128, 128))
    assert repr(prepare_w13_nf3(codes, nf3_scales, nf3_scale_2)).startswith("PackedNf3(nf3, experts=2, n=128, k=128,")
