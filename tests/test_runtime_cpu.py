"""Runtime pieces that need no GPU: argument checks, fake ops, device profile matching."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cuteaot.runtime  # noqa: F401  (registers the torch ops)
from cuteaot.runtime import PROFILES, BadInputError
from cuteaot.runtime.devices import match_profile
from cuteaot.runtime.kernels import ActivationSpec, TopKSumSpec
from cuteaot.runtime.kernels.activation import spec_for_call
from cuteaot.runtime.kernels.w4a16.gemm import GemmRoutes, _check_routes
from cuteaot.runtime.resolution import Launch
from cuteaot.runtime.tensors import check_tensor


def test_activation_spec_validation_messages():
    with pytest.raises(BadInputError, match="multiple of 8"):
        ActivationSpec.create("silu", "bf16", 100)
    with pytest.raises(BadInputError, match="swigluoai only"):
        ActivationSpec.create("silu", "bf16", 128, swiglu_alpha=1.0)
    with pytest.raises(BadInputError, match="not relu2"):
        ActivationSpec.create("relu2", "bf16", 128, swiglu_limit=1.0)
    with pytest.raises(BadInputError, match="positive finite"):
        ActivationSpec.create("silu", "bf16", 128, swiglu_limit=-1.0)
    with pytest.raises(BadInputError, match="one of"):
        ActivationSpec.create("gelu", "bf16", 128)
    with pytest.raises(BadInputError, match=r"top_k must be an int in \[1, 32\]"):
        TopKSumSpec("bf16", 33, 256)


def test_call_spec_checks_dtype_and_halves():
    with pytest.raises(BadInputError, match="bfloat16 or float16"):
        spec_for_call(torch.float32, 256, "silu", True, None, None, None)
    with pytest.raises(BadInputError, match="halves"):
        spec_for_call(torch.bfloat16, 251, "silu", True, None, None, None)
    assert spec_for_call(torch.float16, 256, "relu2", True, None, None, None).intermediate_size == 256


def test_check_tensor_messages():
    cpu = torch.device("cpu")
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    check_tensor(x, "x", dtype=torch.bfloat16, shape=(4, 8), device=cpu)
    with pytest.raises(BadInputError, match="dtype"):
        check_tensor(x, "x", dtype=torch.float16, shape=(4, 8), device=cpu)
    with pytest.raises(BadInputError, match="shape"):
        check_tensor(x, "x", dtype=torch.bfloat16, shape=(4, 9), device=cpu)
    with pytest.raises(BadInputError, match="contiguous"):
        check_tensor(x.t(), "x", dtype=torch.bfloat16, shape=(8, 4), device=cpu)
    with pytest.raises(BadInputError, match="aligned"):
        check_tensor(torch.zeros(33, dtype=torch.bfloat16)[1:].view(4, 8), "x", dtype=torch.bfloat16,
                     shape=(4, 8), device=cpu)
    with pytest.raises(BadInputError, match="torch.Tensor"):
        check_tensor([1, 2], "x", dtype=torch.bfloat16, shape=(2,), device=cpu)


def test_fake_ops_check_shapes_without_a_gpu():
    with FakeTensorMode():
        x = torch.empty(7, 256, dtype=torch.bfloat16)
        out = torch.empty(7, 128, dtype=torch.bfloat16)
        torch.ops.cuteaot.moe_activation(x, out, "no-bundle-needed", "silu", True, None, None, None)
        with pytest.raises(BadInputError, match="shape"):
            torch.ops.cuteaot.moe_activation(x, torch.empty(7, 256, dtype=torch.bfloat16), "b", "silu", True,
                                             None, None, None)
        fc2 = torch.empty(7, 4, 384, dtype=torch.float16)
        torch.ops.cuteaot.moe_topk_sum(fc2, torch.empty(7, 384, dtype=torch.float16), "b")
        with pytest.raises(BadInputError, match="dtype"):
            torch.ops.cuteaot.moe_topk_sum(fc2, torch.empty(7, 384, dtype=torch.bfloat16), "b")


def test_custom_ops_are_registered_with_mutation_schema():
    import re

    for op in (torch.ops.cuteaot.moe_activation, torch.ops.cuteaot.moe_topk_sum):
        schema = str(op.default._schema)
        assert re.search(r"Tensor\(a\d*!\) out", schema) and "str bundle_id" in schema, schema


def test_profile_matching():
    targets = [PROFILES["h200"], PROFILES["rtx-pro-6000"]]
    assert match_profile(targets, name="NVIDIA H200", capability=(9, 0), sm_count=132).name == "h200"
    # an H100 SXM has the H200's planning facts: the h200 kernels serve it
    assert match_profile(targets, name="NVIDIA H100 80GB HBM3", capability=(9, 0), sm_count=132).name == "h200"
    # a different SM count (e.g. H100 PCIe, 114 SMs) changes persistent grids: refused
    assert match_profile(targets, name="NVIDIA H100 PCIe", capability=(9, 0), sm_count=114) is None
    assert match_profile(targets, name="NVIDIA B200", capability=(10, 0), sm_count=148) is None


def test_gemm_routes_are_checked_against_the_gemm_launch():
    """routes= must come from pack_gemm_routes on these ids, for these experts and this launch's block."""
    ids = torch.zeros(64, 8, dtype=torch.int32)
    plan = Launch(m_min=33, m_max=100, grid_x=264, route_block=32, kernels={"x": "0" * 64})
    assert not plan.direct
    empty = torch.empty(0, dtype=torch.int32)

    def routes(**kw):
        fields = dict(ids_ptr=ids.data_ptr(), shape=(64, 8), num_experts=128, block_size=plan.route_block,
                      route_indices=empty, block_experts=empty, route_count=empty)
        return GemmRoutes(**{**fields, **kw})

    _check_routes(routes(), ids, 128, plan)  # accepted
    with pytest.raises(BadInputError, match="must come from pack_gemm_routes"):
        _check_routes((empty, empty, empty), ids, 128, plan)
    with pytest.raises(BadInputError, match="another topk_ids"):
        _check_routes(routes(), ids.clone(), 128, plan)
    with pytest.raises(BadInputError, match="packed for 64 experts, the weights have 128"):
        _check_routes(routes(num_experts=64), ids, 128, plan)
    with pytest.raises(BadInputError, match=f"block size direct, this GEMM's launch at M=64 uses {plan.route_block}"):
        _check_routes(routes(block_size=0), ids, 128, plan)


