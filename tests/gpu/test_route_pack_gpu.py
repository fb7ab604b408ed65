"""GPU tests of route packing: every output bitwise equal to the plain-torch reference.

Runs on the H200 against the bundle of the `gemm_bundle_dir` fixture, which must hold
`route_pack_specs()` for sm_90a.  Outputs are poisoned before every launch.
"""

from __future__ import annotations

import pytest
import torch

from cuteaot.runtime import BadInputError, load_bundle, pack_routes
from cuteaot.runtime.kernels.route_pack import (
    ALLOWED_BLOCK_SIZES,
    MULTI_MAX_CTAS,
    SINGLE_CTA_MAX_ROUTES,
    RouteChunking,
    route_pack_workspace_elements,
)
from tests.reference.route_pack import capacity_slots_reference, pack_routes_reference

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

POISON = -7  # neither a route index, the sentinel, nor -1
TOKENS = [1, 3, 64, 1000, 16384]


@pytest.fixture(scope="module")
def bundle(gemm_bundle_dir):
    return load_bundle(gemm_bundle_dir)


def _poisoned(n: int) -> torch.Tensor:
    return torch.full((n,), POISON, dtype=torch.int32, device="cuda")


def _workspace(routes: int, num_experts: int) -> torch.Tensor:
    """A poisoned workspace, barrier word included: pack_routes zeroes that itself."""
    return _poisoned(route_pack_workspace_elements(routes, num_experts))


