"""examples/moe_decoder.py on the CPU: no GPU, no bundle.

The grouped-GEMM backend runs for real (torch._grouped_mm has a CPU kernel) against the float32
reference of tests/reference/; the cuteaot backend runs through the `cuteaot::moe_layer` fake
implementation (fake tensors, meta tensors under torch.compile) with a stand-in for the MoeLayer,
which checks that the model traces as one graph and that shapes and dtypes come out right.
"""

from __future__ import annotations

import pytest
import torch

from cuteaot.runtime import prepare_w2, prepare_w13, unpack_nvfp4
from cuteaot.runtime.errors import BadInputError
from examples.moe_decoder import (
    CuteaotExperts,
    Decoder,
    DecoderConfig,
    GroupedMmExperts,
    KvCache,
    MoeMlp,
    dequantize_nvfp4,
    grouped_mm_experts,
    make_weights,
    quantize_nvfp4,
)
from tests.reference.moe import moe_reference
from tests.reference.nvfp4 import dequantize_modelopt
from tests.reference.nvfp4 import quantize_nvfp4 as reference_quantize

TINY = DecoderConfig(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, context=8)


@pytest.fixture(scope="module")
def weights():
    return make_weights(TINY, "cpu", seed=3)


class StandInLayer:
    """What CuteaotExperts reads from a MoeLayer; the fake op never looks the id up."""

    def __init__(self, index: int, cfg: DecoderConfig = TINY):
        self.id = f"stand-in-{index}"
        self.hidden_size, self.top_k = cfg.hidden_size, cfg.top_k


def cuteaot_decoder(weights) -> Decoder:
    return Decoder(weights, [CuteaotExperts(StandInLayer(i), TINY) for i in range(TINY.num_layers)]).eval()


def step_inputs(batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, TINY.hidden_size, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, TINY.context, (batch,), generator=g)
    return x, positions


def rel_err(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm())


# ---- weights -------------------------------------------------------------------------------------


def test_quantizer_matches_reference_and_packs():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 32, 64, generator=g) * 0.1
    w[1, 4, :16] = 0.0  # an all-zero block: scale 0, codes 0
    ours = quantize_nvfp4(w)
    ref = reference_quantize(w)
    assert torch.equal(ours[0], ref[0])
    assert torch.equal(ours[1].view(torch.uint8), ref[1].view(torch.uint8))
    assert torch.equal(ours[2], ref[2])
    assert torch.equal(dequantize_nvfp4(*ours), dequantize_modelopt(*ref))
    assert rel_err(dequantize_nvfp4(*ours), w) < 0.15  # e2m1 has 3 significant bits
    # the runtime accepts the tensors as a ModelOpt checkpoint and gives them back unchanged
    packed = prepare_w2(*ours, "bf16")
    back = unpack_nvfp4(packed)
    assert torch.equal(back[0], ours[0]) and torch.equal(back[1].view(torch.uint8), ours[1].view(torch.uint8))
    torch.testing.assert_close(back[2], ours[2], rtol=0, atol=0)