# ---- out-of-range expert ids (dropped on the device) ---------------------------------------------


def test_int64_direct_route_ids_cannot_wrap_into_valid_experts():
    from cuteaot.runtime.kernels.route_pack import direct_route_ids

    ids = torch.tensor([[(1 << 32) + 3, -(1 << 40), 5, -1], [8, 100000, 0, 7]], dtype=torch.int64)
    got = direct_route_ids(ids, 8)
    assert got.dtype == torch.int32
    # valid ids unchanged; every other id stays outside [0, 8) (a plain cast maps 2^32 + 3 to expert 3)
    assert got.tolist() == [[8, -1, 5, -1], [8, 8, 0, 7]]


def test_masked_topk_sum_spec_and_arguments():
    from cuteaot.runtime import moe_topk_sum
    from cuteaot.runtime.kernels.topk_sum import spec_for_call

    plain, masked = TopKSumSpec("bf16", 4, 512), TopKSumSpec("bf16", 4, 512, "int64")
    assert "ids_dtype" not in plain.key().facts and masked.key().facts["ids_dtype"] == "int64"
    assert TopKSumSpec.from_facts(masked.key().facts) == masked
    assert masked.key() != TopKSumSpec("bf16", 4, 512, "int32").key()
    assert [p.name for p in masked.SIGNATURE.params] == ["fc2", "out", "tokens", "topk_ids", "num_experts"]
    assert masked.SIGNATURE.params[:3] == plain.SIGNATURE.params
    adding = TopKSumSpec("bf16", 4, 512, "int64", True)  # out += the sum: same parameters, own kernel
    assert "accumulate" not in masked.key().facts and adding.key().facts["accumulate"] is True
    assert adding.key() != masked.key() and adding.SIGNATURE == masked.SIGNATURE
    with pytest.raises(BadInputError, match="accumulate must be None or True"):
        TopKSumSpec("bf16", 4, 512, "int64", False)
    fc2 = torch.empty(3, 4, 512, dtype=torch.bfloat16)
    assert spec_for_call(fc2, torch.zeros(3, 4, dtype=torch.int32)).ids_dtype.value == "int32"
    with pytest.raises(BadInputError, match="topk_ids must be int32 or int64"):
        spec_for_call(fc2, torch.zeros(3, 4, dtype=torch.int16))
    with pytest.raises(BadInputError, match="topk_ids and num_experts go together"):
        moe_topk_sum(None, fc2, topk_ids=torch.zeros(3, 4, dtype=torch.int32))
    with FakeTensorMode():
        fc2 = torch.empty(7, 4, 384, dtype=torch.float16)
        out = torch.empty(7, 384, dtype=torch.float16)
        torch.ops.cuteaot.moe_topk_sum(fc2, out, "b", torch.empty(7, 4, dtype=torch.int64), 16)
        with pytest.raises(BadInputError, match=r"topk_ids must have shape \(7, 4\)"):
            torch.ops.cuteaot.moe_topk_sum(fc2, out, "b", torch.empty(7, 3, dtype=torch.int32), 16)


