"""Outputs that share memory with an input are refused before any launch, by every op.

The kernels write their outputs while other CTAs still read the inputs (the fused layer zeroes
its output before FC1 has read the hidden states), so an in-place call would return garbage.
Disjoint views of one buffer are fine.  CPU only: kernels are recorded, never launched.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import cuteaot.runtime.kernels.rowwise as rowwise
import cuteaot.runtime.moe as moe_module
from cuteaot.runtime import BadInputError, moe_activation, moe_topk_sum, pack_routes, w4a16_moe_gemm
from cuteaot.runtime.kernels.probe import Probe, probe_words, run_probe
from cuteaot.runtime.kernels.route_pack import max_packed_route_slots
from cuteaot.runtime.moe import MoeLayer
from cuteaot.runtime.plans import BundlePlans
from cuteaot.runtime.tensors import overlapping
from cuteaot.runtime.weights import prepare_w2, prepare_w13
from tests.reference.nvfp4 import quantize_nvfp4
from tests.stub_bundle import RecordingKernel, StubLaunch, stub_bundle, stub_launches

H, E, TOP_K = 512, 16, 4  # tiny-fused's layer: I = 256


def test_overlapping_is_exact_byte_ranges():
    buf = torch.empty(8, 64, dtype=torch.bfloat16)
    assert overlapping(buf, buf) and overlapping(buf[2:5], buf[4:6])
    assert not overlapping(buf[:4], buf[4:])  # the halves of one buffer (torch's own test says they overlap)
    assert overlapping(buf[:4], buf.view(torch.int32)[3])  # another dtype's view of the same bytes
    assert not overlapping(buf[:0], buf) and not overlapping(buf, buf[3:3])  # empty tensors hold no byte
    assert not overlapping(buf, torch.empty_like(buf))


# ---- the layer ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(5)
    w13 = prepare_w13(*quantize_nvfp4(torch.randn(E, 2 * 256, H, generator=g) * 0.05), "bf16")
    w2 = prepare_w2(*quantize_nvfp4(torch.randn(E, H, 256, generator=g) * 0.05), "bf16")
    return w13, w2


def _layer(weights, monkeypatch, device_index=None):
    """A layer on the stub bundle; device_index=-1 makes CPU tensors pass the per-call fast path's checks."""
    stub_launches(monkeypatch)
    bundle = stub_bundle()
    if device_index is not None:
        bundle.device_index = device_index
    return MoeLayer(bundle, *weights, top_k=TOP_K, activation="silu")


def _routing(m):
    ids = (torch.arange(m * TOP_K, dtype=torch.int32) % E).view(m, TOP_K)
    return torch.full((m, TOP_K), 0.25), ids


