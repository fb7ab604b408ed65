"""HybridMoeLayer on the CPU (stubbed launches): expert maps, refusals, what a call launches."""

from __future__ import annotations

import pytest
import torch

from cuteaot.runtime.errors import BadInputError
from cuteaot.runtime.hybrid import HybridMoeLayer
from cuteaot.runtime.nf3 import prepare_w2_nf3, prepare_w13_nf3
from cuteaot.runtime.weights import prepare_w2, prepare_w13
from tests.reference.nf3 import random_nf3
from tests.reference.nvfp4 import random_nvfp4
from tests.stub_bundle import stub_bundle, stub_launches

H, I, E, TOP_K = 512, 256, 16, 4  # tiny-fused-silu / tiny-fused-nf3-silu


@pytest.fixture()
def calls(monkeypatch):
    return stub_launches(monkeypatch)


def _parts(fp4_ids, nf3_ids):
    g = torch.Generator().manual_seed(0)
    n_fp4, n_nf3 = len(fp4_ids), len(nf3_ids)
    fp4 = (prepare_w13(*random_nvfp4(n_fp4, 2 * I, H, g), "bf16"), prepare_w2(*random_nvfp4(n_fp4, H, I, g), "bf16"))
    nf3 = (prepare_w13_nf3(*random_nf3(n_nf3, 2 * I, H, g)), prepare_w2_nf3(*random_nf3(n_nf3, H, I, g)))
    return [(*fp4, fp4_ids), (*nf3, nf3_ids)]


def test_parts_get_complementary_expert_maps(calls):
    fp4_ids, nf3_ids = [0, 3, 5, 6, 9, 10, 12, 15], [1, 2, 4, 7, 8, 11, 13, 14]
    layer = HybridMoeLayer(stub_bundle(), _parts(fp4_ids, nf3_ids), top_k=TOP_K)
    maps = [p.expert_map.tolist() for p in layer.parts]
    assert [m[e] for e in fp4_ids for m in maps[:1]] == list(range(8))
    assert [maps[1][e] for e in nf3_ids] == list(range(8))
    assert all((a == -1) != (b == -1) for a, b in zip(*maps))  # every expert in exactly one part
    assert [p.facts.weights.value for p in layer.parts] == ["nvfp4", "nf3"]
    x, w = torch.zeros(5, H, dtype=torch.bfloat16), torch.full((5, TOP_K), 0.25)
    ids = (torch.arange(5 * TOP_K, dtype=torch.int32) % E).view(5, TOP_K)
    out = layer(x, w, ids)
    assert out.shape == (5, H)
    fused = [c[2] for c in calls if c[0] == "fused"]
    assert len(fused) == 2 and fused[0]["w13"] != fused[1]["w13"]


def test_refusals(calls):
    bundle = stub_bundle()
    with pytest.raises(BadInputError, match="exactly one part"):
        HybridMoeLayer(bundle, _parts(list(range(8)), [7] + list(range(9, 16))), top_k=TOP_K)
    with pytest.raises(BadInputError, match=r"ids in \[0, 16\)"):
        HybridMoeLayer(bundle, _parts(list(range(8)), list(range(9, 17))), top_k=TOP_K)
    parts = _parts(list(range(8)), list(range(8, 16)))
    with pytest.raises(BadInputError, match="global ids of its 8"):
        HybridMoeLayer(bundle, [parts[0], (*parts[1][:2], list(range(8, 15)))], top_k=TOP_K)
    with pytest.raises(BadInputError, match="expert maps"):
        HybridMoeLayer(bundle, _parts(list(range(8)), list(range(8, 16))), top_k=TOP_K, expert_map=None)
    with pytest.raises(BadInputError, match="part 1: w13 must be prepared weights .*, got Tensor"):
        HybridMoeLayer(bundle, [parts[0], (parts[1][0].qweight, *parts[1][1:])], top_k=TOP_K)
    with pytest.raises(BadInputError, match="part 1: w2 must be prepared weights .*, got Tensor"):
        HybridMoeLayer(bundle, [parts[0], (parts[1][0], parts[1][1].qweight, parts[1][2])], top_k=TOP_K)
    g = torch.Generator().manual_seed(1)  # a part of another H: refused before any part reserves memory
    other = (prepare_w13(*random_nvfp4(8, 2 * I, 2 * H, g), "bf16"), prepare_w2(*random_nvfp4(8, 2 * H, I, g), "bf16"))
    with pytest.raises(BadInputError, match=f"must share H, I and the activation dtype: part 1 has H = {2 * H}"):
        HybridMoeLayer(bundle, [parts[0], (*other, list(range(8, 16)))], top_k=TOP_K)


def test_chunks_above_max_tokens_and_streams(calls):
    """Calls above max_tokens run every part chunk by chunk, the later part adding into the one output."""
    layer = HybridMoeLayer(stub_bundle(), _parts(list(range(0, E, 2)), list(range(1, E, 2))), top_k=TOP_K,
                           max_tokens=16)
    assert layer.max_tokens == 16 and [p.accumulate for p in layer.parts] == [False, True]
    m = 40
    x, w = torch.zeros(m, H, dtype=torch.bfloat16), torch.full((m, TOP_K), 0.25)
    ids = (torch.arange(m * TOP_K, dtype=torch.int32) % E).view(m, TOP_K)
    out = layer(x, w, ids)
    assert out.shape == (m, H)
    fused = [c for c in calls if c[0] == "fused"]
    assert [v["tokens"] for _, _, v in fused] == [16, 16, 8, 16, 16, 8]  # part 0's chunks, then part 1's
    sums = [c for c in calls if c[0] == "topk_sum"]
    assert [len(c) == 3 for c in sums] == [False] * 3 + [True] * 3  # part 1's top-k sums add into out
    with pytest.raises(BadInputError, match="torch.cuda.Stream"):
        layer.reserve(["not a stream"])


def test_accumulate_needs_an_expert_map_and_an_output(calls):
    from cuteaot.runtime.moe import MoeLayer

    bundle = stub_bundle()
    (w13, w2, _), _ = _parts(list(range(8)), list(range(8, 16)))
    with pytest.raises(BadInputError, match="only layers with an expert_map"):
        MoeLayer(bundle, w13, w2, top_k=TOP_K, accumulate=True)
    expert_map = torch.cat((torch.arange(8), torch.full((8,), -1))).to(torch.int32)
    layer = MoeLayer(bundle, w13, w2, top_k=TOP_K, expert_map=expert_map, accumulate=True)
    x, w = torch.zeros(3, H, dtype=torch.bfloat16), torch.full((3, TOP_K), 0.25)
    ids = (torch.arange(3 * TOP_K, dtype=torch.int32) % E).view(3, TOP_K)
    with pytest.raises(BadInputError, match="pass out="):
        layer(x, w, ids)
    with pytest.raises(BadInputError, match="True or False"):
        MoeLayer(bundle, w13, w2, top_k=TOP_K, expert_map=expert_map, accumulate=1)