class _StubDriver:
    """Stands in for cuda.bindings.driver: records what each cuLaunchKernel would read."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self, signature):
        self.signature = signature
        self.launches = []

    def cuCtxGetCurrent(self):  # noqa: N802 -- the driver's name
        return (0, 1)  # a context is current

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):  # noqa: N802
        import ctypes

        slots = (ctypes.c_void_p * len(self.signature.params)).from_address(params)
        self.launches.append({p.name: p.kind.ctype.from_address(slots[i]).value
                              for i, p in enumerate(self.signature.params)})
        return (0,)


def _kernel_on_stub_driver(monkeypatch, sig):
    """(driver stub, LoadedKernel of `sig`) with cuda.bindings' driver replaced by the stub."""
    from types import SimpleNamespace

    from cuteaot.runtime import bundle as bundle_module

    stub = _StubDriver(sig)
    monkeypatch.setattr(bundle_module, "driver", stub)
    record = SimpleNamespace(block=(128, 1, 1), dynamic_smem_bytes=0, params=sig.to_json(), symbol="k", key=None,
                             waits_for_prior_grids=False)
    kernel = bundle_module.LoadedKernel(record, function=object(), context=1)
    kernel.bind(sig)
    return stub, kernel


def test_a_failed_launch_under_another_devices_context_says_so(monkeypatch):
    """A launch the driver refuses raises LaunchError; where another context than the kernel's is current (a
    process driving two GPUs, the other device current), the message says which device to make current."""
    from cuteaot.runtime.errors import LaunchError
    from cuteaot.runtime.kernels import GemmSpec

    sig = GemmSpec.SIGNATURE
    stub, kernel = _kernel_on_stub_driver(monkeypatch, sig)
    stub.cuGetErrorName = lambda err: (0, b"CUDA_ERROR_INVALID_HANDLE")
    stub.cuLaunchKernel = lambda *args: (400,)
    with pytest.raises(LaunchError, match=r"INVALID_HANDLE$"):  # the kernel's own context is current: no hint
        kernel.launch(3, 0, **_distinct_values(sig))
    stub.cuCtxGetCurrent = lambda: (0, 2)
    with pytest.raises(LaunchError, match=r"INVALID_HANDLE; another device's CUDA context is current.*torch\.cuda\.device"):
        kernel.launch(3, 0, **_distinct_values(sig))


def _distinct_values(sig) -> dict:
    """A value per parameter, no two alike: pointers 0x1000 apart, ints counting from 1."""
    return {p.name: 0x1000 * (i + 1) if p.kind.value == "ptr" else i + 1 for i, p in enumerate(sig.params)}


def test_launch_packs_arguments_into_their_declared_slots_by_name(monkeypatch):
    """A launch names its arguments: whatever the call order, each value lands in its parameter's slot."""
    from cuteaot.runtime.errors import LaunchArgumentError
    from cuteaot.runtime.kernels import GemmSpec

    sig = GemmSpec.SIGNATURE
    stub, kernel = _kernel_on_stub_driver(monkeypatch, sig)
    values = _distinct_values(sig)
    kernel.launch(3, 0, **dict(reversed(list(values.items()))))  # names in the opposite order
    assert stub.launches == [values]
    swapped = {**values, "qweight": values["scales"], "scales": values["qweight"]}
    kernel.launch(3, 0, **swapped)
    assert stub.launches[-1]["qweight"] == values["scales"]  # a swap by name is a swap of values, not of slots
    with pytest.raises(LaunchArgumentError, match=r"missing \['num_experts'\], not declared \['experts'\]"):
        kernel.launch(3, 0, **{**{k: v for k, v in values.items() if k != "num_experts"}, "experts": 4})
    assert len(stub.launches) == 2  # nothing launched with a missing argument