@pytest.mark.parametrize("fast_path", [False, True])
def test_layer_refuses_an_output_on_its_inputs(weights, monkeypatch, fast_path):
    layer = _layer(weights, monkeypatch, device_index=-1 if fast_path else None)
    m = 3
    w, ids = _routing(m)
    x = torch.randn(m, H).bfloat16()
    with pytest.raises(BadInputError, match="out shares memory with hidden_states.*in-place calls are not supported"):
        layer(x, w, ids, out=x)  # vLLM's inplace=True
    rows = torch.empty(2 * m, H, dtype=torch.bfloat16)
    with pytest.raises(BadInputError, match="out shares memory with hidden_states"):
        layer(rows[:m], w, ids, out=rows[1:m + 1])  # partly
    words = torch.empty(m * H // 2, dtype=torch.float32)  # out's bytes, also read as the router weights
    with pytest.raises(BadInputError, match="out shares memory with topk_weights"):
        layer(x, words[: m * TOP_K].view(m, TOP_K), ids, out=words.view(torch.bfloat16).view(m, H))
    with pytest.raises(BadInputError, match="out shares memory with topk_ids"):
        layer(x, w, words[: m * TOP_K].view(torch.int32).view(m, TOP_K), out=words.view(torch.bfloat16).view(m, H))
    StubLaunch.calls.clear()
    layer(rows[:m], w, ids, out=rows[m:])  # the two halves of one buffer: apart
    assert [c[0] for c in StubLaunch.calls][-1] in ("fused", "topk_sum")


def test_the_fast_path_itself_refuses_overlap(weights, monkeypatch):
    """The per-call predicate (not only the explaining checks behind it) sees the overlap."""
    layer = _layer(weights, monkeypatch, device_index=-1)
    monkeypatch.setattr(layer, "_check_explained", lambda *args: "explained")
    w, ids = _routing(2)
    rows = torch.empty(4, H, dtype=torch.bfloat16)
    assert layer._check(rows[:2], w, ids, rows[2:], None, None) == 2
    assert layer._check(rows[:2], w, ids, rows[1:3], None, None) == "explained"
    assert layer._check(rows[:2], w, ids, None, None, None) == 2


def test_calibration_amax_may_not_overlap_the_call(weights, monkeypatch):
    layer = _layer(weights, monkeypatch)
    w, ids = _routing(2)
    x = torch.randn(2, H).bfloat16()
    amax = torch.zeros(1, E, 2)
    with pytest.raises(BadInputError, match="activation_amax shares memory with topk_weights"):
        layer(x, amax.view(-1)[: 2 * TOP_K].view(2, TOP_K), ids, activation_amax=amax, layer_idx=0)


def test_bound_calls_check_as_the_layer_does(weights, monkeypatch):
    layer = _layer(weights, monkeypatch)
    monkeypatch.setattr(moe_module, "recording_launches", None)  # never reached
    w, ids = _routing(1)
    x = torch.randn(1, H).bfloat16()
    with pytest.raises(BadInputError, match="out shares memory with hidden_states"):
        layer.bind(x, w, ids, x)


# ---- the standalone ops ---------------------------------------------------------------------------

def _recording_bundle(monkeypatch):
    issued: list = []
    monkeypatch.setattr(rowwise, "current_stream_handle", lambda index: 0)
    return issued, SimpleNamespace(device=torch.device("cpu"), device_index=-1, plans=BundlePlans(), id="cpu",
                                   kernel=lambda key: RecordingKernel(issued, block=(256, 1, 1)))


def test_activation_and_topk_sum_refuse_in_place(monkeypatch):
    issued, bundle = _recording_bundle(monkeypatch)
    fc1 = torch.empty(6, 512, dtype=torch.bfloat16)
    with pytest.raises(BadInputError, match="out shares memory with fc1"):
        moe_activation(bundle, fc1, fc1.view(-1)[: 6 * 256].view(6, 256))
    moe_activation(bundle, fc1, torch.empty(6, 256, dtype=torch.bfloat16))
    fc2 = torch.empty(5, TOP_K, 256, dtype=torch.bfloat16)
    with pytest.raises(BadInputError, match="out shares memory with fc2"):
        moe_topk_sum(bundle, fc2, fc2.view(-1)[256: 256 + 5 * 256].view(5, 256))
    buf = torch.zeros(5 * 256 * 2, dtype=torch.uint8)  # out's bytes; the ids in its first 160
    ids = buf[: 5 * TOP_K * 8].view(torch.int64).view(5, TOP_K)
    with pytest.raises(BadInputError, match="out shares memory with topk_ids"):
        moe_topk_sum(bundle, fc2, buf.view(torch.bfloat16).view(5, 256), topk_ids=ids, num_experts=E)
    moe_topk_sum(bundle, fc2, torch.empty(5, 256, dtype=torch.bfloat16))
    assert len(issued) == 2  # only the calls with separate outputs launched


def test_gemm_refuses_an_output_on_its_inputs(weights):
    bundle = SimpleNamespace(device=torch.device("cpu"), device_index=-1, plans=None)  # refused before planning
    w13 = weights[0]
    m = 2
    ids = _routing(m)[1]
    out = torch.empty(m * TOP_K, w13.n, dtype=torch.bfloat16)
    with pytest.raises(BadInputError, match="out shares memory with a"):
        w4a16_moe_gemm(bundle, out.view(-1)[: m * H].view(m, H), w13, ids, out=out)
    words = out.view(torch.int32).view(-1)
    with pytest.raises(BadInputError, match="out shares memory with topk_ids"):
        w4a16_moe_gemm(bundle, torch.empty(m, H, dtype=torch.bfloat16), w13, words[-m * TOP_K:].view(m, TOP_K),
                       out=out)


def test_route_packing_outputs_are_apart_from_the_ids_and_each_other():
    bundle = SimpleNamespace(device=torch.device("cpu"), device_index=-1, plans=BundlePlans(), id="cpu")
    ids = torch.zeros(4, 2, dtype=torch.int32)
    slots = max_packed_route_slots(8, 8, 8)
    buf = torch.empty(slots + slots // 8 + 1, dtype=torch.int32)
    packed, blocks, count = buf[:slots], buf[slots: slots + slots // 8], buf[-1:]
    with pytest.raises(BadInputError, match="packed_route_indices shares memory with topk_ids"):
        pack_routes(bundle, buf[:8].view(4, 2), 8, 8, packed_route_indices=packed, block_expert_ids=blocks,
                    packed_route_count=count)
    with pytest.raises(BadInputError, match="packed_route_indices shares memory with block_expert_ids"):
        pack_routes(bundle, ids, 8, 8, packed_route_indices=packed, block_expert_ids=buf[1: 1 + slots // 8],
                    packed_route_count=count)
    with pytest.raises(BadInputError, match="block_expert_ids shares memory with packed_route_count"):
        pack_routes(bundle, ids, 8, 8, packed_route_indices=packed, block_expert_ids=blocks,
                    packed_route_count=blocks[:1])
    assert len(bundle.plans) == 0  # nothing was resolved, so nothing launched


def test_probe_refuses_in_place():
    bundle = SimpleNamespace(device=torch.device("cpu"), device_index=-1)
    src_words, dst_words = probe_words(Probe.E2M1_BF16, 4)
    buf = torch.zeros(src_words + dst_words, dtype=torch.int32)
    at = (src_words - 1) // 4 * 4  # a 16-byte aligned word inside src
    with pytest.raises(BadInputError, match="dst shares memory with src"):
        run_probe(bundle, Probe.E2M1_BF16, buf[:src_words], buf[at: at + dst_words], 4)