def test_synthetic_weights_have_the_layer_shapes(weights):
    lw = weights.layers[0]
    h, i, e = TINY.hidden_size, TINY.intermediate_size, TINY.num_experts
    assert [tuple(t.shape) for t in lw.w13] == [(e, 2 * i, h // 2), (e, 2 * i, h // 16), (e,)]
    assert [tuple(t.shape) for t in lw.w2] == [(e, h, i // 2), (e, h, i // 16), (e,)]
    w13 = prepare_w13(*lw.w13, "bf16")
    assert (w13.n, w13.k, w13.num_experts) == (2 * i, h, e)


# ---- grouped-GEMM backend (runs) -----------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 5, 33])
def test_grouped_mm_experts_match_float32_reference(weights, m):
    lw = weights.layers[1]
    experts = grouped_mm_experts(weights)[1]
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, TINY.hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.rand(m, TINY.num_experts, generator=g).topk(TINY.top_k, dim=1).indices.to(torch.int32)
    topk_w = torch.softmax(torch.randn(m, TINY.top_k, generator=g), dim=1)
    out = experts(x, topk_w, ids)
    ref, _, _ = moe_reference(x, dequantize_modelopt(*lw.w13), dequantize_modelopt(*lw.w2), topk_w, ids, "silu")
    assert out.shape == (m, TINY.hidden_size) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) <= 1e-2


def test_router_renormalises_top_k(weights):
    seen = {}

    def record(x, topk_weights, topk_ids):
        seen.update(w=topk_weights, ids=topk_ids)
        return x

    class Recorder(torch.nn.Module):
        def forward(self, x, topk_weights, topk_ids):
            return record(x, topk_weights, topk_ids)

    mlp = MoeMlp(TINY, weights.layers[0].router, Recorder())
    x, _ = step_inputs(7)
    mlp(x)
    probs = torch.softmax(x.float() @ weights.layers[0].router.float().T, dim=-1)
    assert seen["ids"].dtype == torch.int32 and seen["w"].dtype == torch.float32
    torch.testing.assert_close(seen["w"].sum(-1), torch.ones(7))
    expect = probs.topk(TINY.top_k, dim=-1).indices
    assert torch.equal(seen["ids"].long().sort(-1).values, expect.sort(-1).values)


def test_decode_step_writes_its_slot_and_reads_only_up_to_it(weights):
    model = Decoder(weights, grouped_mm_experts(weights)).eval()
    cache = KvCache(TINY, 4, "cpu")
    x, _ = step_inputs(4)
    positions = torch.tensor([0, 3, 7, 5])
    before = cache.clone()
    with torch.no_grad():
        out = model(x, positions, *cache.view(4))
    assert out.shape == (4, TINY.hidden_size) and out.dtype == torch.bfloat16 and out.isfinite().all()
    for layer in range(TINY.num_layers):
        changed = (cache.k[layer] != before.k[layer]).any(dim=(1, 3))  # (batch, slot)
        assert torch.equal(changed.nonzero()[:, 1], positions), "each sequence writes exactly its own slot"
    # slots after a sequence's position are masked: changing them leaves the step unchanged
    later = before.clone()
    for t in later.k + later.v:
        t[0, :, 1:] = 100.0  # sequence 0 is at position 0
    with torch.no_grad():
        again = model(x, positions, *later.view(4))
    assert torch.equal(again, out)


# ---- cuteaot backend (fake implementation of cuteaot::moe_layer) ----------------------------------


def test_cuteaot_decoder_runs_on_fake_tensors(weights):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    model = cuteaot_decoder(weights)
    x, positions = step_inputs(5)
    cache = KvCache(TINY, 5, "cpu")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
        k, v = ([mode.from_tensor(t) for t in ts] for ts in cache.view(5))
        out = model(mode.from_tensor(x), mode.from_tensor(positions), k, v)
    assert isinstance(out, FakeTensor)
    assert out.shape == (5, TINY.hidden_size) and out.dtype == torch.bfloat16


def test_cuteaot_decoder_compiles_as_one_graph(weights):
    """fullgraph=True: the MoE layer is one opaque op a layer, for every batch size (dynamic M)."""
    model = cuteaot_decoder(weights).to("meta")
    cache = KvCache(TINY, 8, "cpu")
    cache.k, cache.v = [t.to("meta") for t in cache.k], [t.to("meta") for t in cache.v]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)  # functionalises the op's `out`

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        for batch in (8, 3, 1, 6):
            x = torch.empty(batch, TINY.hidden_size, dtype=torch.bfloat16, device="meta")
            out = compiled(x, torch.zeros(batch, dtype=torch.int64, device="meta"), *cache.view(batch))
            assert out.shape == (batch, TINY.hidden_size) and out.dtype == torch.bfloat16
    ops = [n for n in graphs[0].graph.nodes if n.target is torch.ops.cuteaot.moe_layer.default
           or n.target is torch.ops.cuteaot.moe_layer]
    assert len(ops) == TINY.num_layers
    assert len(graphs) <= 3, f"{len(graphs)} compilations for 4 batch sizes: the batch should become dynamic"


def test_fake_op_checks_the_route_shapes():
    x = torch.empty(4, TINY.hidden_size, dtype=torch.bfloat16, device="meta")
    experts = CuteaotExperts(StandInLayer(0), TINY)
    with pytest.raises(BadInputError, match="topk_weights"):
        experts(x, torch.empty(4, 3, device="meta"), torch.empty(4, 2, dtype=torch.int32, device="meta"))


def test_mismatched_layer_and_layer_count_are_refused(weights):
    wrong = StandInLayer(0, DecoderConfig(hidden_size=128, num_experts=8, top_k=2))
    with pytest.raises(BadInputError, match="hidden 128"):
        CuteaotExperts(wrong, TINY)
    with pytest.raises(BadInputError, match="one a layer"):
        Decoder(weights, [GroupedMmExperts(torch.zeros(8, 64, 64), torch.zeros(8, 64, 32))])
