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


def _assert_ranks_sum_to_the_layer(layer, world, rank_shard):
    """sum over ranks of the float32 layer on rank_shard(rank) = (w13, w2, reference kwargs) equals
    the whole layer's float32 reference."""
    w13, w2, x, weights, ids = layer
    full, _, _ = moe_reference(x, dequantize_modelopt(*w13), dequantize_modelopt(*w2), weights, ids, "silu")
    total = torch.zeros_like(full)
    for rank in range(world):
        s13, s2, kwargs = rank_shard(rank)
        part, _, _ = moe_reference(x, dequantize_modelopt(*s13), dequantize_modelopt(*s2), weights, ids, "silu",
                                   **kwargs)
        total += part
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_shards_sum_to_the_whole_layer(layer, world):
    w13, w2 = layer[:2]

    def shard(rank):
        s13, s2 = tp_shard_w13(w13, rank, world), tp_shard_w2(w2, rank, world)
        assert s13.weight.shape == (E, 2 * I // world, H // 2) and s2.weight.shape == (E, H, I // world // 2)
        return s13, s2, {}

    _assert_ranks_sum_to_the_layer(layer, world, shard)


def test_tp_shard_reads_every_checkpoint_row_order(layer):
    w13 = layer[0]
    gate, up = w13.weight[:, :I], w13.weight[:, I:]
    gs, us = w13.weight_scale[:, :I], w13.weight_scale[:, I:]
    want = tp_shard_w13(w13, 1, 2)
    up_gate = ModelOptTensors(torch.cat((up, gate), 1), torch.cat((us, gs), 1), w13.weight_scale_2)
    mixed = ModelOptTensors(torch.stack((gate, up), 2).flatten(1, 2), torch.stack((gs, us), 2).flatten(1, 2),
                            w13.weight_scale_2)
    for tensors, order in ((up_gate, "up_gate"), (mixed, "interleaved")):
        got = tp_shard_w13(tensors, 1, 2, order=order)
        assert torch.equal(got.weight, want.weight) and torch.equal(got.weight_scale.view(torch.uint8),
                                                                    want.weight_scale.view(torch.uint8))


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
