"""GPU tests of the W4A16 grouped GEMM against an independent float32 reference (run on the H200).

Weights are random, quantized to ModelOpt NVFP4 by tests/reference/nvfp4.py, packed by
runtime/weights.py; the reference multiplies the dequantized ModelOpt tensors in float32.
Outputs are NaN-poisoned first, so an unwritten row fails.
"""

from __future__ import annotations

import pytest
import torch

from cuteaot.runtime import GemmWorkspace, load_bundle, pack_gemm_routes, pack_nvfp4, w4a16_moe_gemm
from cuteaot.runtime.errors import BadInputError
from cuteaot.codegen.kernels.w4a16.planning import plan_for  # the build's planner: what the table recorded
from cuteaot.runtime.kernels.w4a16.geometry import simulate_partition
from tests.reference.nvfp4 import dequantize_modelopt, quantize_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

HIDDEN, INTER, EXPERTS, TOP_K = 512, 256, 8, 2
MS = [1, 2, 3, 5, 8, 16, 33, 64, 256, 1000, 4096]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = 1e-2


@pytest.fixture(scope="module")
def bundle(gemm_bundle_dir):
    return load_bundle(gemm_bundle_dir)


def _weights(n: int, k: int, dtype: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(EXPERTS, n, k, generator=g) * 0.05
    q = quantize_nvfp4(w)
    packed = pack_nvfp4(*q, dtype).to("cuda")
    return packed, dequantize_modelopt(*q).cuda()


def _routing(m: int, top_k: int, skewed: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if skewed:  # most routes to experts 0 and 1, some experts empty
        probs = torch.tensor([0.6, 0.3] + [0.1 / 3] * 3 + [0.0] * (EXPERTS - 5))
        logits = torch.log(probs + 1e-12) + 0.01 * torch.rand(m, EXPERTS, generator=g)
    else:
        logits = torch.rand(m, EXPERTS, generator=g)
    ids = logits.topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.rand(m, top_k, generator=g)
    return ids.cuda(), (weights / weights.sum(1, keepdim=True)).cuda()


def _reference(a, w_deq, ids, topk_w, a_per_route, relu2=False):
    m, top_k = ids.shape
    rows = torch.arange(m * top_k, device=a.device)
    src = a.float()[rows if a_per_route else rows // top_k]
    out = torch.einsum("rk,rnk->rn", src, w_deq[ids.view(-1).long()])
    if topk_w is not None:
        out = out * topk_w.view(-1, 1)
    if relu2:
        out = torch.relu(out) ** 2
    return out


def _rel(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _gemm_and_reference(bundle, packed, w_deq, k, ids, topk_w, dtype, a_per_route):
    """One GEMM on fresh random activations into a NaN-poisoned output, and its float32 reference:
    FC1-style (a row per token) or FC2-style (a row per route, times the router weight)."""
    m = ids.shape[0]
    a = torch.randn(m * ids.shape[1] if a_per_route else m, k, device="cuda").to(DTYPES[dtype])
    out = torch.full((m * ids.shape[1], packed.n), float("nan"), dtype=DTYPES[dtype], device="cuda")
    w4a16_moe_gemm(bundle, a, packed, ids, topk_weights=topk_w, mul_topk_weights=a_per_route,
                   a_per_route=a_per_route, out=out)
    torch.cuda.synchronize()
    return out, _reference(a, w_deq, ids, topk_w if a_per_route else None, a_per_route)


def _split_k_used(m, n, k, top_k, bundle) -> bool:
    plan = plan_for(m, n, k, top_k, EXPERTS, bundle.profile)
    route_blocks = m * top_k if plan.direct_topk_routes else plan.max_route_blocks
    items = simulate_partition(route_blocks, plan.n_tiles, plan.k_tiles, plan.grid_x, plan.uses_m_block_8)
    return any(i.slice_count > 1 for i in items)


# (N, K) per weight: the tiny-gemm-silu problem, and tiny-gemm-padded (hidden = intermediate = 688, not
# multiples of 64: stored zero-padded to 704 = 64 (mod 128), so the last N tile and 128-deep k-tile are
# masked; read/written at 688 / 1376).
# tiny-gemm-narrow (hidden 640, intermediate 320): N % 256 = 128, the 128-wide wgmma tiles.
# tiny-gemm-wide (hidden = intermediate = 1024): K >= WGMMA_WIDE_MIN_K, so 256-row blocks (two
# warpgroups) from 256 routes per expert (M >= 1024 here).
SHAPES = {"w13": (2 * INTER, HIDDEN), "w2": (HIDDEN, INTER), "w13 padded": (1376, 688), "w2 padded": (688, 688),
          "w13 narrow": (640, 640), "w2 narrow": (640, 320), "w13 wide": (2048, 1024), "w2 wide": (1024, 1024)}
CASES = [(w, d) for w in ("w13", "w2") for d in DTYPES] + [
    (w, "bf16") for w in ("w13 padded", "w2 padded", "w13 narrow", "w2 narrow", "w13 wide", "w2 wide")]
SWEEPS = {"padded": (1, 5, 64, 1000), "narrow": (64, 256, 1000, 4096), "wide": (1000, 1024, 2048)}


@pytest.mark.parametrize("which,dtype", CASES)
def test_gemm_matches_float32_reference(bundle, worst_errors, dtype, which):
    torch.manual_seed(0)
    n, k = SHAPES[which]
    a_per_route = which.startswith("w2")
    packed, w_deq = _weights(n, k, dtype, seed=1 if which == "w13" else 2)
    split_seen, whole_seen = False, False
    for m in SWEEPS.get(which.split()[-1], MS):
        for skewed in (False, True):
            ids, topk_w = _routing(m, TOP_K, skewed, seed=m)
            out, ref = _gemm_and_reference(bundle, packed, w_deq, k, ids, topk_w, dtype, a_per_route)
            err = _rel(out, ref)
            worst_errors.record(f"gemm {which} {dtype}", err)
            assert not out.isnan().any(), f"M={m} skewed={skewed}: unwritten rows"
            assert err <= TOL, f"{which} {dtype} M={m} skewed={skewed}: rel err {err:.2e}"
        if _split_k_used(m, n, k, TOP_K, bundle):
            split_seen = True
        else:
            whole_seen = True
    if which in ("w13", "w2"):
        assert split_seen and whole_seen, "the M sweep must exercise both split-K and whole-K tiles"


# Routes per expert whose last 128-row block holds 1, 32, 33, 64, 65, 96, 97 and 128 rows: every
# row variant of the wgmma loop (N = 32 / 64 / 96 / 128 by valid rows) and both sides of each step.
VARIANT_COUNTS = (129, 288, 33, 64, 193, 96, 97, 256)
# ... and the 256-row blocks' (two warpgroups, N = 64 / 128 / 192 / 256): last blocks of 1, 64, 65, 128,
# 129, 192, 193 and 256 rows, experts of one to three blocks; 2308 routes (M = 1154) average 288.5 per expert
WIDE_VARIANT_COUNTS = (257, 64, 321, 128, 641, 192, 193, 512)


def _routes_with_counts(counts, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (M, 2), weights) in which expert e has exactly counts[e] routes (sum(counts) = 2 M)."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    m = len(experts) // 2
    ids = torch.stack((experts[:m], experts[m:]), dim=1)  # distinct: no expert holds more than m routes
    ids = ids[torch.randperm(m, generator=g)].to(torch.int32)
    weights = torch.rand(m, 2, generator=g)
    return ids.cuda(), (weights / weights.sum(1, keepdim=True)).cuda()


@pytest.mark.parametrize("block, counts, shapes", [(128, VARIANT_COUNTS, ("w13", "w2")),
                                                   (256, WIDE_VARIANT_COUNTS, ("w13 wide", "w2 wide"))])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_wgmma_row_blocks_run_every_row_variant(bundle, worst_errors, dtype, block, counts, shapes):
    ids, topk_w = _routes_with_counts(counts, seed=7)
    m = ids.shape[0]
    assert sorted(torch.bincount(ids.view(-1).long()).tolist()) == sorted(counts)
    for which in shapes:
        n, k = SHAPES[which]
        plan = plan_for(m, n, k, TOP_K, EXPERTS, bundle.profile)
        assert (plan.moe_block_size, plan.mainloop) == (block, "wgmma"), plan
        a_per_route = which.startswith("w2")
        packed, w_deq = _weights(n, k, dtype, seed=11)
        out, ref = _gemm_and_reference(bundle, packed, w_deq, k, ids, topk_w, dtype, a_per_route)
        err = _rel(out, ref)
        worst_errors.record(f"gemm {block}-row variants {dtype}", err)
        assert not out.isnan().any(), f"{which} {dtype}: unwritten rows"
        # per expert too: a wrong variant would spoil only its expert's rows
        for e in range(EXPERTS):
            rows = (ids.view(-1) == e).nonzero().view(-1)
            e_err = _rel(out[rows], ref[rows])
            assert e_err <= TOL, f"{which} {dtype} expert {e} ({counts[e]} routes): rel err {e_err:.2e}"


def test_relu2_epilogue(bundle, worst_errors):
    n, k, top_k = INTER, HIDDEN, 3
    packed, w_deq = _weights(n, k, "bf16", seed=3)
    for m in (1, 8, 64, 1000):
        g = torch.Generator().manual_seed(m)
        ids = torch.rand(m, EXPERTS, generator=g).topk(top_k, dim=1).indices.to(torch.int32).cuda()
        a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        out = torch.full((m * top_k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        w4a16_moe_gemm(bundle, a, packed, ids, epilogue="relu2", out=out)
        ref = _reference(a, w_deq, ids, None, False, relu2=True)
        err = _rel(out, ref)
        worst_errors.record("gemm relu2 epilogue bf16", err)
        assert not out.isnan().any(), f"relu2 M={m}: unwritten rows"
        assert err <= TOL, f"relu2 M={m}: rel err {err:.2e}"


def test_graph_replay_equals_eager_and_locks_stay_clean(bundle):
    n, k = 2 * INTER, HIDDEN
    packed, _ = _weights(n, k, "bf16", seed=4)
    m = 1000
    ws = GemmWorkspace.for_tokens(bundle, 4096, TOP_K, packed)
    ids, _ = _routing(m, TOP_K, False, seed=7)
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    eager = w4a16_moe_gemm(bundle, a, packed, ids, workspace=ws)
    out = torch.full_like(eager, float("nan"))
    w4a16_moe_gemm(bundle, a, packed, ids, out=out, workspace=ws)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w4a16_moe_gemm(bundle, a, packed, ids, out=out, workspace=ws)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert int(ws.locks.abs().sum()) == 0, "split-K locks must be zero after every launch"


def test_routes_packed_once_serve_fc1_and_fc2(bundle):
    """pack_gemm_routes + routes= gives bit-identical outputs to the GEMM's own packing, for FC1 and FC2."""
    w13, _ = _weights(2 * INTER, HIDDEN, "bf16", seed=5)
    w2, _ = _weights(HIDDEN, INTER, "bf16", seed=6)
    for m in (1, 8, 64, 1000):
        ids, topk_w = _routing(m, TOP_K, False, seed=m + 1)
        a = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
        routes = pack_gemm_routes(bundle, ids, w13)
        assert routes.block_size == (0 if plan_for(m, *SHAPES["w13"], TOP_K, EXPERTS, bundle.profile).direct_topk_routes
                                     else plan_for(m, *SHAPES["w13"], TOP_K, EXPERTS, bundle.profile).moe_block_size)
        h_own = w4a16_moe_gemm(bundle, a, w13, ids)
        h = torch.full_like(h_own, float("nan"))
        w4a16_moe_gemm(bundle, a, w13, ids, out=h, routes=routes)
        assert torch.equal(h, h_own), f"FC1 M={m}"
        x = h[:, :INTER].contiguous()
        fc2_plan = plan_for(m, *SHAPES["w2"], TOP_K, EXPERTS, bundle.profile)
        y_own = w4a16_moe_gemm(bundle, x, w2, ids, topk_weights=topk_w, mul_topk_weights=True, a_per_route=True)
        if routes.block_size == (0 if fc2_plan.direct_topk_routes else fc2_plan.moe_block_size):
            y = torch.full_like(y_own, float("nan"))
            w4a16_moe_gemm(bundle, x, w2, ids, topk_weights=topk_w, mul_topk_weights=True, a_per_route=True,
                           out=y, routes=routes)
            assert torch.equal(y, y_own), f"FC2 M={m}"
        else:
            with pytest.raises(BadInputError, match="routes were packed with block size"):
                w4a16_moe_gemm(bundle, x, w2, ids, topk_weights=topk_w, mul_topk_weights=True, a_per_route=True,
                               routes=routes)
    with pytest.raises(BadInputError, match="another topk_ids"):
        w4a16_moe_gemm(bundle, a, w13, ids.clone(), routes=routes)

