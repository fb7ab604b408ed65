"""The fused MoE serving path (MoeLayer) on the H200, against a float32 reference.

Bundle: specs/tiny-fused.yaml.  Every test draws fresh random weights and inputs, poisons
the output with NaN first, and compares with tests/reference/moe.py run on the dequantised
ModelOpt weights (so only the kernels' bf16/fp16 rounding of intermediates remains).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from cuteaot.runtime import load_bundle, prepare_w2, prepare_w2_mxfp4, prepare_w13, prepare_w13_mxfp4
from cuteaot.runtime.errors import BadInputError, UnknownSpecializationError
from cuteaot.runtime.moe import MoeLayer, run_w4a16_moe
from tests.reference.moe import moe_reference, skewed_topk_ids
from tests.reference.mxfp4 import dequantize_mxfp4, random_mxfp4
from tests.reference.nf3 import dequantize_nf3
from tests.reference.nvfp4 import dequantize_modelopt, quantize_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

# name -> (H, I, E, top_k, activation, dtype), the problems of specs/tiny-fused.yaml
PROBLEMS = {
    "silu-bf16": (512, 256, 16, 4, "silu", "bf16"),
    "silu-fp16": (512, 256, 16, 4, "silu", "fp16"),
    "swigluoai": (736, 352, 8, 2, "swigluoai", "bf16"),
    "relu2": (576, 320, 8, 3, "relu2", "bf16"),  # both sizes 64 (mod 128): masked N tiles, part k-tiles
    "relu2-bias-fp16": (576, 320, 8, 3, "relu2", "fp16"),  # built with biases only; masked tiles as relu2
    "swigluoai-whole-bias": (576, 384, 8, 2, "swigluoai", "bf16"),  # whole gate | up slabs; biases only
}
# problems with tests of their own: name -> the same tuple
OWN_PROBLEMS = {
    "mixed": (1024, 256, 8, 2, "silu", "bf16"),  # FC1 on 256-row blocks, FC2 on 128-row ones, at 640-1023 tokens
}
# the NF3 problems (weights: nf3; swigluoai with biases and logical tails)
NF3_PROBLEMS = {"silu": (512, 256, 16, 4), "swigluoai": (736, 352, 8, 2), "relu2": (512, 320, 8, 3)}
NF3_TOKENS = (1, 2, 7, 37, 64, 129, 1000, 3000)
TOKENS = (1, 2, 3, 4, 8, 16, 37, 64, 512, 1000, 4096)
OAI = dict(alpha=1.702, beta=1.0, limit=7.0)  # the swigluoai defaults
TOL = 1e-2


@pytest.fixture(scope="module")
def bundle(fused_bundle_dir):
    return load_bundle(fused_bundle_dir)


class Model:
    """Random NVFP4 weights of one problem: packed for the kernels, dequantised for the reference."""

    def __init__(self, name: str, seed: int, experts: int | None = None):
        h, i, e, top_k, activation, dtype = PROBLEMS[name] if name in PROBLEMS else OWN_PROBLEMS[name]
        self.h, self.i, self.top_k, self.activation, self.dtype = h, i, top_k, activation, dtype
        self.e = e if experts is None else experts
        g = torch.Generator().manual_seed(seed)
        n1 = 2 * i if activation != "relu2" else i
        q13 = quantize_nvfp4(torch.randn(self.e, n1, h, generator=g) * 0.05)
        q2 = quantize_nvfp4(torch.randn(self.e, h, i, generator=g) * 0.05)
        self.q13, self.q2 = q13, q2
        self.w13, self.w2 = prepare_w13(*q13, dtype).to("cuda"), prepare_w2(*q2, dtype).to("cuda")
        self.w13_f, self.w2_f = dequantize_modelopt(*q13).cuda(), dequantize_modelopt(*q2).cuda()
        self.g = g
        self.ref_kw = OAI if activation == "swigluoai" else {}

    def inputs(self, m: int, experts: int | None = None):
        return routed_inputs(m, self.h, self.e if experts is None else experts, self.top_k, self.g, self.dtype)

    def layer(self, bundle, **kw) -> MoeLayer:
        return MoeLayer(bundle, self.w13, self.w2, top_k=self.top_k, activation=self.activation, **kw)


def routed_inputs(m: int, h: int, e: int, top_k: int, g: torch.Generator, dtype: str = "bf16"):
    """(x, router weights, int32 ids) on the GPU: x ~ 2 N(0, 1), uniform top-k of e experts."""
    x = (torch.randn(m, h, generator=g) * 2).to(torch.bfloat16 if dtype == "bf16" else torch.float16)
    ids = torch.rand(m, e, generator=g).topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(m, top_k, generator=g), dim=1)
    return x.cuda(), weights.cuda(), ids.cuda()


def replayed(layer, x, weights, ids, times: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(eager output, output of the call captured in a CUDA graph and replayed `times` times, each into the
    buffer poisoned again)."""
    eager = layer(x, weights, ids)
    out = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x, weights, ids, out=out)
    for _ in range(times):
        out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    return eager, out