def test_prepared_launch_stores_its_variables_where_the_driver_reads_them(monkeypatch):
    """A prepared launch packs its constants once per thread and stores only the variables per call: what
    cuLaunchKernel reads through the `void**` is every parameter's value, call after call, each thread its
    own buffer; a value its parameter cannot hold is refused before anything is launched."""
    import threading

    from cuteaot.runtime.errors import LaunchArgumentError
    from cuteaot.runtime.kernels import FusedSpec

    sig = FusedSpec.SIGNATURE
    stub, kernel = _kernel_on_stub_driver(monkeypatch, sig)
    variables = ("tokens", "a", "layer", "fc2_out")  # not in declaration order; ints and pointers
    constants = {name: v for name, v in _distinct_values(sig).items() if name not in variables}
    prepared = kernel.prepare(variables, **constants)

    def expected(tokens, a, layer, fc2_out):
        return {**constants, "tokens": tokens, "a": a, "layer": layer, "fc2_out": fc2_out}

    prepared.launch(5, 0, 7, 0xA000, 3, 0xB000)
    prepared.launch(5, 0, 9, 0xC000, 0, 0xD000)
    assert stub.launches == [expected(7, 0xA000, 3, 0xB000), expected(9, 0xC000, 0, 0xD000)]
    other = threading.Thread(target=prepared.launch, args=(5, 0, 1, 0xE000, 2, 0xF000))
    other.start()
    other.join()
    prepared.launch(5, 0, 4, 0x1000, 1, 0x2000)
    assert stub.launches[2:] == [expected(1, 0xE000, 2, 0xF000), expected(4, 0x1000, 1, 0x2000)]
    for bad in ((1, -16, 0, 0xB000), (2**31, 0xA000, 0, 0xB000), (1.5, 0xA000, 0, 0xB000)):
        with pytest.raises(LaunchArgumentError, match="do not fit the parameters"):
            prepared.launch(5, 0, *bad)
    with pytest.raises(LaunchArgumentError, match="takes 4 values, got 3"):
        prepared.launch(5, 0, 1, 2, 3)
    assert len(stub.launches) == 4  # nothing launched with a bad value


def test_a_bound_call_records_launches_and_replays_them_with_the_same_arguments(monkeypatch):
    """MoeLayer.bind records a call's launches (issuing none) and replays them pre-packed."""
    import types

    from cuteaot.runtime import bundle as bundle_mod
    from cuteaot.runtime.abi import Signature, i32, ptr
    from cuteaot.runtime.bundle import LoadedKernel, recording_launches

    signature = Signature((ptr("src", "elem", "(rows, w)"), ptr("out", "elem", "(rows, w)"), i32("rows", "rows")))
    record = types.SimpleNamespace(block=(128, 1, 1), dynamic_smem_bytes=0, params=signature.to_json(),
                                   symbol="k", key=None, waits_for_prior_grids=False)
    kernel = LoadedKernel(record, function="fn", context=None)
    kernel.bind(signature)
    issued = []
    monkeypatch.setattr(bundle_mod.driver, "cuLaunchKernel",
                        lambda fn, gx, gy, gz, bx, by, bz, smem, stream, args, extra:
                        issued.append((fn, gx, stream, ctypes.string_at(args, 8))) or (0,))
    monkeypatch.setattr(bundle_mod, "check_cu", lambda result, what: None)
    kernel._tls.buf = bundle_mod.ArgBuffer(signature)  # as after a first launch on this thread
    with recording_launches() as launches:
        kernel.launch(7, 99, src=0x1000, out=0x2000, rows=5)
    assert issued == [] and len(launches) == 1  # recorded, not launched
    with pytest.raises(Exception, match="do not nest"):
        with recording_launches():
            with recording_launches():
                pass
    launches[0].launch(99)
    kernel.launch(7, 99, src=0x1000, out=0x2000, rows=5)  # a plain launch packs the same arguments
    assert issued[0][:3] == issued[1][:3] == ("fn", 7, 99)
    replay, plain = launches[0].buffer, kernel._tls.buf
    assert ctypes.string_at(ctypes.addressof(replay._buffer), 20) == ctypes.string_at(ctypes.addressof(plain._buffer), 20)


