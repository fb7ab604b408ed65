"""Workspaces, memory and determinism of MoeLayer on the H200 (bundle: specs/tiny-fused.yaml).

* memory comes back: layers built, reserved on streams, captured and deleted leave
  torch's allocated bytes where they started;
* a call allocates nothing (capture without reservations works, memory flat across calls);
* deterministic=True: bit-identical results run to run, eager vs graph replay, across streams;
* options the bundle cannot serve fail when the layer is built.
"""

from __future__ import annotations

import gc

import pytest
import torch

from cuteaot.runtime import BadInputError, CaptureError, UnknownSpecializationError, load_bundle, prepare_w2, prepare_w13
from cuteaot.runtime.moe import MoeLayer, run_w4a16_moe
from tests.reference.moe import moe_reference
from tests.reference.nvfp4 import dequantize_modelopt, quantize_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

H, I, E, TOP_K = 512, 256, 16, 4  # tiny-fused-silu (bf16)


@pytest.fixture(scope="module")
def bundle(fused_bundle_dir):
    return load_bundle(fused_bundle_dir)


def weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    q13 = quantize_nvfp4(torch.randn(E, 2 * I, H, generator=g) * 0.05)
    q2 = quantize_nvfp4(torch.randn(E, H, I, generator=g) * 0.05)
    return prepare_w13(*q13, "bf16").to("cuda"), prepare_w2(*q2, "bf16").to("cuda"), q13, q2


def inputs(m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, H, generator=g) * 2).to(torch.bfloat16).cuda()
    ids = torch.rand(m, E, generator=g).topk(TOP_K, dim=1).indices.to(torch.int32).cuda()
    w = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=1).cuda()
    return x, w, ids


def settled_bytes() -> int:
    """torch's allocated bytes once garbage (layers, graphs) is collected."""
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_memory_returns_after_50_layers_and_10_capture_streams(bundle):
    w13, w2, _, _ = weights(1)
    x, w, ids = inputs(8, 2)
    before = settled_bytes()
    layers = [MoeLayer(bundle, w13, w2, top_k=TOP_K, max_tokens=64 + (i % 5)) for i in range(50)]  # 5 shapes
    streams = [torch.cuda.Stream() for _ in range(10)]
    graphs = []
    for layer, stream in zip(layers, streams):
        layer.reserve([stream])
        out = torch.empty(8, H, dtype=torch.bfloat16, device="cuda")
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x, w, ids, out=out)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            layer(x, w, ids, out=out)
        graph.replay()
        graphs.append((graph, out))
    torch.cuda.synchronize()
    assert settled_bytes() > before
    del layers, graphs, out, layer, graph  # the loop variables hold the last layer and graph too
    assert settled_bytes() == before, "deleting every layer and graph must give the workspaces back"
    assert len(bundle.workspaces) == 0


def test_functional_layers_die_with_their_weights(bundle):
    x, w, ids = inputs(8, 3)
    before = settled_bytes()
    for seed in range(5):
        w13, w2, _, _ = weights(10 + seed)
        run_w4a16_moe(bundle, x, w13, w2, w, ids)
    del w13, w2
    assert settled_bytes() == before


def allocations() -> int:
    """Allocations torch's caching allocator has handed out so far (any size, any pool)."""
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"]


def test_calls_allocate_nothing(bundle):
    w13, w2, _, _ = weights(4)
    layer = MoeLayer(bundle, w13, w2, top_k=TOP_K)
    for m in (1, 2, 3, 37, 1000):
        for ids_dtype in (torch.int32, torch.int64):
            x, w, ids = inputs(m, m)
            ids = ids.to(ids_dtype)
            out = torch.empty(m, H, dtype=torch.bfloat16, device="cuda")
            layer(x, w, ids, out=out)  # first call of each M: resolution is cached host state only
            before = allocations()
            for _ in range(3):
                layer(x, w, ids, out=out)
            assert allocations() == before, f"M={m} {ids_dtype}: a call allocated device memory"