def on_two_streams(layer, data: list, rounds: int = 20) -> list[torch.Tensor]:
    """Each (x, weights, ids) of `data` on a stream of its own (reserved workspaces), `rounds` times
    interleaved; the last outputs."""
    streams = [torch.cuda.Stream() for _ in data]
    layer.reserve(streams)  # concurrent streams need workspaces of their own
    outs = [torch.empty(d[0].shape, dtype=d[0].dtype, device="cuda") for d in data]
    torch.cuda.synchronize()
    for _ in range(rounds):
        for s, d, o in zip(streams, data, outs):
            with torch.cuda.stream(s):
                layer(*d, out=o)
    torch.cuda.synchronize()
    assert layer.workspace(streams[0].cuda_stream) is not layer.workspace(streams[1].cuda_stream)
    return outs


def poisoned(m, h, dtype):
    return torch.full((m, h), float("nan"), dtype=torch.bfloat16 if dtype == "bf16" else torch.float16, device="cuda")


def assert_clean(workspace) -> None:
    """The barrier word's low 31 bits (its top bit flips at every barrier) and every split-K lock back at zero."""
    locks = workspace.locks.cpu()
    assert int(locks[0]) & 0x7FFFFFFF == 0 and int(locks[2:].abs().sum()) == 0, f"dirty workspace: {locks[:8].tolist()}"


def rel_err(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture
def check(worst_errors):
    """check(out, ref, what, key): no NaN, rel err within TOL; the worst error per key goes to the report."""

    def check(out, ref, what: str, key: str) -> float:
        assert not out.isnan().any(), f"{what}: NaN in the output (a row was never written)"
        err = rel_err(out, ref)
        worst_errors.record(f"fused {key}", err)
        assert err <= TOL, f"{what}: rel err {err:.2e}"
        return err

    return check


@pytest.mark.parametrize("name", [p for p in PROBLEMS if "bias" not in p])
def test_fused_layer_matches_reference(bundle, check, name):
    model = Model(name, seed=zlib.crc32(name.encode()))  # stable across processes, unlike hash(str)
    layer = model.layer(bundle)
    for m in TOKENS:
        x, w, ids = model.inputs(m)
        out = layer(x, w, ids, out=poisoned(m, model.h, model.dtype))
        ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, model.activation, **model.ref_kw)
        check(out, ref, f"{name} M={m} ({'decode' if layer.resolve(m).decode else 'packed'})", name)
    assert_clean(layer.workspace())


@pytest.mark.parametrize("name", ["silu-bf16", "relu2"])
def test_router_weight_on_input(bundle, check, name):
    model = Model(name, seed=5)
    layer = model.layer(bundle, router_weight_on_input=True)
    for m in (1, 4, 37, 1000):
        x, w, ids = model.inputs(m)
        out = layer(x, w, ids, out=poisoned(m, model.h, model.dtype))
        ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, model.activation, on_input=True)
        check(out, ref, f"{name} on_input M={m}", f"{name}+on_input")


def test_expert_map_drops_remote_experts(bundle, check):
    """16 global experts, this rank holds the even ones (8 local weights); odd routes give 0."""
    model = Model("silu-bf16", seed=7, experts=8)
    expert_map = torch.full((16,), -1, dtype=torch.int32)
    expert_map[0::2] = torch.arange(8, dtype=torch.int32)
    index = torch.arange(16) // 2
    layer = model.layer(bundle, expert_map=expert_map.cuda())
    for m in (1, 4, 16, 64, 1000):
        x, w, ids = model.inputs(m, experts=16)
        out = layer(x, w, ids, out=poisoned(m, model.h, model.dtype))
        ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, "silu", local=set(range(0, 16, 2)),
                                  expert_index=index.cuda())
        check(out, ref, f"expert_map M={m}", "silu+expert_map")


