"""Workspaces without a GPU: the pool's sharing/release rules, and that a MoeLayer call allocates nothing.

The call-path test runs the real `MoeLayer` orchestration (checks, resolution, chunking,
id narrowing, argument assembly) on CPU tensors against a stand-in bundle whose kernel
launches are recorded instead of issued, under a torch dispatch mode that records every
tensor an aten op creates.  A call with `out=` given must create none: that is what makes it
safe under CUDA-graph capture and torch.compile's "reduce-overhead" pools.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cuteaot.runtime.moe as moe
from cuteaot.runtime import workspace as workspace_mod
from cuteaot.runtime.errors import CaptureError, UnknownSpecializationError
from cuteaot.runtime.weights import prepare_w2, prepare_w13
from cuteaot.runtime.workspace import WorkspacePool
from tests.reference.nvfp4 import random_nvfp4
from tests.stub_bundle import StubLaunch, stub_bundle, stub_launches

H, I, E, TOP_K = 512, 256, 16, 4  # the tiny-fused-silu problem


# ------------------------------------------------------------------------------ the pool


def test_pool_shares_a_shape_and_frees_it_with_the_last_layer():
    pool = WorkspacePool(torch.device("cpu"))
    made = []
    alloc = lambda: made.append(object()) or made[-1]  # noqa: E731
    pool.acquire("shape-a", alloc)
    pool.acquire("shape-a", alloc)
    pool.acquire("shape-b", alloc)
    assert pool.allocations == 2 and len(pool) == 2
    s1 = pool.reserve("shape-a", 111, alloc)
    assert pool.reserve("shape-a", 111, alloc) is s1 and pool.allocations == 3
    assert pool.get("shape-a", 111) is s1
    assert pool.get("shape-a", 222) is made[0]  # an unreserved stream shares the default
    assert pool.allocations == 3  # looking up never allocates
    pool.release("shape-a")
    assert pool.get("shape-a", 111) is s1  # one layer of shape-a is still alive
    pool.release("shape-a")
    assert pool.reserved_streams("shape-a") == [] and len(pool) == 1 and pool.live_layers("shape-a") == 0
    with pytest.raises(KeyError):
        pool.get("shape-a", 111)


def test_pool_refuses_to_allocate_under_capture(monkeypatch):
    pool = WorkspacePool(torch.device("cpu"))
    pool.acquire("s", object)
    monkeypatch.setattr(workspace_mod, "capturing", lambda device: True)
    with pytest.raises(CaptureError, match=r"call layer.reserve\(streams=\[...\]\) before capturing"):
        pool.reserve("s", 7, object)
    with pytest.raises(CaptureError, match="building a MoE layer"):
        pool.acquire("other", object)
    pool.acquire("s", object)  # a second layer of an existing shape needs no memory: fine under capture
    assert pool.allocations == 1


# ------------------------------------------------------------------------------ the call path


@pytest.fixture()
def stubbed(monkeypatch):
    return stub_launches(monkeypatch)


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = prepare_w13(*random_nvfp4(E, 2 * I, H, g), "bf16")
    w2 = prepare_w2(*random_nvfp4(E, H, I, g), "bf16")
    return w13, w2


class _NewTensors(TorchDispatchMode):
    """Records every aten op whose output does not share storage with one of its inputs."""

    def __init__(self):
        super().__init__()
        self.created: list[str] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        bases = {t.untyped_storage().data_ptr() for t in inputs}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in bases:
                self.created.append(str(func))
        return out


def _inputs(m: int, ids_dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, H, generator=g).to(torch.bfloat16)
    ids = torch.rand(m, E, generator=g).topk(TOP_K, dim=1).indices.to(ids_dtype)
    w = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=1)
    return x, w, ids


@pytest.mark.parametrize("m, ids_dtype", [(1, torch.int32), (1, torch.int64), (2, torch.int64), (5, torch.int32),
                                          (37, torch.int64), (600, torch.int64), (1500, torch.int32)])
def test_a_call_creates_no_tensor(stubbed, m, ids_dtype):
    bundle = stub_bundle()
    w13, w2 = _weights()
    # M = 600: FC1 and FC2 as two grouped-GEMM launches; M = 1500 runs in chunks of 1024
    layer = moe.MoeLayer(bundle, w13, w2, top_k=TOP_K, activation="silu", max_tokens=1024)
    x, w, ids = _inputs(m, ids_dtype)
    out = torch.empty(m, H, dtype=torch.bfloat16)
    allocations = bundle.workspaces.allocations
    stubbed.clear()
    with _NewTensors() as mode:
        layer(x, w, ids, out=out)
    assert mode.created == [], f"the call created tensors: {mode.created}"
    assert bundle.workspaces.allocations == allocations
    launches = [c for c in stubbed if c[0] == "fused"]  # every kernel launch the stub recorded
    chunks = [min(layer.max_tokens, m - start) for start in range(0, m, layer.max_tokens)]
    assert len(launches) == sum(len(layer.resolve(c).launch.kernels) for c in chunks)
    if m == 600:  # two GEMM launches; FC1's gated epilogue applies silu, no activation kernel between them
        r = layer.resolve(m)
        assert r.launch.split and r.kernels["fc1"].spec.epilogue.value == "silu"
        assert not [c for c in stubbed if c[0] == "activation"]
        # FC2 reads FC1's activation and writes the route rows (or the output, where it sums them itself)
        ws = layer.workspace()
        (fc2,) = [c[2] for c in launches if c[2]["a"] == ws.activated.data_ptr()]
        assert fc2["out"] == (out if r.sums_topk else ws.fc13).data_ptr() and fc2["tokens"] == m * TOP_K
    if m <= 2:  # decode: routes straight from the ids, narrowed into the workspace when int64
        ids_ptr = launches[0][2]["route_indices"]
        ws = layer.workspace()
        assert ids_ptr == (ids.data_ptr() if ids_dtype == torch.int32 else ws.ids32.data_ptr())
        if ids_dtype == torch.int64:
            assert torch.equal(ws.ids32[: m * TOP_K].view(m, TOP_K), ids.to(torch.int32))


def test_zero_padded_gate_up_runs_the_activation_kernel_between_the_gemms(stubbed):
    """tiny-fused-swigluoai: 2I = 704 is stored as 768, so FC1 has no whole gate | up slabs and writes the
    (routes, 2I) product; the activation kernel turns it into FC2's input, inside the same call."""
    h, i, e, top_k, m = 736, 352, 8, 2, 600
    g = torch.Generator().manual_seed(3)
    w13 = prepare_w13(*random_nvfp4(e, 2 * i, h, g), "bf16")
    w2 = prepare_w2(*random_nvfp4(e, h, i, g), "bf16")
    layer = moe.MoeLayer(stub_bundle(), w13, w2, top_k=top_k, activation="swigluoai")
    r = layer.resolve(m)
    assert r.launch.split and r.activation_launch and r.kernels["fc1"].spec.epilogue.value == "none"
    x = torch.randn(m, h, generator=g).to(torch.bfloat16)
    ids = torch.rand(m, e, generator=g).topk(top_k, dim=1).indices.to(torch.int32)
    layer(x, torch.full((m, top_k), 0.5), ids, out=torch.empty(m, h, dtype=torch.bfloat16))
    assert [c for c in stubbed if c[0] == "activation"] == [("activation", (m * top_k, 2 * i))]