def test_capture_needs_no_reservation(bundle):
    w13, w2, q13, q2 = weights(4)
    layer = MoeLayer(bundle, w13, w2, top_k=TOP_K)
    w13_f, w2_f = dequantize_modelopt(*q13).cuda(), dequantize_modelopt(*q2).cuda()
    for m in (1, 2, 3, 37, 1000):
        x, w, ids = inputs(m, m)
        out = torch.full((m, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        stream = torch.cuda.Stream()  # never seen, never reserved: uses the shape's default workspace
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            layer(x, w, ids.long(), out=out)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _, _ = moe_reference(x, w13_f, w2_f, w, ids, "silu")
        err = float((out.float() - ref).norm() / ref.norm())
        assert err <= 1e-2, f"M={m}: replay rel err {err:.2e}"
    with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=torch.cuda.Stream()):
        with pytest.raises(CaptureError, match="before capturing"):
            layer.reserve([torch.cuda.Stream()])


@pytest.mark.parametrize("m", [1, 2, 5])
def test_deterministic_mode_is_bit_identical(bundle, m):
    w13, w2, _, _ = weights(6)
    layer = MoeLayer(bundle, w13, w2, top_k=TOP_K, deterministic=True)
    assert not layer.resolve(m).decode and not layer.resolve(m).sums_topk  # no bf16 atomics
    x, w, ids = inputs(m, 7)
    first = layer(x, w, ids).clone()
    for _ in range(20):
        assert torch.equal(layer(x, w, ids), first), f"M={m}: eager runs differ"
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    layer.reserve(streams)
    outs = [torch.empty_like(first) for _ in streams]
    torch.cuda.synchronize()
    for _ in range(10):
        for s, o in zip(streams, outs):
            with torch.cuda.stream(s):
                layer(x, w, ids, out=o)
    torch.cuda.synchronize()
    assert all(torch.equal(o, first) for o in outs), f"M={m}: streams differ"
    out = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=streams[0]):
        layer(x, w, ids, out=out)
    for _ in range(5):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first), f"M={m}: graph replay differs from eager"


def test_options_the_bundle_lacks_fail_at_construction(bundle):
    g = torch.Generator().manual_seed(8)
    # tiny-fused builds the fp16 silu problem without router_weight_on_input
    q13 = quantize_nvfp4(torch.randn(E, 2 * I, H, generator=g) * 0.05)
    q2 = quantize_nvfp4(torch.randn(E, H, I, generator=g) * 0.05)
    w13, w2 = prepare_w13(*q13, "fp16").to("cuda"), prepare_w2(*q2, "fp16").to("cuda")
    with pytest.raises(UnknownSpecializationError, match="router_weight_on_input"):
        MoeLayer(bundle, w13, w2, top_k=TOP_K, router_weight_on_input=True)


@pytest.mark.parametrize("m", [1, 37, 600])  # decode, packed, FC1/FC2 as two GEMM launches
def test_a_bound_call_matches_the_layer_and_follows_refilled_buffers(bundle, m):
    w13, w2, q13, q2 = weights(9)
    layer = MoeLayer(bundle, w13, w2, top_k=TOP_K)
    x, w, ids = inputs(m, 10)
    out = torch.full((m, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    bound = layer.bind(x, w, ids, out)
    assert torch.isnan(out).all(), "bind() must not launch"
    want = layer(x, w, ids)
    got = bound().clone()
    tol = 5e-3 if layer.resolve(m).sums_topk else 0.0  # decode / the fused top-k sum: bf16 atomics
    assert float((got.float() - want.float()).norm() / want.float().norm()) <= tol
    x2, w2_, ids2 = inputs(m, 11)  # a new step: refill the bound buffers in place
    x.copy_(x2), w.copy_(w2_), ids.copy_(ids2)
    out.fill_(float("nan"))
    bound()
    torch.cuda.synchronize()
    ref, _, _ = moe_reference(x2, dequantize_modelopt(*q13).cuda(), dequantize_modelopt(*q2).cuda(), w2_, ids2, "silu")
    assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2
    with pytest.raises(BadInputError, match="int32"):
        layer.bind(x, w, ids.long(), out)
