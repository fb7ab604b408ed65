"""Shard arithmetic of tensor and expert parallelism on the CPU.

The float32 reference of the whole layer must equal the sum over ranks of the reference run on
each rank's shard: that is what the GPU ranks' all-reduce computes (tests/gpu/test_parallel_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from cuteaot.runtime.errors import BadInputError
from cuteaot.runtime.parallel import ModelOptTensors, ParallelMoeLayer, ep_partition, ep_select, tp_shard_w2, tp_shard_w13, tp_slice
from tests.reference.moe import moe_reference
from tests.reference.nvfp4 import dequantize_modelopt, quantize_nvfp4

H, I, E, TOP_K = 64, 128, 10, 3


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator().manual_seed(3)
    w13 = ModelOptTensors(*quantize_nvfp4(torch.randn(E, 2 * I, H, generator=g) * 0.05))
    w2 = ModelOptTensors(*quantize_nvfp4(torch.randn(E, H, I, generator=g) * 0.05))
    x = torch.randn(7, H, generator=g)
    ids = torch.rand(7, E, generator=g).topk(TOP_K, dim=1).indices
    weights = torch.softmax(torch.randn(7, TOP_K, generator=g), dim=1)
    return w13, w2, x, weights, ids


def test_tp_slices_and_refusals():
    assert tp_slice(1536, 3, 8) == slice(576, 768)
    assert tp_slice(2880, 1, 4) == slice(720, 1440)
    with pytest.raises(BadInputError, match=r"2880 / 8 = 360"):
        tp_slice(2880, 0, 8)  # 360 is not a whole number of 16-wide scale groups
    with pytest.raises(BadInputError, match="rank < world"):
        tp_slice(1536, 2, 2)


def _assert_ranks_sum_to_the_layer(layer, world, rank_shard, activation="silu"):
    """sum over ranks of the float32 layer on rank_shard(rank) = (w13, w2, reference kwargs) equals
    the whole layer's float32 reference."""
    w13, w2, x, weights, ids = layer
    full, _, _ = moe_reference(x, dequantize_modelopt(*w13), dequantize_modelopt(*w2), weights, ids, activation)
    total = torch.zeros_like(full)
    for rank in range(world):
        s13, s2, kwargs = rank_shard(rank)
        part, _, _ = moe_reference(x, dequantize_modelopt(*s13), dequantize_modelopt(*s2), weights, ids,
                                   activation, **kwargs)
        total += part
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_shards_sum_to_the_whole_layer(layer, world):
    w13, w2 = layer[:2]

    def shard(rank):
        s13, s2 = tp_shard_w13(w13, rank, world, activation="silu"), tp_shard_w2(w2, rank, world)
        assert s13.weight.shape == (E, 2 * I // world, H // 2) and s2.weight.shape == (E, H, I // world // 2)
        return s13, s2, {}

    _assert_ranks_sum_to_the_layer(layer, world, shard)


def test_tp_shard_reads_every_checkpoint_row_order(layer):
    w13 = layer[0]
    gate, up = w13.weight[:, :I], w13.weight[:, I:]
    gs, us = w13.weight_scale[:, :I], w13.weight_scale[:, I:]
    want = tp_shard_w13(w13, 1, 2, activation="silu")
    up_gate = ModelOptTensors(torch.cat((up, gate), 1), torch.cat((us, gs), 1), w13.weight_scale_2)
    mixed = ModelOptTensors(torch.stack((gate, up), 2).flatten(1, 2), torch.stack((gs, us), 2).flatten(1, 2),
                            w13.weight_scale_2)
    for tensors, order in ((up_gate, "up_gate"), (mixed, "interleaved")):
        got = tp_shard_w13(tensors, 1, 2, activation="swigluoai", order=order)
        assert torch.equal(got.weight, want.weight) and torch.equal(got.weight_scale.view(torch.uint8),
                                                                    want.weight_scale.view(torch.uint8))


def _random_rows(rows: int, seed: int) -> ModelOptTensors:
    """Random ModelOpt bytes and e4m3 scales of `rows` W13 rows (no quantisation needed to compare slices)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(0, 256, (E, rows, H // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(E, rows, H // 16, generator=g) * 8).to(torch.float8_e4m3fn)
    return ModelOptTensors(weight, scale, torch.rand(E, 2, generator=g))


def _assert_same_tensors(got: ModelOptTensors, want: ModelOptTensors, what: str) -> None:
    assert torch.equal(got.weight, want.weight), f"{what}: weight rows differ"
    assert torch.equal(got.weight_scale.view(torch.uint8), want.weight_scale.view(torch.uint8)), f"{what}: scales differ"
    assert torch.equal(got.weight_scale_2, want.weight_scale_2), f"{what}: weight_scale_2 differs"


def _stored(gate: ModelOptTensors, up: ModelOptTensors, order: str) -> ModelOptTensors:
    """The checkpoint's W13 holding `gate` and `up` (I rows each) in row order `order`."""
    def join(a, b):
        if order == "interleaved":
            return torch.stack((a, b), 2).flatten(1, 2)
        return torch.cat((a, b) if order == "gate_up" else (b, a), 1)

    return ModelOptTensors(join(gate.weight, up.weight), join(gate.weight_scale, up.weight_scale), gate.weight_scale_2)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("order", ["gate_up", "up_gate", "interleaved"])
def test_gated_tp_shards_are_the_hand_sliced_gate_and_up_rows(order, world):
    gate, up = _random_rows(I, seed=11), _random_rows(I, seed=12)
    up = up._replace(weight_scale_2=gate.weight_scale_2)
    w13 = _stored(gate, up, order)
    part = I // world
    for rank in range(world):
        rows = slice(rank * part, (rank + 1) * part)  # the rank's slice of I, by hand
        want = ModelOptTensors(torch.cat((gate.weight[:, rows], up.weight[:, rows]), 1),
                               torch.cat((gate.weight_scale[:, rows], up.weight_scale[:, rows]), 1), gate.weight_scale_2)
        _assert_same_tensors(tp_shard_w13(w13, rank, world, activation="silu", order=order), want,
                             f"{order} rank {rank} of {world}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_relu2_tp_shards_are_the_hand_sliced_rows(world):
    """A non-gated W13 is (E, I, H/2): rank r holds rows [r*I/w, (r+1)*I/w), and the ranks' shards
    concatenated are the whole tensor (the gated cut would take rows of two halves instead)."""
    w13 = _random_rows(I, seed=13)
    shards = [tp_shard_w13(w13, rank, world, activation="relu2") for rank in range(world)]
    part = I // world
    for rank, got in enumerate(shards):
        rows = slice(rank * part, (rank + 1) * part)
        want = ModelOptTensors(w13.weight[:, rows], w13.weight_scale[:, rows], w13.weight_scale_2)
        _assert_same_tensors(got, want, f"relu2 rank {rank} of {world}")
    whole = ModelOptTensors(torch.cat([s.weight for s in shards], 1), torch.cat([s.weight_scale for s in shards], 1),
                            w13.weight_scale_2)
    _assert_same_tensors(whole, w13, f"relu2 ranks of {world} concatenated")


@pytest.mark.parametrize("world", [2, 4])
def test_relu2_tp_shards_sum_to_the_whole_layer(world):
    g = torch.Generator().manual_seed(5)
    w13 = ModelOptTensors(*quantize_nvfp4(torch.randn(E, I, H, generator=g) * 0.05))
    w2 = ModelOptTensors(*quantize_nvfp4(torch.randn(E, H, I, generator=g) * 0.05))
    x = torch.randn(7, H, generator=g)
    ids = torch.rand(7, E, generator=g).topk(TOP_K, dim=1).indices
    weights = torch.softmax(torch.randn(7, TOP_K, generator=g), dim=1)

    def shard(rank):
        s13, s2 = tp_shard_w13(w13, rank, world, activation="relu2"), tp_shard_w2(w2, rank, world)
        assert s13.weight.shape == (E, I // world, H // 2) and s2.weight.shape == (E, H, I // world // 2)
        return s13, s2, {}

    _assert_ranks_sum_to_the_layer((w13, w2, x, weights, ids), world, shard, activation="relu2")


def test_tp_shard_w13_never_guesses_the_layout():
    gated, odd = _random_rows(2 * I, seed=14), _random_rows(2 * I + 16, seed=15)
    odd = odd._replace(weight=odd.weight[:, 1:], weight_scale=odd.weight_scale[:, 1:])  # 2I + 15 rows
    with pytest.raises(TypeError, match="activation"):
        tp_shard_w13(gated, 0, 2)  # no default: the row count cannot tell gated from relu2
    with pytest.raises(BadInputError, match="odd count 271"):
        tp_shard_w13(odd, 0, 2, activation="silu")
    with pytest.raises(BadInputError, match="not gated"):
        tp_shard_w13(gated, 0, 2, activation="relu2", order="gate_up")
    with pytest.raises(BadInputError, match="activation must be one of"):
        tp_shard_w13(gated, 0, 2, activation="gelu")
    with pytest.raises(BadInputError, match="order must be one of"):
        tp_shard_w13(gated, 0, 2, activation="silu", order="gate-up")
    with pytest.raises(BadInputError, match="same E and rows"):
        tp_shard_w13(gated._replace(weight_scale=gated.weight_scale[:, 1:]), 0, 2, activation="silu")
    with pytest.raises(BadInputError, match="scale group"):
        tp_shard_w13(odd, 0, 2, activation="relu2")  # 271 rows split no way into 16-row groups


def test_ep_partition_handles_uneven_expert_counts():
    sizes, seen = [], []
    for rank in range(4):
        expert_map, local = ep_partition(10, rank, 4)
        sizes.append(len(local))
        seen += list(local)
        assert expert_map[local.start:local.stop].tolist() == list(range(len(local)))
        assert int((expert_map >= 0).sum()) == len(local)
    assert sizes == [3, 3, 2, 2] and seen == list(range(10))
    with pytest.raises(BadInputError, match="cannot be spread"):
        ep_partition(2, 0, 4)


@pytest.mark.parametrize("world", [2, 3])
def test_ep_ranks_sum_to_the_whole_layer(layer, world):
    w13, w2 = layer[:2]

    def shard(rank):
        expert_map, local = ep_partition(E, rank, world)
        return ep_select(w13, local), ep_select(w2, local), dict(local=set(local),
                                                                 expert_index=expert_map.clamp(min=0))

    _assert_ranks_sum_to_the_layer(layer, world, shard)


def test_parallel_layer_needs_torch_distributed():
    with pytest.raises(BadInputError, match="torch.distributed"):
        ParallelMoeLayer(None, None, None, top_k=2)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("order", ["gate_up", "interleaved"])
def test_tp_shards_with_biases_sum_to_the_whole_layer(layer, world, order):
    """FC1's bias follows the rank's rows; FC2's bias is added on rank 0 only (the all-reduce sums)."""
    from cuteaot.runtime.parallel import tp_shard_bias2, tp_shard_bias13

    w13, w2, x, weights, ids = layer
    g = torch.Generator().manual_seed(21)
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)  # b13 [gate | up]
    stored13 = w13 if order == "gate_up" else ModelOptTensors(
        *(torch.stack((t[:, :I], t[:, I:]), dim=2).flatten(1, 2) for t in w13[:2]), w13.weight_scale_2)
    stored_b13 = b13 if order == "gate_up" else torch.stack((b13[:, :I], b13[:, I:]), dim=2).flatten(1, 2)
    full, _, _ = moe_reference(x, dequantize_modelopt(*w13), dequantize_modelopt(*w2), weights, ids, "silu",
                               b13=b13, b2=b2)
    total = torch.zeros_like(full)
    for rank in range(world):
        s13 = tp_shard_w13(stored13, rank, world, activation="silu", order=order)
        sb13 = tp_shard_bias13(stored_b13, rank, world, activation="silu", order=order)
        sb2 = tp_shard_bias2(b2, rank, world)
        assert (sb2 is None) == (rank > 0) and sb13.shape == (E, 2 * I // world)
        part, _, _ = moe_reference(x, dequantize_modelopt(*s13), dequantize_modelopt(*tp_shard_w2(w2, rank, world)),
                                   weights, ids, "silu", b13=sb13, b2=sb2)
        total += part
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [1, 2])
def test_mxfp4_tp_shards_sum_to_the_whole_layer(world):
    """gpt-oss tensors as stored (MXFP4, interleaved gate/up rows, biases): the ranks' packed shards,
    dequantized the way the kernels see them, sum to the whole layer."""
    from cuteaot.runtime.parallel import tp_shard_bias2, tp_shard_bias13, tp_shard_w2_mxfp4, tp_shard_w13_mxfp4
    from cuteaot.runtime.weights import prepare_w2_mxfp4, prepare_w13_mxfp4, unpack_nvfp4
    from tests.reference.mxfp4 import dequantize_mxfp4, random_mxfp4

    h, i, e = 64, 128, 4  # I / 2 = 64: two MXFP4 blocks a rank
    g = torch.Generator().manual_seed(22)
    b13_blocks, b13_scales = random_mxfp4(e, 2 * i, h, g, spread=3, center=120)
    b2_blocks, b2_scales = random_mxfp4(e, h, i, g, spread=3, center=120)
    # interleaved, as stored; bf16 values, as the packing keeps them
    bias13, bias2 = (torch.randn(e, n, generator=g).to(torch.bfloat16).float() for n in (2 * i, h))
    x = torch.randn(5, h, generator=g)
    ids = torch.rand(5, e, generator=g).topk(2, dim=1).indices
    weights = torch.softmax(torch.randn(5, 2, generator=g), dim=1)
    w13_f = dequantize_mxfp4(b13_blocks, b13_scales)
    gate_up = torch.cat((w13_f[:, 0::2], w13_f[:, 1::2]), dim=1)
    b13 = torch.cat((bias13[:, 0::2], bias13[:, 1::2]), dim=1)
    full, _, _ = moe_reference(x, gate_up, dequantize_mxfp4(b2_blocks, b2_scales), weights, ids, "swigluoai",
                               b13=b13, b2=bias2, alpha=1.702, beta=1.0, limit=7.0)
    total = torch.zeros_like(full)
    for rank in range(world):
        s13 = tp_shard_w13_mxfp4(b13_blocks, b13_scales, rank, world)
        s2 = tp_shard_w2_mxfp4(b2_blocks, b2_scales, rank, world)
        sb13 = tp_shard_bias13(bias13, rank, world, activation="swigluoai", order="interleaved")
        p13 = prepare_w13_mxfp4(*s13, "bf16", order="gate_up", bias=sb13)
        p2 = prepare_w2_mxfp4(*s2, "bf16", bias=tp_shard_bias2(bias2, rank, world))
        assert (p13.n, p13.k, p2.n, p2.k) == (2 * i // world, h, h, i // world)
        part, _, _ = moe_reference(x, dequantize_modelopt(*unpack_nvfp4(p13)), dequantize_modelopt(*unpack_nvfp4(p2)),
                                   weights, ids, "swigluoai", b13=p13.bias.float(),
                                   b2=None if p2.bias is None else p2.bias.float(), alpha=1.702, beta=1.0, limit=7.0)
        total += part
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


def test_mxfp4_tp_refuses_a_cut_scale_block():
    from cuteaot.runtime.parallel import tp_shard_w2_mxfp4
    from tests.reference.mxfp4 import random_mxfp4

    blocks, scales = random_mxfp4(2, 64, 2880, torch.Generator().manual_seed(0))
    assert tp_shard_w2_mxfp4(blocks, scales, 1, 2)[0].shape == (2, 64, 45, 16)
    with pytest.raises(BadInputError, match="720 is not a multiple of the MXFP4 block"):
        tp_shard_w2_mxfp4(blocks, scales, 0, 4)
