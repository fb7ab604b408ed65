"""Route packing on the CPU: the reference contract, planning, validation, keys, and an sm_90a build."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from cuteaot.runtime.plans import BundlePlans
from cuteaot.runtime import BadInputError, pack_routes
from cuteaot.runtime.kernels import FAMILIES
from cuteaot.runtime.kernels.route_pack import (
    ALLOWED_BLOCK_SIZES,
    BARRIER_WORDS,
    MAX_EXPERTS,
    MULTI_MAX_CHUNKS,
    MULTI_MAX_CTAS,
    SINGLE_CTA_MAX_ROUTES,
    SMEM_BYTES,
    RouteChunking,
    RoutePackSpec,
    RouteStage,
    max_packed_route_slots,
    route_pack_elements_used,
    route_pack_specs,
    route_pack_workspace_elements,
)
from tests.reference.route_pack import capacity_slots_reference, pack_routes_reference

S = 6  # sentinel of the 3 x 2 example below


def _ref(ids, num_experts, b, expert_map=None):
    ids = torch.as_tensor(ids, dtype=torch.int32)
    slots = capacity_slots_reference(ids.numel(), b, num_experts)
    return pack_routes_reference(ids, num_experts, b, slots, slots // b, expert_map)


def _check_contract(ids, num_experts, b, packed, block_ids, count, expert_map=None):
    """Structural properties of any valid packing (independent of how the reference builds it)."""
    routes = ids.numel()
    n = int(count[0])
    assert n % b == 0
    flat = ids.reshape(-1).long()
    if expert_map is not None:
        ok = (flat >= 0) & (flat < num_experts)
        flat = torch.where(ok, expert_map.long()[flat.clamp(0, num_experts - 1)], torch.full_like(flat, -1))
    kept = sorted(r for r in range(routes) if 0 <= int(flat[r]) < num_experts)
    real = packed[:n][packed[:n] < routes].tolist()
    assert sorted(real) == kept, "every kept route appears exactly once"
    assert (packed[n:] == routes).all()
    assert (block_ids[n // b:] == -1).all()
    for j in range(n // b):
        blk = packed[j * b:(j + 1) * b]
        valid = blk < routes
        assert valid[0], "a block never starts empty"
        assert not (valid[1:] & ~valid[:-1]).any(), "valid rows come first within a block"
        assert all(int(flat[r]) == int(block_ids[j]) for r in blk[valid].tolist())
    assert block_ids[: n // b].tolist() == sorted(block_ids[: n // b].tolist()), "experts in increasing order"


# -- the reference contract ---------------------------------------------------------------


def test_reference_worked_example():
    packed, blocks, count = _ref([[2, 0], [2, 1], [0, 2]], num_experts=3, b=4)
    assert count.tolist() == [12]
    assert packed[:12].tolist() == [1, 4, S, S, 3, S, S, S, 0, 2, 5, S]
    assert (packed[12:] == S).all() and blocks.tolist()[:3] == [0, 1, 2] and (blocks[3:] == -1).all()


@pytest.mark.parametrize("b", ALLOWED_BLOCK_SIZES)
def test_reference_all_tokens_to_one_expert(b):
    ids = torch.full((100, 1), 5, dtype=torch.int32)
    packed, blocks, count = _ref(ids, 8, b)
    n = -(-100 // b) * b
    assert int(count) == n and packed[:100].tolist() == list(range(100)) and (packed[100:] == 100).all()
    assert (blocks[: n // b] == 5).all() and (blocks[n // b:] == -1).all()
    _check_contract(ids, 8, b, packed, blocks, count)


def test_reference_empty_experts_produce_no_blocks():
    ids = torch.tensor([[7, 1], [1, 7], [7, 7]], dtype=torch.int32)
    packed, blocks, count = _ref(ids, 16, 8)
    assert int(count) == 16 and blocks[:2].tolist() == [1, 7]
    assert packed[:16].tolist() == [1, 2] + [6] * 6 + [0, 3, 4, 5] + [6] * 4


def test_reference_expert_map_with_holes_drops_remote_routes():
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1], dtype=torch.int32)  # global 1, 3, 4 live here
    ids = torch.tensor([[0, 3], [1, 5], [4, 1], [2, 3]], dtype=torch.int32)
    packed, blocks, count = _ref(ids, 6, 8, expert_map)
    assert int(count) == 24 and blocks[:3].tolist() == [0, 1, 2]
    assert packed[0:2].tolist() == [2, 5] and packed[8:10].tolist() == [1, 7] and packed[16] == 4
    _check_contract(ids, 6, 8, packed, blocks, count, expert_map)


def test_reference_out_of_range_ids_are_dropped():
    ids = torch.tensor([[0, 9], [-1, 2], [3, 2]], dtype=torch.int32)
    packed, blocks, count = _ref(ids, 4, 8)
    assert int(count) == 24 and packed[:8].tolist() == [0] + [6] * 7 and packed[8:10].tolist() == [3, 5]


def test_reference_top_k_one_and_zero_tokens():
    packed, blocks, count = _ref(torch.tensor([[1], [0], [1]]), 2, 16)
    assert packed[:2].tolist() == [1, 3] and packed[16:18].tolist() == [0, 2] and blocks[:2].tolist() == [0, 1]
    packed, blocks, count = _ref(torch.empty(0, 8, dtype=torch.int32), 128, 64)
    assert packed.numel() == 0 and blocks.numel() == 0 and count.tolist() == [0]


@pytest.mark.parametrize("b", ALLOWED_BLOCK_SIZES)
def test_reference_random_routing_keeps_the_contract(b):
    gen = torch.Generator().manual_seed(b)
    ids = torch.randint(0, 40, (97, 6), generator=gen, dtype=torch.int32)
    ids[::3] = 4  # skew
    packed, blocks, count = _ref(ids, 40, b)
    _check_contract(ids, 40, b, packed, blocks, count)


# -- planning -----------------------------------------------------------------------------


@pytest.mark.parametrize("routes", [0, 1, 7, 100, 4096, 131072, 10**6])
@pytest.mark.parametrize("b", ALLOWED_BLOCK_SIZES)
def test_capacity_formula(routes, b):
    for experts in (1, 8, 128, 512):
        slots = max_packed_route_slots(routes, b, experts)
        assert slots == capacity_slots_reference(routes, b, experts) and slots % b == 0
        # a bad case: min(experts, routes) - 1 experts with one route each, the rest on one expert
        used = min(experts, routes)
        worst = 0 if used == 0 else (used - 1) * b + -(-(routes - used + 1) // b) * b
        assert worst <= slots < worst + b + used * (b - 1)


@pytest.mark.parametrize("routes", [0, 1, SINGLE_CTA_MAX_ROUTES, SINGLE_CTA_MAX_ROUTES + 1, 131072, 2**24])
def test_chunking_covers_the_routes(routes):
    c = RouteChunking.for_routes(routes)
    assert c.single == (routes <= SINGLE_CTA_MAX_ROUTES)
    if c.single:
        assert c.num_chunks == 1 and route_pack_workspace_elements(routes, 64) == 0
    else:
        assert c.chunk_routes % 512 == 0 and 1 <= c.num_chunks <= MULTI_MAX_CTAS <= MULTI_MAX_CHUNKS
        assert (c.num_chunks - 1) * c.chunk_routes < routes <= c.num_chunks * c.chunk_routes
        assert route_pack_elements_used(routes, 64) == BARRIER_WORDS + c.num_chunks * 64


def test_a_workspace_for_some_routes_serves_every_smaller_count():
    """The chunk count does not grow with the routes (16384 routes take 32 chunks, 24576 take 24): a workspace
    sized for a layer's largest call (MoeLayer: max_tokens * top_k routes) must hold every smaller call's
    counts, or a valid call would be refused (max_tokens 3072, top-k 8: M = 1537..2048)."""
    assert RouteChunking.for_routes(16384).num_chunks == 32 and RouteChunking.for_routes(24576).num_chunks == 24
    used = [route_pack_elements_used(r, 128) for r in range(1, 40001)]
    for largest in (SINGLE_CTA_MAX_ROUTES + 1, 12288, 16384, 24576, 32768, 40000):
        assert max(used[:largest]) <= route_pack_workspace_elements(largest, 128), largest
        assert route_pack_workspace_elements(largest, 128) == max(used[:largest])  # and no larger than that


def test_the_multi_stage_grid_fits_one_cta_per_sm_on_every_profile():
    """The multi stage's CTAs meet at a grid barrier: all must be resident at once.  Its 512-thread CTA
    holds one SM's registers (86 a thread on sm_90a), so the planner's cap must not exceed any profile's
    SM count, or packing would hang there (GB10: 48 SMs)."""
    from cuteaot.runtime.devices import PROFILES

    assert MULTI_MAX_CTAS <= min(p.sm_count for p in PROFILES.values())
    assert RouteChunking.for_routes(2**24).num_chunks == MULTI_MAX_CTAS


# -- validation (raised before any launch: a CPU stand-in for the bundle suffices) ---------


def _fake_bundle():
    return SimpleNamespace(device=torch.device("cpu"), plans=BundlePlans(), id="cpu-test", device_index=-1)


def _ids(m=4, k=2, dtype=torch.int32):
    return torch.zeros(m, k, dtype=dtype)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(topk_ids=_ids(dtype=torch.int16)), "int32 or int64"),
        (dict(topk_ids=torch.zeros(8, dtype=torch.int32)), "2-D"),
        (dict(topk_ids=_ids(4, 4).t()), "contiguous"),
        (dict(num_experts=0), r"num_experts must be an int in \[1, 512\]"),
        (dict(num_experts=MAX_EXPERTS + 1), "num_experts"),
        (dict(block_size=24), r"block_size must be one of \(8, 16, 32, 48, 64, 128, 256\)"),
        (dict(expert_map=torch.zeros(7, dtype=torch.int32)), r"expert_map must have shape \(8,\)"),
        (dict(expert_map=torch.zeros(8, dtype=torch.int64)), "expert_map must be int32"),
        (dict(packed_route_indices=torch.empty(63, dtype=torch.int32)), "at least 64"),
        (dict(packed_route_indices=torch.empty(64, dtype=torch.int64)), "packed_route_indices must be int32"),
        (dict(block_expert_ids=torch.empty(7, dtype=torch.int32)), "block_expert_ids must hold at least 8"),
        (dict(packed_route_count=torch.empty(2, dtype=torch.int32)), "exactly 1"),
        (dict(packed_route_indices=torch.empty(64, 2, dtype=torch.int32)[:, 0]), "contiguous 1-D"),
    ],
)
def test_bad_inputs_raise_before_launch(kwargs, match):
    args = dict(topk_ids=_ids(), num_experts=8, block_size=8)
    args.update(kwargs)
    bundle = _fake_bundle()
    with pytest.raises(BadInputError, match=match):
        pack_routes(bundle, args.pop("topk_ids"), args.pop("num_experts"), args.pop("block_size"), **args)
    assert len(bundle.plans) == 0


def test_small_workspace_is_refused():
    ids = _ids(SINGLE_CTA_MAX_ROUTES, 2)
    need = route_pack_workspace_elements(ids.numel(), 8)
    with pytest.raises(BadInputError, match=f"workspace must hold at least {need}"):
        pack_routes(_fake_bundle(), ids, 8, 8, workspace=torch.empty(need - 1, dtype=torch.int32))


def test_wrong_device_is_refused():
    bundle = SimpleNamespace(device=torch.device("cuda", 0), plans=BundlePlans(), id="x", device_index=0)
    with pytest.raises(BadInputError, match="topk_ids must be on cuda:0"):
        pack_routes(bundle, _ids(), 8, 8)


def test_fake_op_checks_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ids = torch.empty(5, 4, dtype=torch.int64)
        slots = max_packed_route_slots(20, 16, 32)
        outs = [torch.empty(n, dtype=torch.int32) for n in (slots, slots // 16, 1, 0)]
        torch.ops.cuteaot.pack_routes(ids, 32, 16, None, *outs, "no-bundle")
        outs[0] = torch.empty(slots - 1, dtype=torch.int32)
        with pytest.raises(BadInputError, match="packed_route_indices"):
            torch.ops.cuteaot.pack_routes(ids, 32, 16, None, *outs, "no-bundle")


# -- keys ---------------------------------------------------------------------------------

STABLE_KEYS = {
    ("single", "int32"): "342c6131c2b93ee0",
    ("multi", "int32"): "3fa876094bd2913d",
    ("single", "int64"): "eb853c8f4bc9aa31",
    ("multi", "int64"): "31b9a7ea877740aa",
}


def test_spec_keys_are_stable_and_round_trip():
    specs = route_pack_specs()
    assert FAMILIES["moe_route_pack"] is RoutePackSpec
    got = {(s.stage.value, s.ids_dtype.value): s.key().digest[:16] for s in specs}
    assert got == STABLE_KEYS, "a key changed: bump RoutePackSpec.VERSION and update STABLE_KEYS deliberately"
    for s in specs:
        assert RoutePackSpec.from_facts(dict(s.key().facts)) == s
    assert '"stage":"single"' in RoutePackSpec(RouteStage.SINGLE, "int32").key().canonical


def test_spec_validity():
    with pytest.raises(BadInputError, match="needs ids_dtype"):
        RoutePackSpec(RouteStage.MULTI, None)
    with pytest.raises(ValueError):
        RoutePackSpec("scan", "int32")  # the three-launch stages are gone (version 2)


# -- build --------------------------------------------------------------------------------


@pytest.mark.build
def test_every_specialization_compiles_for_sm90a():
    pytest.importorskip("cutlass", reason="the build needs CuTeDSL (cuteaot[codegen])")
    from cuteaot.codegen.compile import compile_kernel

    for spec in route_pack_specs():
        start = time.perf_counter()
        compiled = compile_kernel(spec.key(), "sm_90a")
        rec = compiled.record
        assert rec["block"] == [512, 1, 1] and rec["dynamic_smem_bytes"] == SMEM_BYTES
        assert rec["stack_bytes"] == 0 and rec["local_bytes"] == 0 and rec["registers"] <= 65536 // 512  # launchable at 512 threads
        assert len(rec["params"]) == len(RoutePackSpec.SIGNATURE.params)
        assert time.perf_counter() - start < 30


@pytest.mark.build
def test_declared_shared_memory_matches_the_compiled_kernel():
    """The allocator's size is a constant of the host launcher; the manifest must record the same."""
    pytest.importorskip("cutlass", reason="the build needs CuTeDSL (cuteaot[codegen])")
    import re

    import cutlass.cute as cute

    from cuteaot.codegen.kernels import route_pack

    kernel, args = route_pack.build(RoutePackSpec(RouteStage.SINGLE, "int64"))
    ir = str(cute.compile(kernel, *args, options="--gpu-arch sm_90a").ir_module)
    sizes = {int(v) for v in re.findall(r"llvm\.mlir\.constant\((\d+) : i64\)", ir)}
    assert SMEM_BYTES in sizes, f"{SMEM_BYTES} bytes not found among the launcher's constants"