def test_decode_and_packed_paths_agree(bundle, worst_errors):
    """M <= 2 runs the decode kernel; an all-local expert_map forces the packed kernels on the same data."""
    model = Model("silu-bf16", seed=9)
    decode = model.layer(bundle)
    packed = model.layer(bundle, expert_map=torch.arange(16, dtype=torch.int32, device="cuda"))
    for m in (1, 2):
        assert decode.resolve(m).decode and not packed.resolve(m).decode
        x, w, ids = model.inputs(m)
        a = decode(x, w, ids)
        b = packed(x, w, ids)
        err = rel_err(a, b.float())
        worst_errors.record("fused decode vs packed", err)
        assert err <= 5e-3, f"M={m}: decode vs packed rel diff {err:.2e}"


@pytest.mark.parametrize("chunk", [None, 64, 300])
def test_activation_amax_calibration(bundle, check, chunk):
    """Calibration calls record each expert's FC1-input and activation maxima.  `chunk`: the call runs in
    pieces of that many tokens, as it does where the bundle's calibration table stops below the plain
    one (MoeLayer.calibration_tokens; no test bundle has such a table, so the test sets it): every piece
    must add its maxima to the same rows."""
    model = Model("silu-bf16", seed=13)
    layer = model.layer(bundle)
    if chunk is not None:
        assert layer.calibration_tokens > chunk
        layer.calibration_tokens = chunk
    layers = 3
    for m in (5, 200) if chunk is None else (200, 1000):
        x, w, ids = model.inputs(m)
        amax = torch.zeros(layers, model.e, 2, device="cuda")
        out = layer(x, w, ids, out=poisoned(m, model.h, model.dtype), activation_amax=amax, layer_idx=1)
        ref, act, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, "silu")
        check(out, ref, f"calibrated M={m}", "silu+calibration")
        want = torch.zeros(model.e, 2, device="cuda")
        flat = ids.view(-1).long()
        tokens = torch.arange(flat.numel(), device="cuda") // model.top_k
        for e in flat.unique().tolist():
            r = (flat == e).nonzero().view(-1)
            want[e, 0] = x[tokens[r]].float().abs().max()
            want[e, 1] = act[r].abs().max()
        assert torch.equal(amax[0], torch.zeros_like(amax[0])) and torch.equal(amax[2], torch.zeros_like(amax[2]))
        assert torch.equal(amax[1, :, 0], want[:, 0]), "FC1-input maxima differ"
        torch.testing.assert_close(amax[1, :, 1], want[:, 1], rtol=2e-2, atol=1e-3)


def test_graph_replay_equals_eager(bundle):
    model = Model("silu-bf16", seed=17)
    layer = model.layer(bundle)
    for m in (4, 64, 1000):
        x, w, ids = model.inputs(m)
        eager = layer(x, w, ids).clone()
        out = torch.empty_like(eager)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x, w, ids, out=out)  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            layer(x, w, ids, out=out)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
        torch.cuda.synchronize()
        if layer.resolve(m).sums_topk:
            # decode, and packed plans with the fused top-k sum, add the top-k rows with bf16 atomics:
            # the order (and the last bit) may vary
            assert rel_err(out, eager.float()) <= 5e-3
        else:
            assert torch.equal(out, eager), f"M={m}: replay differs from eager"
        assert_clean(layer.workspace(stream.cuda_stream))


def test_two_streams_concurrently(bundle):
    model = Model("silu-bf16", seed=19)
    layer = model.layer(bundle)
    data = [model.inputs(m) for m in (64, 1000)]
    want = [layer(*d).clone() for d in data]
    outs = on_two_streams(layer, data)
    for (x, _, _), o, w in zip(data, outs, want):
        if layer.resolve(x.shape[0]).sums_topk:  # bf16 atomics: the order of the top-k adds may vary
            assert rel_err(o, w.float()) <= 5e-3
        else:
            assert torch.equal(o, w)


def test_chunks_above_max_tokens(bundle, check):
    model = Model("silu-bf16", seed=23)
    layer = model.layer(bundle, max_tokens=100)
    x, w, ids = model.inputs(250)
    out = layer(x, w, ids, out=poisoned(250, model.h, model.dtype))
    ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, "silu")
    check(out, ref, "M=250 in chunks of 100", "silu chunked")