def test_prepared_fused_launch_passes_this_calls_pointers(stubbed):
    """The fused launch is prepared once per workspace; each call still passes its own inputs."""
    bundle = stub_bundle()
    w13, w2 = _weights()
    layer = moe.MoeLayer(bundle, w13, w2, top_k=TOP_K)
    ws = layer.workspace()
    paths = set()
    # the decode kernel twice on new tensors, routes packed by the fused kernel (this problem's only packed fused
    # plans, 16-row blocks at 3-6 tokens: above, it splits), decode again
    for m in (1, 1, 5, 1):
        x, w, ids = _inputs(m, torch.int32, seed=m + len(stubbed))
        out = torch.empty(m, H, dtype=torch.bfloat16)
        stubbed.clear()
        layer(x, w, ids, out=out)
        (values,) = [c[2] for c in stubbed if c[0] == "fused"]
        r = layer.resolve(m)
        direct = r.decode or r.packs_routes  # the kernel reads topk_ids itself
        paths.add((r.decode, r.packs_routes))
        assert values["a"] == x.data_ptr() and values["topk_weights"] == w.data_ptr() and values["tokens"] == m
        assert values["fc2_out"] == (out if r.decode else ws.fc13).data_ptr()
        assert values["route_indices"] == (ids if direct else ws.route_indices).data_ptr()
        assert values["block_experts"] == (ids if direct else ws.block_experts).data_ptr()
        assert values["w13"] == w13.qweight.data_ptr() and values["w2_scales"] == w2.scales.data_ptr()
        assert values["locks"] == ws.locks.data_ptr() and values["num_experts"] == E
    assert paths == {(True, False), (False, True)}, paths