def test_kernels_that_wait_for_prior_grids_launch_programmatically(monkeypatch):
    """A kernel whose record says its PTX waits for the grids before it is launched with programmatic
    stream serialization (cuLaunchKernelEx), plainly once that is switched off; a kernel of an older
    bundle (no such record field) always plainly.  A bound call replays the same way."""
    import types

    from cuteaot.runtime import bundle as bundle_mod
    from cuteaot.runtime.abi import Signature, i32, ptr
    from cuteaot.runtime.bundle import LoadedKernel, recording_launches, set_programmatic_launch

    signature = Signature((ptr("src", "elem", "(rows, w)"), i32("rows", "rows")))
    issued = []
    monkeypatch.setattr(bundle_mod.driver, "cuLaunchKernel",
                        lambda fn, gx, gy, gz, bx, by, bz, smem, stream, args, extra:
                        issued.append(("plain", fn, gx, bx, smem, stream)) or (0,))

    def launch_ex(config, fn, args, extra):
        (attribute,) = config.attrs[: config.numAttrs]
        assert attribute.id == bundle_mod.driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        assert attribute.value.programmaticStreamSerializationAllowed == 1
        issued.append(("pdl", fn, config.gridDimX, config.blockDimX, config.sharedMemBytes, int(config.hStream)))
        return (0,)

    monkeypatch.setattr(bundle_mod.driver, "cuLaunchKernelEx", launch_ex)
    kernels = {}
    for waits in (True, False):
        record = types.SimpleNamespace(block=(128, 1, 1), dynamic_smem_bytes=4096, params=signature.to_json(),
                                       symbol="k", key=None, waits_for_prior_grids=waits)
        kernels[waits] = LoadedKernel(record, function=f"fn{waits}", context=None)
        kernels[waits].bind(signature)
        kernels[waits]._tls.buf = bundle_mod.ArgBuffer(signature)
    previous = set_programmatic_launch(True)
    try:
        kernels[True].launch(7, 99, src=0x1000, rows=5)
        kernels[False].launch(7, 99, src=0x1000, rows=5)
        with recording_launches() as launches:
            kernels[True].launch(3, 99, src=0x1000, rows=5)
        launches[0].launch(42)
        launches[0].launch(42)
        kernels[True].launch(7, 99, src=0x1000, rows=5)  # the launch configuration follows each call's grid and stream
        assert issued == [("pdl", "fnTrue", 7, 128, 4096, 99), ("plain", "fnFalse", 7, 128, 4096, 99),
                          ("pdl", "fnTrue", 3, 128, 4096, 42), ("pdl", "fnTrue", 3, 128, 4096, 42),
                          ("pdl", "fnTrue", 7, 128, 4096, 99)]
        assert set_programmatic_launch(False) is True
        kernels[True].launch(5, 99, src=0x1000, rows=5)
        launches[0].launch(42)
        assert issued[5:] == [("plain", "fnTrue", 5, 128, 4096, 99), ("plain", "fnTrue", 3, 128, 4096, 42)]
    finally:
        set_programmatic_launch(previous)