def test_functional_api_and_bad_ids(bundle, check):
    model = Model("silu-bf16", seed=29)
    x, w, ids = model.inputs(16)
    out = run_w4a16_moe(bundle, x, model.w13, model.w2, w, ids, activation="silu")
    ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, "silu")
    check(out, ref, "run_w4a16_moe", "functional")
    bad = ids.clone()
    bad[3, 1] = 16
    # the functional form drops an out-of-range route on the device (= a zero router weight) ...
    out = run_w4a16_moe(bundle, x, model.w13, model.w2, w, bad, activation="silu")
    dropped = w.clone()
    dropped[3, 1] = 0
    ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, dropped, ids, "silu")
    check(out, ref, "run_w4a16_moe, one route dropped", "functional")
    # ... and a layer that validates on the host refuses it before any launch
    with pytest.raises(BadInputError, match="topk_ids must be in"):
        model.layer(bundle, validate_ids=True)(x, w, bad)


def test_in_place_calls_are_refused_and_halves_of_one_buffer_served(bundle, check):
    """out=hidden_states (vLLM's inplace=True) raises before any launch on the per-call fast path of CUDA
    tensors; hidden_states and out as the two halves of one allocation are apart and served."""
    model = Model("silu-bf16", seed=31)
    layer = model.layer(bundle)
    for m in (1, 64):  # decode (zeroes out in the kernel), packed
        x, w, ids = model.inputs(m)
        rows = torch.empty(2 * m, model.h, dtype=x.dtype, device="cuda")
        rows[:m] = x
        with pytest.raises(BadInputError, match="out shares memory with hidden_states"):
            layer(rows[:m], w, ids, out=rows[:m])
        assert torch.equal(rows[:m], x)  # nothing ran
        rows[m:] = float("nan")
        layer(rows[:m], w, ids, out=rows[m:])
        ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, "silu")
        check(rows[m:], ref, f"M={m}, hidden_states and out in one buffer", "silu apart")


def test_in_kernel_route_packing(bundle, check):
    """Packed plans that group the routes inside the fused kernel (FusedSpec.pack_experts): skewed routing,
    int64 ids, ids out of range dropped on the device, the largest M whose routes fit the kernel's tables,
    graph replay, and a bound call that launches no route-pack kernel."""
    model = Model("silu-bf16", seed=37)
    layer = model.layer(bundle)
    packing = [m for m in (3, 8, 37, 64, 255, 256) if layer.resolve(m).packs_routes]
    assert packing, "tiny-fused builds no in-kernel packing plan"
    for m in packing:
        x, w, _ = model.inputs(m)
        ids = skewed_topk_ids(m, model.e, model.top_k, model.g).cuda()
        ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, "silu")
        check(layer(x, w, ids, out=poisoned(m, model.h, model.dtype)), ref, f"M={m} skewed", "in-kernel packing")
        check(layer(x, w, ids.long(), out=poisoned(m, model.h, model.dtype)), ref, f"M={m} int64", "in-kernel packing")
        eager, replay = replayed(layer, x, w, ids)
        assert rel_err(replay, eager.float()) <= 5e-3, f"M={m}: graph replay differs from eager"
        bound = layer.bind(x, w, ids, poisoned(m, model.h, model.dtype))
        assert "moe_route_pack" not in repr(bound) and "w4a16_fused_moe" in repr(bound), repr(bound)
        check(bound(), ref, f"M={m} bound", "in-kernel packing")
    m = packing[-1]
    x, w, ids = model.inputs(m)
    bad = ids.clone()
    bad[0, 0], bad[m // 2, 1], bad[m - 1, model.top_k - 1] = -1, model.e, 1 << 20
    dropped = w.clone()
    dropped[0, 0] = dropped[m // 2, 1] = dropped[m - 1, model.top_k - 1] = 0
    ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, dropped, ids, "silu")
    out = run_w4a16_moe(bundle, x, model.w13, model.w2, w, bad, activation="silu")
    check(out, ref, f"M={m}, three routes out of range dropped", "in-kernel packing")
    assert_clean(layer.workspace())


def test_torch_compile(bundle, check):
    model = Model("silu-bf16", seed=31)
    layer = model.layer(bundle)
    x, w, ids = model.inputs(37)
    compiled = torch.compile(lambda a, b, c: layer(a, b, c) * 1.0, fullgraph=True)
    out = compiled(x, w, ids)
    ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, "silu")
    check(out, ref, "torch.compile", "torch.compile")