@pytest.mark.parametrize("tokens, expert_map", [(7, False), (1000, False), (1000, True)])
def test_prepared_route_pack_launches_what_pack_routes_launches(monkeypatch, tokens, expert_map):
    """PreparedRoutePack (MoeLayer's per-step packing) passes the same stage values as pack_routes,
    except the pointers pack_routes fills with the ids' address where a stage does not read them."""
    import cuteaot.runtime.kernels.route_pack as rp
    from tests.stub_bundle import RecordingKernel

    issued: list = []
    made: list = []  # the kernels the plans loaded

    def kernel(key):
        made.append(RecordingKernel(issued, key.facts["stage"]))
        return made[-1]

    bundle = SimpleNamespace(device=torch.device("cpu"), device_index=None, plans=BundlePlans(), kernel=kernel)
    monkeypatch.setattr(rp, "current_stream_handle", lambda index: 0)
    e, top_k, block = 64, 8, 16
    ids = (torch.arange(tokens * top_k, dtype=torch.int32) % e).view(tokens, top_k)
    emap = torch.arange(e, dtype=torch.int32) if expert_map else None
    routes = tokens * top_k
    slots = max_packed_route_slots(routes, block, e)
    buffers = dict(packed=torch.empty(slots, dtype=torch.int32), block_ids=torch.empty(slots // block, dtype=torch.int32),
                   count=torch.empty(1, dtype=torch.int32),
                   workspace=torch.empty(max(route_pack_workspace_elements(routes, e), 1), dtype=torch.int32))
    rp.pack_routes(bundle, ids, e, block, expert_map=emap, packed_route_indices=buffers["packed"],
                   block_expert_ids=buffers["block_ids"], packed_route_count=buffers["count"],
                   workspace=buffers["workspace"])
    by_name, issued[:] = list(issued), []
    prepared = rp.PreparedRoutePack(bundle, ids, e, block, expert_map=emap, **buffers)
    outputs = prepared(ids, stream=0)
    assert outputs == (buffers["packed"], buffers["block_ids"], buffers["count"])
    names = RoutePackSpec.SIGNATURE.names
    single = RouteChunking.for_routes(routes).single
    assert [(s, g) for s, g, _ in issued] == [(s, g) for s, g, _ in by_name] == [
        ("single" if single else "multi", RouteChunking.for_routes(routes).num_chunks)]
    for (_, _, got), (_, _, want) in zip(issued, by_name):
        for name, a, b in zip(names, got, want):
            unread = (name == "workspace" and single) or (name == "expert_map" and not expert_map)
            assert a == b or unread, name
    # the multi stage meets at a grid barrier: marked so, it launches cooperatively where layers run concurrently
    assert made and all(k.waits_on_grid == (k.tag == "multi") for k in made)


def test_a_callers_workspace_gets_its_barrier_count_zeroed_and_cuteaots_own_does_not(monkeypatch):
    """The multi stage's grid barrier needs its count word at zero.  pack_routes zeroes it in a workspace the
    caller passes (whatever it held); the GEMM's own GemmWorkspace, zeroed when allocated and left at zero by
    every launch, is packed into without that extra fill; the single stage reads no workspace."""
    import cuteaot.runtime.kernels.route_pack as rp
    from tests.stub_bundle import RecordingKernel

    issued: list = []
    bundle = SimpleNamespace(device=torch.device("cpu"), device_index=None, plans=BundlePlans(),
                             kernel=lambda key: RecordingKernel(issued, key.facts["stage"]))
    monkeypatch.setattr(rp, "current_stream_handle", lambda index: 0)
    e, block = 64, 16
    for tokens, stage in ((1000, "multi"), (7, "single")):
        ids = (torch.arange(tokens * 8, dtype=torch.int32) % e).view(tokens, 8)
        slots = max_packed_route_slots(ids.numel(), block, e)
        for own in (False, True):
            ws = torch.full((max(route_pack_workspace_elements(ids.numel(), e), 1),), -7, dtype=torch.int32)
            issued[:] = []
            rp._pack_routes(bundle, ids, e, block, None, torch.empty(slots, dtype=torch.int32),
                            torch.empty(slots // block, dtype=torch.int32), torch.empty(1, dtype=torch.int32), ws,
                            own_workspace=own)
            assert [s for s, _, _ in issued] == [stage]
            zeroed = stage == "multi" and not own
            assert ws[0].item() == (0 if zeroed else -7) and (ws[1:] == -7).all(), (stage, own)
