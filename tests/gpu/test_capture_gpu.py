"""MoeLayer inside the ways serving engines capture a model, on the H200 (bundle specs/tiny-fused.yaml).

(a) torch.compile(mode="reduce-overhead") of router + layer (cudagraph trees record, then replay);
(b) one graph per batch size of a sweep, all in one shared memory pool, replayed in random order;
(c) capture on a side stream, unreserved (the shape's default workspace) or reserved
    (`layer.reserve`), and reserved streams replaying concurrently;
(d) two layers of one shape (two MoE layers of a model) chained inside one graph;
(e) no allocation at call time: neither eager, nor under capture, nor at replay.

Graph vs eager runs the same kernels on the same inputs; the decode path (M <= 2) sums the top-k
rows with bf16 atomics, so the last bit may differ: SAME bounds that.  Every capture test also
checks one result against the float32 reference (tests/reference/moe.py) at bf16 tolerance.
Fresh random data each test; outputs are poisoned with NaN before every replay.
"""

from __future__ import annotations

import random

import pytest
import torch

from cuteaot.runtime import errors, load_bundle, prepare_w2, prepare_w13
from cuteaot.runtime.moe import MoeLayer
from tests.reference.moe import moe_reference
from tests.reference.nvfp4 import dequantize_modelopt, quantize_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

H, I, E, TOP_K = 512, 256, 16, 4  # tiny-fused-silu of specs/tiny-fused.yaml (token buckets up to 4096)
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # a serving engine's capture sizes, all within the bundle
SAME = 5e-3  # one computation, two launch paths
TOL = 1e-2  # against the float32 reference


@pytest.fixture(scope="module")
def bundle(fused_bundle_dir):
    return load_bundle(fused_bundle_dir)


class Experts:
    """Random NVFP4 experts: packed for the layer, dequantised (float32) for the reference."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        q13 = quantize_nvfp4(torch.randn(E, 2 * I, H, generator=g) * 0.05)
        q2 = quantize_nvfp4(torch.randn(E, H, I, generator=g) * 0.05)
        self.w13, self.w2 = prepare_w13(*q13, "bf16").to("cuda"), prepare_w2(*q2, "bf16").to("cuda")
        self.w13_f, self.w2_f = dequantize_modelopt(*q13).cuda(), dequantize_modelopt(*q2).cuda()

    def layer(self, bundle, **kw) -> MoeLayer:
        return MoeLayer(bundle, self.w13, self.w2, top_k=TOP_K, activation="silu", **kw)

    def reference(self, x, topk_weights, topk_ids) -> torch.Tensor:
        return moe_reference(x, self.w13_f, self.w2_f, topk_weights, topk_ids, "silu")[0]


def routed(m: int, g: torch.Generator, ids_dtype=torch.int32):
    x = (torch.randn(m, H, generator=g) * 2).to(torch.bfloat16).cuda()
    ids = torch.rand(m, E, generator=g).topk(TOP_K, dim=1).indices.to(ids_dtype).cuda()
    weights = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=1).cuda()
    return x, weights, ids


def rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def check(out, want, tol: float, what: str) -> None:
    assert not out.isnan().any(), f"{what}: NaN in the output (a row was never written)"
    err = rel_err(out, want)
    assert err <= tol, f"{what}: rel err {err:.2e} > {tol:.0e}"


def load(dst: tuple, src: tuple) -> None:
    for d, s in zip(dst, src):
        d.copy_(s)


def warm_up(stream: torch.cuda.Stream, fn) -> None:
    """One eager call on the capture stream (resolves the plan) before capturing there."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)


# ---- (a) torch.compile(mode="reduce-overhead") -----------------------------------------------------