def test_a_call_uses_its_streams_workspace_after_every_reservation(stubbed, monkeypatch):
    """A call remembers the last stream's workspace (no pool lookup when the stream repeats), and a reservation
    for a stream, or a release, is seen by the very next call on it."""
    bundle = stub_bundle()
    w13, w2 = _weights()
    layer = moe.MoeLayer(bundle, w13, w2, top_k=TOP_K)
    x, w, ids = _inputs(1, torch.int32)
    out = torch.empty(1, H, dtype=torch.bfloat16)

    def locks_on(stream: int) -> int:
        monkeypatch.setattr(moe, "current_stream_handle", lambda index: stream)
        stubbed.clear()
        layer(x, w, ids, out=out)
        (values,) = [c[2] for c in stubbed if c[0] == "fused"]
        return values["locks"]

    default = layer.workspace(0).locks.data_ptr()
    assert locks_on(7) == default and locks_on(7) == default  # no reservation: the shape's default
    reserved = bundle.workspaces.reserve(layer.shape, 7, layer._allocate_workspace)
    assert reserved.locks.data_ptr() != default
    assert locks_on(7) == reserved.locks.data_ptr()  # the next call sees the reservation
    assert locks_on(8) == default and locks_on(7) == reserved.locks.data_ptr()
    lookups = []
    monkeypatch.setattr(type(bundle.workspaces), "get", lambda pool, shape, stream: lookups.append(stream))
    locks_on(7)
    assert lookups == []  # the same stream again: the remembered workspace


def test_prepared_launch_names_every_parameter_once(monkeypatch):
    from cuteaot.runtime.errors import LaunchArgumentError

    names = StubLaunch._signature.names
    kernel = StubLaunch(None, "d")
    with pytest.raises(LaunchArgumentError, match="missing"):
        kernel.prepare(("a",), **dict.fromkeys(names[2:], 0))
    with pytest.raises(LaunchArgumentError, match="named twice: \\['a'\\]"):
        kernel.prepare(("a",), **dict.fromkeys(names, 0))
    prepared = kernel.prepare(("tokens", "a"), **{n: 100 + i for i, n in enumerate(names) if n not in ("a", "tokens")})
    with pytest.raises(LaunchArgumentError, match="takes 2 values, got 1"):  # one value per variable
        prepared.launch(1, 0, 5)
    calls = []
    monkeypatch.setattr(StubLaunch, "calls", calls)
    prepared.launch(1, 0, 5, 6)  # the variables land in their declared slots, the constants around them
    assert calls[0][2] == {n: 6 if n == "a" else 5 if n == "tokens" else 100 + i for i, n in enumerate(names)}


def test_int64_ids_out_of_int32_range_stay_dropped(stubbed):
    bundle = stub_bundle()
    layer = moe.MoeLayer(bundle, *_weights(), top_k=TOP_K)
    x, w, ids = _inputs(1, torch.int64)
    ids[0, 0], ids[0, 1] = 2**32 + 3, -(2**40)  # would wrap to the valid ids 3 and 0 if narrowed blindly
    layer(x, w, ids, out=torch.empty(1, H, dtype=torch.bfloat16))
    narrowed = layer.workspace().ids32[:TOP_K].tolist()
    assert narrowed[:2] == [E, -1] and narrowed[2:] == ids[0, 2:].tolist()


def test_layers_of_one_shape_share_and_release_their_workspace(stubbed):
    bundle = stub_bundle()
    w13, w2 = _weights()
    layers = [moe.MoeLayer(bundle, w13, w2, top_k=TOP_K) for _ in range(5)]
    assert bundle.workspaces.allocations == 1
    assert len({id(layer.workspace()) for layer in layers}) == 1
    other = moe.MoeLayer(bundle, w13, w2, top_k=TOP_K, max_tokens=16)  # another capacity: another shape
    assert bundle.workspaces.allocations == 2
    del layers, other
    gc.collect()
    assert len(bundle.workspaces) == 0


def test_functional_layers_live_and_die_with_their_weights(stubbed):
    bundle = stub_bundle()
    w13, w2 = _weights()
    x, w, ids = _inputs(5, torch.int32)
    for _ in range(3):
        moe.run_w4a16_moe(bundle, x, w13, w2, w, ids, out=torch.empty(5, H, dtype=torch.bfloat16))
    assert bundle.workspaces.allocations == 1 and len(w13.functional_layers) == 1
    del w13, w2
    gc.collect()
    assert len(bundle.workspaces) == 0, "the functional layer kept its weights and workspace alive"


def test_deterministic_layers_never_take_the_decode_path(stubbed):
    bundle = stub_bundle()
    layer = moe.MoeLayer(bundle, *_weights(), top_k=TOP_K, deterministic=True)
    assert not any(layer.resolve(m).decode for m in (1, 2))
    assert moe.MoeLayer(bundle, *_weights(), top_k=TOP_K).resolve(1).decode