def _biases(model: Model, n1: int, scale: float = 0.5):
    """Random per-expert biases (E, N1) and (E, H) in the layer dtype, on the GPU."""
    dt = torch.bfloat16 if model.dtype == "bf16" else torch.float16
    b13 = (torch.randn(model.e, n1, generator=model.g) * scale).to(dt).cuda()
    b2 = (torch.randn(model.e, model.h, generator=model.g) * scale).to(dt).cuda()
    return b13, b2


@pytest.mark.parametrize("name", ["swigluoai", "relu2-bias-fp16"])
def test_biases_in_both_epilogues(bundle, check, name):
    """FC1's bias before the activation (relu2 in FC1's epilogue too), FC2's before the router weight."""
    model = Model(name, seed=37)
    n1 = model.w13.n
    b13, b2 = _biases(model, n1)
    w13 = prepare_w13(*model.q13, model.dtype, bias=b13.cpu()).to("cuda")
    w2 = prepare_w2(*model.q2, model.dtype, bias=b2.cpu()).to("cuda")
    layer = MoeLayer(bundle, w13, w2, top_k=model.top_k, activation=model.activation)
    assert layer.facts.bias
    for m in TOKENS:
        x, w, ids = model.inputs(m)
        out = layer(x, w, ids, out=poisoned(m, model.h, model.dtype))
        ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, model.activation, b13=b13, b2=b2,
                                  **model.ref_kw)
        launch = layer.resolve(m).launch
        path = "decode" if launch.direct else ("split" if launch.split else "packed")
        check(out, ref, f"{name} + bias M={m} ({path})", f"{name}+bias")
    assert_clean(layer.workspace())


def _gated_weights(model: Model, name: str):
    """(w13, w2, b13, b2) of a gated-epilogue test problem: its own weights, with biases for the
    problem built with biases only (swigluoai-whole-bias)."""
    if name != "swigluoai-whole-bias":
        return model.w13, model.w2, None, None
    b13, b2 = _biases(model, model.w13.n)
    return (prepare_w13(*model.q13, model.dtype, bias=b13.cpu()).to("cuda"),
            prepare_w2(*model.q2, model.dtype, bias=b2.cpu()).to("cuda"), b13, b2)


@pytest.mark.parametrize("name", ["silu-bf16", "silu-fp16", "swigluoai-whole-bias"])
def test_gated_fc1_epilogue(bundle, check, name):
    """Where the layer runs as two wgmma GEMMs, FC1's epilogue applies the activation to the gate and up
    halves of its tile (bias and, with router_weight_on_input, the router weight first): no activation
    launch.  Uniform and skewed routing (most routes on two experts)."""
    model = Model(name, seed=zlib.crc32(name.encode()) + 5)
    w13, w2, b13, b2 = _gated_weights(model, name)
    on_input_variants = (False, True) if name == "silu-bf16" else (False,)
    for on_input in on_input_variants:
        layer = MoeLayer(bundle, w13, w2, top_k=model.top_k, activation=model.activation,
                         router_weight_on_input=on_input)
        for m, skewed in ((512, False), (1000, True), (4096, False)):
            r = layer.resolve(m)
            assert r.launch.split and r.kernels["fc1"].spec.epilogue.value == model.activation, r.describe()
            x, w, ids = model.inputs(m)
            if skewed:
                ids = skewed_topk_ids(m, model.e, model.top_k, model.g).cuda()
            out = layer(x, w, ids, out=poisoned(m, model.h, model.dtype))
            ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, model.activation, b13=b13, b2=b2,
                                      on_input=on_input, **model.ref_kw)
            check(out, ref, f"{name} gated FC1 M={m} on_input={on_input} skewed={skewed} ({r.describe()})",
                  f"{name} gated FC1")
        assert_clean(layer.workspace())