def test_reduce_overhead_compile_matches_eager(bundle):
    experts = Experts(1)
    layer = experts.layer(bundle)
    router = torch.nn.Linear(H, E, bias=False, dtype=torch.bfloat16, device="cuda").requires_grad_(False)

    def forward(x):
        probs = torch.softmax(router(x), dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = probs.topk(TOP_K, dim=-1)  # int64 ids
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return layer(x, topk_weights, topk_ids), topk_weights, topk_ids

    compiled = torch.compile(forward, mode="reduce-overhead")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in (1, 3, 16, 40):
            for call in range(4):  # warm-up, record, then replays of the cudagraph tree
                x = (torch.randn(m, H, generator=g) * 2).to(torch.bfloat16).cuda()
                torch.compiler.cudagraph_mark_step_begin()
                out, topk_weights, topk_ids = (t.clone() for t in compiled(x))
                # eager on the compiled routing: a near-tie in the router may legitimately pick
                # another expert in compiled code, which is not what this test is about
                eager = layer(x, topk_weights, topk_ids)
                check(out, eager, SAME, f"reduce-overhead M={m} call {call}")
            check(out, experts.reference(x, topk_weights, topk_ids), TOL, f"reduce-overhead M={m} vs reference")


# ---- (b) a capture sweep sharing one pool ----------------------------------------------------------


def test_sweep_in_one_pool_replays_in_random_order(bundle):
    experts = Experts(3)
    layer = experts.layer(bundle)
    g = torch.Generator().manual_seed(4)
    static = routed(max(SWEEP), g)  # valid routes already at capture time
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    graphs, outs = {}, {}
    for m in sorted(SWEEP, reverse=True):  # largest first: later graphs reuse the pool's blocks
        args = tuple(t[:m] for t in static)
        warm_up(stream, lambda: layer(*args))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            outs[m] = layer(*args)  # the output is allocated in the shared pool
        graphs[m] = graph
    order = list(SWEEP) * 2
    random.Random(5).shuffle(order)
    for m in order:
        data = routed(m, g)
        load(tuple(t[:m] for t in static), data)
        outs[m].fill_(float("nan"))
        graphs[m].replay()
        eager = layer(*data)
        torch.cuda.synchronize()
        check(outs[m], eager, SAME, f"pool sweep M={m}")
        check(outs[m], experts.reference(*data), TOL, f"pool sweep M={m} vs reference")
    # no two graphs of the pool share an output block: replaying one leaves the others' outputs alone
    snapshot = {m: outs[m].clone() for m in SWEEP}
    largest = max(SWEEP)
    load(static, routed(largest, g))
    graphs[largest].replay()
    torch.cuda.synchronize()
    assert not torch.equal(outs[largest], snapshot[largest])
    for m in SWEEP[:-1]:
        assert torch.equal(outs[m], snapshot[m]), f"M={m}: output overwritten by the M={largest} graph"


# ---- (c) capture on a side stream, reserved streams --------------------------------------------------


@pytest.mark.parametrize("reserved", [False, True], ids=["shared-workspace", "reserved"])
def test_capture_on_side_stream(bundle, reserved):
    experts = Experts(6)
    layer = experts.layer(bundle)
    stream = torch.cuda.Stream()
    if reserved:
        layer.reserve([stream])
    g = torch.Generator().manual_seed(7)
    for m in (2, 37, 1000):
        static = routed(m, g)
        out = torch.empty(m, H, dtype=torch.bfloat16, device="cuda")
        warm_up(stream, lambda: layer(*static, out=out))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            layer(*static, out=out)
        for _ in range(2):
            data = routed(m, g)
            load(static, data)
            out.fill_(float("nan"))
            graph.replay()
            eager = layer(*data)
            torch.cuda.synchronize()
            check(out, eager, SAME, f"side stream M={m}")
        check(out, experts.reference(*data), TOL, f"side stream M={m} vs reference")


def test_reserved_streams_replay_concurrently(bundle):
    experts = Experts(8)
    layer = experts.layer(bundle)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    layer.reserve(streams)
    g = torch.Generator().manual_seed(9)
    data = [routed(m, g) for m in (64, 1000)]
    want = [layer(*d).clone() for d in data]
    outs = [torch.empty_like(w) for w in want]
    graphs = []
    for s, d, o in zip(streams, data, outs):
        warm_up(s, lambda: layer(*d, out=o))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            layer(*d, out=o)
        graphs.append(graph)
    for o in outs:
        o.fill_(float("nan"))
    torch.cuda.synchronize()
    for _ in range(20):  # both graphs in flight at once: each needs its own workspace
        for s, graph in zip(streams, graphs):
            with torch.cuda.stream(s):
                graph.replay()
    torch.cuda.synchronize()
    for o, w, m in zip(outs, want, (64, 1000)):
        check(o, w, SAME, f"concurrent replay M={m}")


def test_reserve_under_capture_is_refused(bundle):
    layer = Experts(10).layer(bundle)
    g = torch.Generator().manual_seed(11)
    data = routed(4, g)
    out = torch.empty(4, H, dtype=torch.bfloat16, device="cuda")
    stream, other = torch.cuda.Stream(), torch.cuda.Stream()  # streams are created outside capture
    warm_up(stream, lambda: layer(*data, out=out))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        layer(*data, out=out)
        with pytest.raises(errors.CaptureError):
            layer.reserve([other])
    out.fill_(float("nan"))
    graph.replay()  # the graph captured around the refusal is intact
    torch.cuda.synchronize()
    check(out, layer(*data), SAME, "replay after a refused reserve")


# ---- (d) two layers of one shape in one graph ---------------------------------------------------------


def test_two_layers_chained_in_one_graph(bundle):
    first, second = Experts(12), Experts(13)
    la, lb = first.layer(bundle), second.layer(bundle)  # same shape: they share the workspaces
    g = torch.Generator().manual_seed(14)
    stream = torch.cuda.Stream()
    for m in (2, 37, 300):
        x, w1, ids1 = routed(m, g)
        _, w2, ids2 = routed(m, g)
        static = (x, w1, ids1, w2, ids2)

        def chain():
            y = la(x, w1, ids1)
            return y, lb(y, w2, ids2)

        warm_up(stream, chain)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y, z = chain()
        data = (*routed(m, g), *routed(m, g)[1:])
        load(static, data)
        y.fill_(float("nan"))
        z.fill_(float("nan"))
        graph.replay()
        ye = la(*data[:3])
        # the second layer eagerly on the replayed first output: at M <= 2 the top-k sums use bf16
        # atomics, whose last-bit differences the second layer would otherwise amplify
        ze = lb(y.clone(), *data[3:])
        torch.cuda.synchronize()
        check(y, ye, SAME, f"first layer in the chain M={m}")
        check(z, ze, SAME, f"second layer in the chain M={m}")
        check(y, first.reference(*data[:3]), TOL, f"first layer M={m} vs reference")
        check(z, second.reference(ye, *data[3:]), TOL, f"second layer M={m} vs reference")


# ---- (e) no allocation at call time ---------------------------------------------------------------


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("m", [1, 37])
def test_calls_do_not_allocate(bundle, m, ids_dtype):
    layer = Experts(15).layer(bundle)
    g = torch.Generator().manual_seed(16)
    data = routed(m, g, ids_dtype)
    out = torch.empty(m, H, dtype=torch.bfloat16, device="cuda")
    layer(*data, out=out)  # resolves the plan of M (host-side caches only)
    torch.cuda.synchronize()

    def assert_no_allocation(what: str, fn) -> None:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        # the peak catches temporaries freed before the call returns
        assert torch.cuda.max_memory_allocated() == before, f"{what}: allocated a temporary"
        assert torch.cuda.memory_allocated() == before, f"{what}: kept an allocation"

    assert_no_allocation("eager call", lambda: layer(*data, out=out))
    stream = torch.cuda.Stream()  # first use of this stream, not warmed up: shares the default workspace
    graph = torch.cuda.CUDAGraph()

    def capture():
        with torch.cuda.graph(graph, stream=stream):
            layer(*data, out=out)

    assert_no_allocation("capture", capture)
    out.fill_(float("nan"))
    assert_no_allocation("replay", graph.replay)
    check(out, layer(*data), SAME, f"M={m} replay of the allocation-free capture")
    # out=None allocates the (M, H) output and nothing else
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = layer(*data)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before == y.untyped_storage().nbytes() == m * H * 2


# ---- (f) programmatic dependent launch ------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 2, 8, 37, 300, 1500])
def test_programmatic_launches_match_plain_ones(bundle, m):
    """Every kernel of the bundle waits for its predecessors, so the runtime launches it with
    programmatic stream serialization (PDL): its CTAs may start while the kernel before it drains.  A
    chain of four layers, each reading the previous one's output at once, eagerly and from a graph
    replayed ten times, matches each layer run with plain launches on the same input (a kernel that
    read before its wait would see a half-written input)."""
    from cuteaot.runtime.bundle import set_programmatic_launch

    assert bundle._kernels and all(k.programmatic for k in bundle._kernels.values())
    experts = [Experts(20), Experts(21)]
    layers = [e.layer(bundle) for e in experts] * 2
    g = torch.Generator().manual_seed(22)
    x, *routing = routed(m, g)
    routings = [routing] + [routed(m, g)[1:] for _ in range(3)]

    def chain():
        ys = [x]
        for layer, (w, ids) in zip(layers, routings):
            ys.append(layer(ys[-1], w, ids))
        return ys[1:]

    def check_each(ys, what: str) -> None:
        previous = set_programmatic_launch(False)
        try:
            inputs = [x, *ys[:-1]]
            for i, (layer, (w, ids)) in enumerate(zip(layers, routings)):
                check(ys[i], layer(inputs[i].clone(), w, ids), SAME, f"{what}: layer {i} M={m}")
        finally:
            set_programmatic_launch(previous)

    previous = set_programmatic_launch(True)
    try:
        ys = chain()
        check_each(ys, "eager, PDL")
        check(ys[0], experts[0].reference(x, *routing), TOL, f"layer 0 M={m} vs reference")
        stream = torch.cuda.Stream()
        warm_up(stream, chain)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            ys = chain()
        for _ in range(10):
            for y in ys:
                y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check_each(ys, "graph, PDL")
    finally:
        set_programmatic_launch(previous)