def test_kernels_whose_ctas_wait_on_each_other_launch_cooperatively_once_layers_run_concurrently(monkeypatch):
    """A kernel whose CTAs wait on each other (grid barriers, split-K turns) launches plainly until its
    bundle's layers reserved streams (concurrent calls: two such grids could each start in part and
    hang), then as a cooperative grid, beside the programmatic attribute where its PTX also waits for
    prior grids; set_cooperative_launch(True / False) decides for every launch, None restores the default.
    Table kernels and the multi-CTA route packing are marked, nothing else."""
    import types

    from cuteaot.runtime import bundle as bundle_mod
    from cuteaot.runtime.abi import Signature, i32, ptr
    from cuteaot.runtime.bundle import LaunchState, LoadedKernel, set_cooperative_launch, set_programmatic_launch

    ids = bundle_mod.driver.CUlaunchAttributeID
    signature = Signature((ptr("src", "elem", "(rows, w)"), i32("rows", "rows")))
    issued = []
    monkeypatch.setattr(bundle_mod.driver, "cuLaunchKernel",
                        lambda fn, gx, gy, gz, bx, by, bz, smem, stream, args, extra:
                        issued.append((fn, "plain", gx)) or (0,))

    def launch_ex(config, fn, args, extra):
        names = []
        for attribute in config.attrs[: config.numAttrs]:
            if attribute.id == ids.CU_LAUNCH_ATTRIBUTE_COOPERATIVE:
                assert attribute.value.cooperative == 1
                names.append("coop")
            else:
                assert attribute.id == ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                names.append("pdl")
        issued.append((fn, "+".join(names), config.gridDimX))
        return (0,)

    monkeypatch.setattr(bundle_mod.driver, "cuLaunchKernelEx", launch_ex)
    state = LaunchState()
    kernels = []
    for waits, on_grid in ((True, True), (False, True), (False, False)):
        record = types.SimpleNamespace(block=(128, 1, 1), dynamic_smem_bytes=0, params=signature.to_json(),
                                       symbol="k", key=None, waits_for_prior_grids=waits)
        kernel = LoadedKernel(record, function=f"fn{int(waits)}{int(on_grid)}", context=None, state=state)
        assert kernel.waits_on_grid is False  # only the family that knows its CTAs wait marks it
        if on_grid:
            kernel.mark_waits_on_grid()
        kernel.bind(signature)
        kernel._tls.buf = bundle_mod.ArgBuffer(signature)
        kernels.append(kernel)

    def launch_all(grid):
        for kernel in kernels:
            kernel.launch(grid, 99, src=0x1000, rows=5)
        return issued[-3:]

    previous = set_programmatic_launch(True), set_cooperative_launch(None)
    try:
        assert launch_all(7) == [("fn11", "pdl", 7), ("fn01", "plain", 7), ("fn00", "plain", 7)]
        state.concurrent = True  # what MoeLayer.reserve sets on its bundle
        assert launch_all(8) == [("fn11", "pdl+coop", 8), ("fn01", "coop", 8), ("fn00", "plain", 8)]
        assert set_cooperative_launch(False) is None
        assert launch_all(9) == [("fn11", "pdl", 9), ("fn01", "plain", 9), ("fn00", "plain", 9)]
        state.concurrent = False
        set_cooperative_launch(True)
        assert launch_all(10) == [("fn11", "pdl+coop", 10), ("fn01", "coop", 10), ("fn00", "plain", 10)]
        kernels[1].launch(10, 77, src=0x1000, rows=5)  # another stream: the cached configuration follows it
        assert issued[-1] == ("fn01", "coop", 10) and int(kernels[1]._tls.configs[2][0].hStream) == 77
        for bad in ("yes", 1, 0.0):
            with pytest.raises(BadInputError, match="takes True, False or None"):
                set_cooperative_launch(bad)
    finally:
        set_programmatic_launch(previous[0])
        set_cooperative_launch(previous[1])


def test_prepared_topk_sum_launches_what_moe_topk_sum_launches(monkeypatch):
    """MoeLayer's per-step top-k sum passes moe_topk_sum's grid and values (fc2, out, tokens, ids, E)."""
    from types import SimpleNamespace

    import cuteaot.runtime.kernels.rowwise as rowwise
    from cuteaot.runtime import moe_topk_sum
    from cuteaot.runtime.kernels.topk_sum import PreparedTopkSum
    from cuteaot.runtime.plans import BundlePlans
    from tests.stub_bundle import RecordingKernel

    issued: list = []
    bundle = SimpleNamespace(device=torch.device("cpu"), device_index=-1, plans=BundlePlans(),
                             kernel=lambda key: RecordingKernel(issued, block=(256, 1, 1)))
    monkeypatch.setattr(rowwise, "current_stream_handle", lambda index: 0)
    fc2 = torch.empty(37, 4, 512, dtype=torch.bfloat16)
    out = torch.empty(37, 512, dtype=torch.bfloat16)
    ids = torch.zeros(37, 4, dtype=torch.int64)
    moe_topk_sum(bundle, fc2, out, topk_ids=ids, num_experts=16)
    PreparedTopkSum(bundle, fc2, out, ids, 16)(out, ids, stream=0)
    assert len(issued) == 2 and issued[0] == issued[1]
    with pytest.raises(BadInputError, match=r"topk_ids must have shape \(37, 4\)"):
        PreparedTopkSum(bundle, fc2, out, ids[:, :3].contiguous(), 16)
    with pytest.raises(BadInputError, match=r"num_experts must be an int in \[1, .*got True"):
        moe_topk_sum(bundle, fc2, out, topk_ids=ids, num_experts=True)  # a bool is not a count
    assert len(issued) == 2