def test_fc2_reads_fc1_wide_packing_as_narrow_blocks(bundle, check):
    """From 160 to 255 routes per expert a layer whose FC2 K is short runs FC1 on 256-row blocks and FC2 on
    128-row blocks of the same packing (GemmSpec.packing_block), skipping the blocks of padding only: uniform
    and skewed routing (most routes on two experts: many blocks each, the others one part-filled block),
    graph replay, and the plan on either side of the range."""
    model = Model("mixed", seed=41)
    layer = model.layer(bundle)
    for m, skewed in ((640, False), (700, True), (1000, False), (1023, True)):
        r = layer.resolve(m)
        assert r.launch.split and r.launch.route_block == 256, r.describe()
        assert r.kernels["fc2"].spec.moe_block_size == 128 and r.kernels["fc2"].spec.packing_block == 256
        x, w, ids = model.inputs(m)
        if skewed:
            ids = skewed_topk_ids(m, model.e, model.top_k, model.g).cuda()
        out = layer(x, w, ids, out=poisoned(m, model.h, model.dtype))
        ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, model.activation)
        check(out, ref, f"mixed M={m} skewed={skewed} ({r.describe()})", "mixed blocks")
    eager, replay = replayed(layer, x, w, ids)
    assert torch.equal(eager, replay)
    assert_clean(layer.workspace())
    for m in (512, 2048):  # outside the range: one block size for both GEMMs
        assert layer.resolve(m).kernels["fc2"].spec.packing_block is None


@pytest.mark.parametrize("name", ["silu-bf16", "silu-fp16", "swigluoai-whole-bias"])
def test_fused_kernel_activates_in_fc1(bundle, check, name):
    """The fused kernel's FC1 applies the gated activation in its epilogue (FusedSpec.gated_epilogue: no
    activation pass, one grid barrier fewer) on the decode and packed mma.sync paths and, with an expert
    map (no split there), on the wgmma loop; bias and router weight on the input; uniform and skewed
    routing; graph replay."""
    model = Model(name, seed=zlib.crc32(name.encode()) + 11)
    w13, w2, b13, b2 = _gated_weights(model, name)
    variants = [dict()]
    if name == "silu-bf16":
        variants += [dict(router_weight_on_input=True), dict(expert_map=torch.arange(model.e, dtype=torch.int32).cuda())]
    paths = set()
    for kw in variants:
        layer = MoeLayer(bundle, w13, w2, top_k=model.top_k, activation=model.activation, **kw)
        for m, skewed in ((1, False), (2, False), (5, True), (37, False), (200, True), (1000, True), (4096, False)):
            r = layer.resolve(m)
            if r.launch.split:
                continue
            assert r.kernels["fused"].spec.gated_epilogue, r.describe()
            paths.add((r.decode, r.launch.route_block, r.kernels["fused"].spec.mainloop.value))
            x, w, ids = model.inputs(m)
            if skewed:
                ids = skewed_topk_ids(m, model.e, model.top_k, model.g).cuda()
            out = layer(x, w, ids, out=poisoned(m, model.h, model.dtype))
            ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, model.activation, b13=b13, b2=b2,
                                      on_input=bool(kw.get("router_weight_on_input")), **model.ref_kw)
            check(out, ref, f"{name} fused gated FC1 M={m} {sorted(kw)} skewed={skewed} ({r.describe()})",
                  f"{name} fused gated FC1")
            if m == 37:
                eager, replay = replayed(layer, x, w, ids)
                assert torch.equal(eager, replay), f"{name} M=37: graph replay differs from eager"
        assert_clean(layer.workspace())
    assert any(decode for decode, _, _ in paths) and any(not decode for decode, _, _ in paths), paths
    if name == "silu-bf16":
        assert any(loop == "wgmma" for _, _, loop in paths), paths


def test_bias_of_one_projection_only(bundle, check):
    """A checkpoint with only a down-projection bias: FC1 runs with a zero bias."""
    model = Model("swigluoai", seed=41)
    _, b2 = _biases(model, model.w13.n)
    w2 = prepare_w2(*model.q2, model.dtype, bias=b2.cpu()).to("cuda")
    layer = MoeLayer(bundle, model.w13, w2, top_k=model.top_k, activation=model.activation)
    for m in (1, 37, 1000):
        x, w, ids = model.inputs(m)
        out = layer(x, w, ids, out=poisoned(m, model.h, model.dtype))
        ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, model.activation, b2=b2, **model.ref_kw)
        check(out, ref, f"w2 bias only M={m}", "swigluoai+w2 bias")