def test_options_the_bundle_cannot_serve_fail_at_construction(stubbed):
    bundle = stub_bundle()
    w13, w2 = _weights()
    moe.MoeLayer(bundle, w13, w2, top_k=TOP_K, router_weight_on_input=True)  # tiny-fused builds this variant
    with pytest.raises(UnknownSpecializationError, match=r"(?s)swiglu_limit=5.0.*differs in \{'swiglu_limit': None\}"):
        moe.MoeLayer(bundle, w13, w2, top_k=TOP_K, swiglu_limit=5.0)  # a valid option the bundle has no kernel for


def test_a_bound_call_refuses_a_workspace_reserved_for_its_stream_after_bind(stubbed):
    """A call bound on stream 7 addresses the workspace stream 7 used then (the shape's default, shared with
    other streams); once reserve() gives stream 7 its own, the bound call refuses instead of racing them.
    (The launches themselves are left out: the check comes before them.)"""
    from cuteaot.runtime.errors import BadInputError

    bundle = stub_bundle()
    layer = moe.MoeLayer(bundle, *_weights(), top_k=TOP_K)
    x, w, ids = _inputs(3, torch.int32)
    out = torch.empty(3, H, dtype=torch.bfloat16)
    call = moe.BoundMoeCall(layer, (), 7, (x, w, ids, out), layer.workspace(7))
    assert call() is out
    other = moe.MoeLayer(bundle, *_weights(1), top_k=TOP_K, max_tokens=16)  # another shape: a new workspace
    assert call() is out  # the pool's generation moved, but not stream 7's workspace: still served
    bundle.workspaces.reserve(layer.shape, 7, layer._allocate_workspace)
    with pytest.raises(BadInputError, match="this stream's workspace changed since bind"):
        call()
    assert moe.BoundMoeCall(layer, (), 7, (x, w, ids, out), layer.workspace(7))() is out  # bound again
    x.resize_(0)  # a bound buffer resized: the launches' memory stays alive with the call
    assert call.storages[0].nbytes() == 3 * H * 2
    del other


def test_a_functional_layer_is_rebuilt_not_piled_up_for_a_new_expert_map(stubbed):
    bundle = stub_bundle()
    w13, w2 = _weights()
    x, w, ids = _inputs(5, torch.int32)
    for _ in range(3):
        expert_map = torch.arange(E, dtype=torch.int32)  # a new tensor each call (e.g. .to(device) per step)
        moe.run_w4a16_moe(bundle, x, w13, w2, w, ids, expert_map=expert_map,
                          out=torch.empty(5, H, dtype=torch.bfloat16))
        (layer,) = [entry[1] for entry in w13.functional_layers.values()]
        assert layer.expert_map is expert_map
    gc.collect()
    assert bundle.workspaces.live_layers(layer.shape) == 1  # the replaced layers are gone


def test_reserving_streams_declares_the_bundles_layers_concurrent(stubbed):
    """reserve() gives each stream its own workspace and marks the bundle concurrent, so that its kernels
    whose CTAs wait on each other launch as cooperative grids from then on (runtime/bundle.py); streams of
    another device or non-streams are refused before anything is reserved or marked."""
    from cuteaot.runtime.errors import BadInputError

    class FakeStream(torch.cuda.Stream):  # a torch.cuda.Stream without a GPU: only what reserve() reads
        def __new__(cls, handle, device):
            return object.__new__(cls)

        def __init__(self, handle, device):
            self._handle, self._device = handle, torch.device(device)

        cuda_stream = property(lambda self: self._handle)
        device = property(lambda self: self._device)

    bundle = stub_bundle()
    layer = moe.MoeLayer(bundle, *_weights(), top_k=TOP_K)
    assert bundle.launch_state.concurrent is False
    with pytest.raises(BadInputError, match="reserve takes torch.cuda.Stream objects"):
        layer.reserve([FakeStream(11, "cpu"), "not a stream"])
    with pytest.raises(BadInputError, match="the layer on cpu"):
        layer.reserve([FakeStream(12, "meta")])
    layer.reserve([])
    assert bundle.launch_state.concurrent is False and bundle.workspaces.get(layer.shape, 11) is layer.workspace(0)
    layer.reserve([FakeStream(11, "cpu"), FakeStream(12, "cpu")])
    assert bundle.launch_state.concurrent is True
    assert bundle.workspaces.get(layer.shape, 11) is not bundle.workspaces.get(layer.shape, 12)