def _stub_gemm_calls(monkeypatch, stream: int):
    """tiny-gemm's stub bundle, with w4a16_moe_gemm's launches recorded (StubLaunch.calls) on raw stream `stream`
    and its route packing replaced by fixed tables."""
    import cuteaot.runtime.kernels.w4a16.gemm as gemm_mod
    from cuteaot.runtime.kernels.w4a16.gemm import GemmRoutes
    from tests.stub_bundle import ROOT, StubLaunch, stub_bundle

    monkeypatch.setattr(gemm_mod, "persistent_launch", StubLaunch)
    monkeypatch.setattr(gemm_mod, "current_stream_handle", lambda index: stream)
    words = torch.zeros(64, dtype=torch.int32)
    monkeypatch.setattr(gemm_mod, "_routes", lambda bundle, launch, ids, e, ws: GemmRoutes(
        ids.data_ptr(), tuple(ids.shape), e, launch.route_block, words, words, words[:1]))
    return stub_bundle(ROOT / "specs" / "tiny-gemm.yaml")


def test_the_standalone_gemm_tells_weight_layouts_apart_and_refuses_biases(monkeypatch):
    """A GEMM plan cached for packed NVFP4 weights is not reused for NF3 or stored weights of the same shape
    (their bytes are laid out otherwise: the packed kernel would read past them); biased weights are refused
    (the standalone GEMMs add none).  tiny-gemm-silu's FC1: N = 2I = 512, K = H = 512, 8 experts, top-2."""
    from cuteaot.runtime import BadInputError, UnknownSpecializationError, w4a16_moe_gemm
    from cuteaot.runtime.kernels.w4a16.gemm import GemmWorkspace
    from cuteaot.runtime.modelopt import prepare_w13_modelopt
    from cuteaot.runtime.nf3 import prepare_w13_nf3
    from cuteaot.runtime.weights import prepare_w13
    from tests.reference.nf3 import random_nf3
    from tests.reference.nvfp4 import random_nvfp4
    from tests.stub_bundle import StubLaunch

    bundle = _stub_gemm_calls(monkeypatch, stream=0)
    g = torch.Generator().manual_seed(3)
    tensors = random_nvfp4(8, 512, 512, g)
    packed = prepare_w13(*tensors, "bf16")
    a, ids = torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int32)
    workspace = GemmWorkspace.for_tokens(bundle, 1, 2, packed)
    StubLaunch.calls.clear()
    w4a16_moe_gemm(bundle, a, packed, ids, workspace=workspace)
    assert [c[0] for c in StubLaunch.calls] == ["fused"]  # the GEMM launched (the stub records every kernel so)
    for other in (prepare_w13_modelopt(*tensors, "bf16"), prepare_w13_nf3(*random_nf3(8, 512, 512, g))):
        with pytest.raises(UnknownSpecializationError):  # the bundle has no GEMM of that layout
            w4a16_moe_gemm(bundle, a, other, ids, workspace=workspace)
    biased = prepare_w13(*tensors, "bf16", bias=torch.zeros(8, 512))
    with pytest.raises(BadInputError, match="w4a16_moe_gemm adds no bias"):
        w4a16_moe_gemm(bundle, a, biased, ids, workspace=workspace)


def test_an_implicit_gemm_workspace_a_graph_captured_outlives_its_replacement(monkeypatch):
    """w4a16_moe_gemm without workspace= grows the stream's own workspace for a larger M; one a CUDA graph
    launched on is kept (the graph replays on its addresses), not freed."""
    from cuteaot.runtime import w4a16_moe_gemm
    from cuteaot.runtime.weights import prepare_w13
    from tests.reference.nvfp4 import random_nvfp4

    bundle = _stub_gemm_calls(monkeypatch, stream=5)
    w13 = prepare_w13(*random_nvfp4(8, 512, 512, torch.Generator().manual_seed(4)), "bf16")

    from cuteaot.runtime.kernels.w4a16 import gemm as gemm_module

    def call(m: int, capturing: bool):
        # what capturing(bundle.device) says of the bundle's device (a CPU stub here)
        monkeypatch.setattr(gemm_module, "capturing_on", lambda device: capturing)
        w4a16_moe_gemm(bundle, torch.zeros(m, 512, dtype=torch.bfloat16), w13, torch.zeros(m, 2, dtype=torch.int32))
        return bundle.gemm_workspaces[5]

    first = call(1, False)
    assert call(1, True) is first and first.captured  # captured on it
    grown = call(4096, False)
    assert grown is not first and bundle.captured_gemm_workspaces == [first]
    assert call(4096, False) is grown and not grown.captured