def test_mxfp4_checkpoint_layer(bundle, check):
    """gpt-oss-style MXFP4 tensors (interleaved gate/up rows, biases) served as stored values.

    The reference dequantizes the checkpoint tensors from the MXFP4 definition and splits gate/up
    the way gpt-oss does (even rows gate, odd rows up)."""
    h, i, e, top_k, activation, dtype = PROBLEMS["swigluoai"]
    g = torch.Generator().manual_seed(43)
    blocks13, scales13 = random_mxfp4(e, 2 * i, h, g, spread=5, center=121)
    blocks2, scales2 = random_mxfp4(e, h, i, g, spread=5, center=121)
    bias13 = (torch.randn(e, 2 * i, generator=g) * 0.5).to(torch.bfloat16)
    bias2 = (torch.randn(e, h, generator=g) * 0.5).to(torch.bfloat16)
    w13 = prepare_w13_mxfp4(blocks13, scales13, dtype, bias=bias13).to("cuda")  # interleaved by default
    w2 = prepare_w2_mxfp4(blocks2, scales2, dtype, bias=bias2).to("cuda")
    layer = MoeLayer(bundle, w13, w2, top_k=top_k, activation=activation)
    w13_f = dequantize_mxfp4(blocks13, scales13)
    gate_up = torch.cat((w13_f[:, 0::2], w13_f[:, 1::2]), dim=1).cuda()
    b13 = torch.cat((bias13[:, 0::2], bias13[:, 1::2]), dim=1).cuda()
    w2_f = dequantize_mxfp4(blocks2, scales2).cuda()
    model = Model("swigluoai", seed=44)  # inputs only
    for m in TOKENS:
        x, w, ids = model.inputs(m)
        out = layer(x, w, ids, out=poisoned(m, h, dtype))
        ref, _, _ = moe_reference(x, gate_up, w2_f, w, ids, activation, b13=b13, b2=bias2.cuda(), **OAI)
        check(out, ref, f"mxfp4 + bias M={m}", "swigluoai mxfp4+bias")


def test_bias_layer_needs_bias_kernels(bundle):
    """silu-bf16 was built without biases: a layer with biases is refused before any launch."""
    model = Model("silu-bf16", seed=47)
    b13, b2 = _biases(model, model.w13.n)
    w13 = prepare_w13(*model.q13, model.dtype, bias=b13.cpu()).to("cuda")
    with pytest.raises(UnknownSpecializationError, match="bias"):
        MoeLayer(bundle, w13, model.w2, top_k=model.top_k, activation=model.activation)


def _nf3_layer(bundle, activation: str, seed: int):
    """Random float weights quantized with quantize_nf3; the reference dequantizes its output tensors."""
    from cuteaot.runtime import prepare_w2_nf3, prepare_w13_nf3, quantize_nf3

    h, i, e, top_k = NF3_PROBLEMS[activation]
    g = torch.Generator().manual_seed(seed)
    n1 = i if activation == "relu2" else 2 * i
    q13 = quantize_nf3(torch.randn(e, n1, h, generator=g) * 0.05)
    q2 = quantize_nf3(torch.randn(e, h, i, generator=g) * 0.05)
    kw = {}
    if activation == "swigluoai":
        kw = dict(b13=(torch.randn(e, n1, generator=g) * 0.2).to(torch.bfloat16),
                  b2=(torch.randn(e, h, generator=g) * 0.2).to(torch.bfloat16))
    w13 = prepare_w13_nf3(*q13, bias=kw.get("b13")).to("cuda")
    w2 = prepare_w2_nf3(*q2, bias=kw.get("b2")).to("cuda")
    layer = MoeLayer(bundle, w13, w2, top_k=top_k, activation=activation)
    ref = dict(w13=dequantize_nf3(*q13).cuda(), w2=dequantize_nf3(*q2).cuda(),
               kw={k: v.cuda() for k, v in kw.items()} | (OAI if activation == "swigluoai" else {}))
    return layer, ref, g


@pytest.mark.parametrize("activation", list(NF3_PROBLEMS))
def test_nf3_layer_matches_reference(bundle, check, activation):
    """NF3 weights (quantize_nf3) through every path the table picks up to 3000 tokens, against the
    float32 reference on the dequantized NF3 tensors (tests/reference/nf3.py)."""
    layer, ref, g = _nf3_layer(bundle, activation, seed=51)
    assert layer.facts.weights.value == "nf3"
    h, i, e, top_k = NF3_PROBLEMS[activation]
    activated_in_fc1 = 0
    for m in NF3_TOKENS:
        x, w, ids = routed_inputs(m, h, e, top_k, g)
        out = layer(x, w, ids, out=poisoned(m, h, "bf16"))
        want, _, _ = moe_reference(x, ref["w13"], ref["w2"], w, ids, activation, **ref["kw"])
        r = layer.resolve(m)
        check(out, want, f"nf3 {activation} M={m} ({r.describe()})", f"nf3 {activation}")
        assert_clean(layer.workspace())
        activated_in_fc1 += bool(r.kernels["fused"].spec.gated_epilogue)
    if activation == "silu":  # 2I = 512: whole gate | up slabs, so FC1 activates in its epilogue
        assert activated_in_fc1, "no NF3 plan took the gated epilogue"