def _buffers(routes: int, num_experts: int, b: int, extra_blocks: int = 0):
    slots = capacity_slots_reference(routes, b, num_experts) + extra_blocks * b
    return dict(
        packed_route_indices=_poisoned(slots),
        block_expert_ids=_poisoned(slots // b),
        packed_route_count=_poisoned(1),
        workspace=_workspace(routes, num_experts),
    )


def _check(bundle, ids, num_experts, b, expert_map=None, extra_blocks=0, what=""):
    bufs = _buffers(ids.numel(), num_experts, b, extra_blocks)
    outs = pack_routes(bundle, ids, num_experts, b, expert_map=expert_map, **bufs)
    assert outs[0] is bufs["packed_route_indices"] and outs[2] is bufs["packed_route_count"]
    torch.cuda.synchronize()
    if bufs["workspace"].numel():  # the multi stage leaves its barrier word's low bits at zero: the next launch may reuse it
        assert bufs["workspace"][0].item() & 0x7FFFFFFF == 0, "the grid barrier's count bits are not back at zero"
    ref = pack_routes_reference(
        ids.cpu(), num_experts, b, outs[0].numel(), outs[1].numel(), None if expert_map is None else expert_map.cpu()
    )
    for name, got, want in zip(("packed_route_indices", "block_expert_ids", "packed_route_count"), outs, ref):
        got = got.cpu()
        if not torch.equal(got, want):
            bad = (got != want).nonzero().flatten()[:8].tolist()
            pytest.fail(f"{what} b={b} E={num_experts}: {name} differs at {bad}: got "
                        f"{got[bad].tolist()}, want {want[bad].tolist()} (count {ref[2].item()})")


def _random_ids(tokens, top_k, num_experts, gen, dtype=torch.int32, skew=False):
    if skew:  # half the routes on one hot expert, the rest on a Zipf-like tail
        weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
        ids = torch.multinomial(weights, tokens * top_k, replacement=True, generator=gen)
        hot = torch.rand(tokens * top_k, generator=gen) < 0.5
        ids = torch.where(hot, torch.full_like(ids, num_experts // 3), ids)
    else:  # distinct experts per token, as a router produces
        ids = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    return ids.reshape(tokens, top_k).to(dtype).cuda()


def _holey_map(num_experts, gen):
    """Every third expert lives on another rank; the local ids are dense and increasing."""
    here = (torch.arange(num_experts) % 3) != 1
    table = torch.full((num_experts,), -1, dtype=torch.int32)
    table[here] = torch.arange(int(here.sum()), dtype=torch.int32)
    return table.cuda()


@pytest.mark.parametrize("b", ALLOWED_BLOCK_SIZES)
def test_edge_cases(bundle, b):
    gen = torch.Generator().manual_seed(b)
    cases = {
        "all tokens to one expert (single)": torch.full((500, 8), 5, dtype=torch.int32),
        "all tokens to one expert (multi)": torch.full((3000, 8), 127, dtype=torch.int64),
        "empty experts": torch.randint(40, 44, (64, 4), generator=gen, dtype=torch.int32),
        "top_k = 1": torch.randint(0, 128, (1000, 1), generator=gen, dtype=torch.int32),
        "M = 0": torch.empty(0, 8, dtype=torch.int32),
        "M = 0 int64": torch.empty(0, 8, dtype=torch.int64),
        "out-of-range ids dropped": torch.tensor([[0, 128], [-1, 5], [127, 1 << 20], [-(1 << 40), 3], [(1 << 32) + 3, 2]]),
        "one route": torch.tensor([[77]], dtype=torch.int32),
    }
    for what, ids in cases.items():
        _check(bundle, ids.cuda(), 128, b, what=what)
    holes = _holey_map(128, gen)
    _check(bundle, _random_ids(37, 8, 128, gen), 128, b, holes, what="expert_map with holes (single)")
    _check(bundle, _random_ids(2000, 8, 128, gen, torch.int64), 128, b, holes, what="expert_map with holes (multi)")
    bad_map = holes.clone()
    bad_map[::5] = 1000  # local ids outside [0, num_experts) are dropped too
    bad_map[1::7] = -3
    _check(bundle, _random_ids(900, 8, 128, gen), 128, b, bad_map, what="expert_map out of range")
    _check(bundle, torch.zeros(9, 2, dtype=torch.int32, device="cuda"), 1, b, what="one expert")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_random_routing(bundle, tokens, dtype):
    gen = torch.Generator().manual_seed(tokens)
    for b in ALLOWED_BLOCK_SIZES:
        for num_experts, top_k in ((128, 8), (256, 8), (512, 10), (8, 2)):
            ids = _random_ids(tokens, top_k, num_experts, gen, dtype)
            _check(bundle, ids, num_experts, b, what=f"M={tokens} top_k={top_k}")
        for skew in (False, True):
            ids = _random_ids(tokens, 8, 256, gen, dtype, skew=skew)
            _check(bundle, ids, 256, b, _holey_map(256, gen), what=f"M={tokens} expert_map skew={skew}")
        _check(bundle, _random_ids(tokens, 8, 64, gen, dtype, skew=True), 64, b, what=f"M={tokens} skewed")


def test_many_ctas_and_max_experts(bundle):
    gen = torch.Generator().manual_seed(3)
    ids = _random_ids(65536, 8, 512, gen, skew=True)
    assert RouteChunking.for_routes(ids.numel()).num_chunks == MULTI_MAX_CTAS  # the planner's cap
    for b in (8, 64):
        _check(bundle, ids, 512, b, what="65536 tokens")


def test_spare_capacity_is_filled_and_nothing_outside_is_written(bundle):
    gen = torch.Generator().manual_seed(5)
    for tokens in (7, 4000, 9000):
        ids = _random_ids(tokens, 8, 128, gen)
        ids.view(-1)[::7] = 999  # dropped on the device
        _check(bundle, ids, 128, 16, extra_blocks=5, what="spare capacity")
        routes, b = ids.numel(), 16
        slots = capacity_slots_reference(routes, b, 128)
        guard = 64
        big_p, big_b = _poisoned(slots + 2 * guard), _poisoned(slots // b + 2 * guard)
        big_c, ws = _poisoned(1 + 2 * guard), _workspace(routes, 128)
        pack_routes(bundle, ids, 128, b, packed_route_indices=big_p[guard:-guard],
                    block_expert_ids=big_b[guard:-guard], packed_route_count=big_c[guard:-guard], workspace=ws)
        torch.cuda.synchronize()
        for big in (big_p, big_b, big_c):
            assert (big[:guard] == POISON).all() and (big[-guard:] == POISON).all(), "wrote outside its buffer"


def test_allocates_outputs_when_not_given(bundle):
    gen = torch.Generator().manual_seed(9)
    ids = _random_ids(100, 8, 128, gen)
    packed, blocks, count = pack_routes(bundle, ids, 128, 32)
    ref = pack_routes_reference(ids.cpu(), 128, 32, packed.numel(), blocks.numel())
    assert packed.numel() == capacity_slots_reference(800, 32, 128)
    assert all(torch.equal(g.cpu(), r) for g, r in zip((packed, blocks, count), ref))


@pytest.mark.parametrize("tokens", [3, 600, 16384])
def test_cuda_graph_replay_equals_eager(bundle, tokens):
    gen = torch.Generator().manual_seed(tokens + 1)
    num_experts, b = 256, 16
    ids = _random_ids(tokens, 8, num_experts, gen)
    expert_map = _holey_map(num_experts, gen)
    bufs = _buffers(ids.numel(), num_experts, b)
    pack_routes(bundle, ids, num_experts, b, expert_map=expert_map, **bufs)  # resolves the plan outside capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        pack_routes(bundle, ids, num_experts, b, expert_map=expert_map, **bufs)
    for trial in range(3):
        ids.copy_(_random_ids(tokens, 8, num_experts, gen, skew=trial == 1))
        for name, t in bufs.items():  # the workspace too: the captured pack_routes zeroes its barrier word
            t.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        eager = _buffers(ids.numel(), num_experts, b)
        pack_routes(bundle, ids, num_experts, b, expert_map=expert_map, **eager)
        torch.cuda.synchronize()
        for name in ("packed_route_indices", "block_expert_ids", "packed_route_count"):
            assert torch.equal(bufs[name], eager[name]), f"trial {trial}: graph {name} differs from eager"
        ref = pack_routes_reference(ids.cpu(), num_experts, b, bufs["packed_route_indices"].numel(),
                                    bufs["block_expert_ids"].numel(), expert_map.cpu())
        assert torch.equal(bufs["packed_route_indices"].cpu(), ref[0])


def test_two_streams_concurrently(bundle):
    gen = torch.Generator().manual_seed(21)
    cases = [(_random_ids(t, 8, 128, gen), _buffers(t * 8, 128, 32)) for t in (300, SINGLE_CTA_MAX_ROUTES)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    for _ in range(10):
        for (ids, bufs), st in zip(cases, streams):
            with torch.cuda.stream(st):
                pack_routes(bundle, ids, 128, 32, **bufs)
    torch.cuda.synchronize()
    for ids, bufs in cases:
        ref = pack_routes_reference(ids.cpu(), 128, 32, bufs["packed_route_indices"].numel(),
                                    bufs["block_expert_ids"].numel())
        assert torch.equal(bufs["packed_route_indices"].cpu(), ref[0])


def test_bad_inputs_raise_before_launch(bundle):
    ids = torch.zeros(4, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(BadInputError, match="topk_ids must be on cuda"):
        pack_routes(bundle, ids.cpu(), 8, 8)
    with pytest.raises(BadInputError, match="expert_map must be on cuda"):
        pack_routes(bundle, ids, 8, 8, expert_map=torch.zeros(8, dtype=torch.int32))
    with pytest.raises(BadInputError, match="block_size"):
        pack_routes(bundle, ids, 8, 12)
    with pytest.raises(BadInputError, match="packed_route_indices must hold at least"):
        pack_routes(bundle, ids, 8, 8, packed_route_indices=_poisoned(8))