def test_a_gemm_workspace_for_some_tokens_fits_every_smaller_call():
    """GemmWorkspace.for_tokens(max_tokens) serves every M <= max_tokens, including one whose launch range runs
    past max_tokens (the launch's recorded route tables are its range's largest M's: tiny-gemm's direct
    launch covers M = 1-4, and a workspace for 1 token was refused for M = 1)."""
    from cuteaot.runtime.kernels.w4a16.gemm import GemmWorkspace, gemm_entry
    from cuteaot.runtime.weights import prepare_w13
    from tests.reference.nvfp4 import random_nvfp4
    from tests.stub_bundle import ROOT, stub_bundle

    bundle = stub_bundle(ROOT / "specs" / "tiny-gemm.yaml")
    w13 = prepare_w13(*random_nvfp4(8, 512, 512, torch.Generator().manual_seed(3)), "bf16")
    entry = gemm_entry(bundle, w13, 2)
    assert entry.launch(1).m_max > 1
    for max_tokens in (1, 3, 8, 33, 100, 1000, 4096):
        ws = GemmWorkspace.for_tokens(bundle, max_tokens, 2, w13)
        assert all(ws.fits(entry.launch(m), m, 2, 8) for m in range(1, max_tokens + 1)), max_tokens



def test_prepared_weights_and_a_callers_gemm_workspace_must_be_dense_on_the_bundles_device(monkeypatch):
    """The kernels read the weights and the workspace densely from raw addresses: an expanded (stride 0) global
    scale or an every-other-expert view of the packed weights (read as if dense: other experts' values, or past
    the memory) is refused when the weights are made; a workspace of another dtype, device or layout when the
    GEMM is called."""
    import dataclasses

    from cuteaot.runtime import BadInputError, w4a16_moe_gemm
    from cuteaot.runtime.kernels.w4a16.gemm import GemmWorkspace
    from cuteaot.runtime.weights import PackedNvfp4, prepare_w13
    from tests.reference.nvfp4 import random_nvfp4

    w = prepare_w13(*random_nvfp4(8, 512, 512, torch.Generator().manual_seed(5)), "bf16")
    with pytest.raises(BadInputError, match="global_scale must be contiguous and start 4-byte aligned"):
        dataclasses.replace(w, global_scale=torch.ones(1).expand(8))
    with pytest.raises(BadInputError, match="qweight must be contiguous"):
        PackedNvfp4(w.qweight[0::2], w.scales[0::2].contiguous(), w.global_scale[0::2].contiguous(), 4, w.n, w.k,
                    w.dtype)
    bundle = _stub_gemm_calls(monkeypatch, stream=0)
    a, ids = torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int32)
    good = GemmWorkspace.for_tokens(bundle, 1, 2, w)
    w4a16_moe_gemm(bundle, a, w, ids, workspace=good)
    for bad, message in ((dataclasses.replace(good, c_tmp=good.c_tmp.to(torch.bfloat16)), "workspace.c_tmp must be"),
                         (dataclasses.replace(good, locks=good.locks.repeat(2)[::2]), "workspace.locks must be")):
        with pytest.raises(BadInputError, match=message):
            w4a16_moe_gemm(bundle, a, w, ids, workspace=bad)
    with pytest.raises(BadInputError, match="workspace must be a GemmWorkspace"):
        w4a16_moe_gemm(bundle, a, w, ids, workspace=object())
    # pack_gemm_routes takes the same workspace, checked alike
    from cuteaot.runtime.kernels.w4a16.gemm import pack_gemm_routes
    assert pack_gemm_routes(bundle, ids, w, workspace=good).shape == (1, 2)
    with pytest.raises(BadInputError, match="workspace.c_tmp must be"):
        pack_gemm_routes(bundle, ids, w, workspace=dataclasses.replace(good, c_tmp=good.c_tmp.to(torch.bfloat16)))


@pytest.mark.parametrize("value, expected", [("1", True), ("on", True), ("0", False), ("off", False), ("", None),
                                             ("auto", None)])
def test_the_cooperative_environment_setting(monkeypatch, value, expected):
    from cuteaot.runtime.bundle import _env_choice

    monkeypatch.setenv("CUTEAOT_COOPERATIVE", value)
    assert _env_choice("CUTEAOT_COOPERATIVE") is expected
    monkeypatch.setenv("CUTEAOT_COOPERATIVE", "sometimes")
    with pytest.warns(UserWarning, match="is not 1, 0 or auto: taken as auto"):
        assert _env_choice("CUTEAOT_COOPERATIVE") is None