def test_nf3_graph_replay_equals_eager(bundle):
    layer, _, g = _nf3_layer(bundle, "silu", seed=52)
    h, _, e, top_k = NF3_PROBLEMS["silu"]
    for m in (1, 64):
        eager, out = replayed(layer, *routed_inputs(m, h, e, top_k, g))
        # decode and the fused top-k sum add the top-k rows with bf16 atomics (order varies)
        tol = 5e-3 if layer.resolve(m).sums_topk else 0
        assert rel_err(out, eager.float()) <= tol, m


def test_nf3_layer_refuses_mixed_formats(bundle):
    from cuteaot.runtime import prepare_w2_nf3, quantize_nf3

    model = Model("silu-bf16", seed=53)
    h, i, e, _ = NF3_PROBLEMS["silu"]
    w2 = prepare_w2_nf3(*quantize_nf3(torch.randn(e, h, i))).to("cuda")
    with pytest.raises(BadInputError, match="one format"):
        MoeLayer(bundle, model.w13, w2, top_k=4)



def test_nvfp4_nf3_hybrid_layer(bundle, check):
    """Half the experts NVFP4, half NF3 (interleaved ids), the NF3 part adding into the NVFP4 part's
    output: against the float32 reference on the experts' dequantized weights, against the sum of its
    parts, and replayed from a CUDA graph."""
    from cuteaot.runtime import HybridMoeLayer, prepare_w2_nf3, prepare_w13_nf3, quantize_nf3

    h, i, e, top_k = NF3_PROBLEMS["silu"]
    g = torch.Generator().manual_seed(54)
    fp4_ids, nf3_ids = list(range(0, e, 2)), list(range(1, e, 2))
    q13, q2 = (quantize_nvfp4(torch.randn(e // 2, n, k, generator=g) * 0.05) for n, k in ((2 * i, h), (h, i)))
    n13, n2 = (quantize_nf3(torch.randn(e // 2, n, k, generator=g) * 0.05) for n, k in ((2 * i, h), (h, i)))
    fp4 = (prepare_w13(*q13, "bf16").to("cuda"), prepare_w2(*q2, "bf16").to("cuda"))
    nf3 = (prepare_w13_nf3(*n13).to("cuda"), prepare_w2_nf3(*n2).to("cuda"))
    layer = HybridMoeLayer(bundle, [(*fp4, fp4_ids), (*nf3, nf3_ids)], top_k=top_k, activation="silu")
    w13_f = torch.empty(e, 2 * i, h)
    w2_f = torch.empty(e, h, i)
    w13_f[fp4_ids], w2_f[fp4_ids] = dequantize_modelopt(*q13), dequantize_modelopt(*q2)
    w13_f[nf3_ids], w2_f[nf3_ids] = dequantize_nf3(*n13), dequantize_nf3(*n2)
    w13_f, w2_f = w13_f.cuda(), w2_f.cuda()
    for m in (1, 7, 64, 129, 3000):
        x, w, ids = routed_inputs(m, h, e, top_k, g)
        out = layer(x, w, ids, out=poisoned(m, h, "bf16"))
        want, _, _ = moe_reference(x, w13_f, w2_f, w, ids, "silu")
        check(out, want, f"hybrid nvfp4+nf3 M={m}", "hybrid nvfp4+nf3")
        first = layer.parts[0](x, w, ids)
        second = layer.parts[1](x, w, ids, out=torch.zeros_like(first))  # the adding part, from zero
        # one output: the second part's float32 sum added to the first's rows, rounded once
        assert rel_err(out, first.float() + second.float()) <= 2.0**-8, m
    eager, out = replayed(layer, *routed_inputs(64, h, e, top_k, g))
    assert torch.equal(out, eager)
