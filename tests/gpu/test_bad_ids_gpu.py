"""Invalid expert ids are dropped on the device, on every path (run on the H200).

Serving frameworks pass -1 for masked routes (expert-parallel dispatch, padding) and cannot
afford a host-side id check (`validate_ids=False`: it syncs every call).  A route whose id is
outside [0, E) -- or whose expert lives on another rank under `expert_map` -- must be dropped:
no illegal memory access (each call is followed by a synchronize, which raises once the
context is lost), and every token's output equals the float32 reference in which dropped
routes contribute exactly 0 (a token whose routes are all dropped gets an exact zero row).

Bundles: specs/tiny-fused.yaml (MoeLayer: decode, packed, chunked, CUDA graph, expert_map) and
specs/tiny-gemm.yaml (w4a16_moe_gemm direct and packed routes, the masked moe_topk_sum).
Fresh random data every case; outputs (and the layer's FC2 rows) are NaN-poisoned first, so a
row that is never written or a stale row that is summed shows up.
"""

from __future__ import annotations

import pytest
import torch

from cuteaot.runtime import load_bundle, moe_topk_sum, pack_nvfp4, prepare_w2, prepare_w13, w4a16_moe_gemm
from cuteaot.runtime.moe import MoeLayer
from tests.reference.moe import moe_reference
from tests.reference.nvfp4 import dequantize_modelopt, quantize_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

WIDE = (1 << 32) + 3  # int64 only: a plain cast to int32 would turn it into expert 3
TOL = 1e-2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bad_values(experts: int, wide: bool) -> list[int]:
    """Every kind of invalid id: masked (-1), one past the end, far past it, negative; 2^32 + 3 for int64."""
    return [-1, experts, 100000, -7] + ([WIDE] if wide else [])


def spoil(ids: torch.Tensor, experts: int, *, wide: bool, shift: int = 0) -> torch.Tensor:
    """Copy of (M, top_k) ids with every odd route and all of token 1 (if any) given invalid ids.

    The invalid ids cycle through `bad_values` starting at `shift`, so a few shifts put every
    kind at every position of a small M.  int64 when `wide`, else int32.
    """
    dtype = torch.int64 if wide else torch.int32
    bad = torch.tensor(bad_values(experts, wide), dtype=dtype)
    out = ids.to(device="cpu", dtype=dtype).clone()
    flat = out.view(-1)
    odd = torch.arange(1, flat.numel(), 2)
    flat[odd] = bad[(torch.arange(odd.numel()) + shift) % len(bad)]
    if out.shape[0] > 1:
        out[1] = bad[(torch.arange(out.shape[1]) + shift) % len(bad)]
    return out.to(ids.device)


def kept_routes(ids: torch.Tensor, experts: int, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """Bool (M, top_k): the routes that must contribute (id in range and, under a map, local)."""
    ids = ids.long()
    keep = (ids >= 0) & (ids < experts)
    if expert_map is not None:
        keep &= expert_map.long()[ids.clamp(0, experts - 1)] >= 0
    return keep


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def rel_err(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def check_tokens(out: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor, what: str) -> None:
    assert not out.isnan().any(), f"{what}: NaN in the output (a stale or unwritten row was summed)"
    err = rel_err(out, ref)
    assert err <= TOL, f"{what}: rel err {err:.2e}"
    dropped = ~keep.any(dim=1)
    assert torch.equal(out[dropped].float(), torch.zeros_like(out[dropped].float())), (
        f"{what}: tokens whose routes were all dropped must be exactly 0"
    )


def assert_clean(workspace) -> None:
    """Barrier word's count bits and split-K locks back at zero: skipped tiles left no lock behind."""
    locks = workspace.locks.cpu()
    assert int(locks[0]) & 0x7FFFFFFF == 0 and int(locks[2:].abs().sum()) == 0, f"dirty workspace: {locks[:8].tolist()}"


# ---- the fused layer (tiny-fused: silu, H 512, I 256, E 16, top_k 4, bf16) --------------------


@pytest.fixture(scope="module")
def fused_bundle(fused_bundle_dir):
    return load_bundle(fused_bundle_dir)


class Model:
    """Random NVFP4 weights: packed for the layer, dequantised (float32) for the reference."""

    H, I, TOP_K = 512, 256, 4

    def __init__(self, seed: int, experts: int = 16):
        self.e = experts
        self.g = torch.Generator().manual_seed(seed)
        q13 = quantize_nvfp4(torch.randn(experts, 2 * self.I, self.H, generator=self.g) * 0.05)
        q2 = quantize_nvfp4(torch.randn(experts, self.H, self.I, generator=self.g) * 0.05)
        self.w13, self.w2 = prepare_w13(*q13, "bf16").to("cuda"), prepare_w2(*q2, "bf16").to("cuda")
        self.w13_f, self.w2_f = dequantize_modelopt(*q13).cuda(), dequantize_modelopt(*q2).cuda()

    def layer(self, bundle, **kw) -> MoeLayer:
        return MoeLayer(bundle, self.w13, self.w2, top_k=self.TOP_K, activation="silu", validate_ids=False, **kw)

    def inputs(self, m: int, experts: int | None = None):
        """x (M, H) bf16, router weights (M, top_k) float32, distinct valid ids (M, top_k) int32."""
        e = self.e if experts is None else experts
        x = (torch.randn(m, self.H, generator=self.g) * 2).to(torch.bfloat16)
        ids = torch.rand(m, e, generator=self.g).topk(self.TOP_K, dim=1).indices.to(torch.int32)
        weights = torch.softmax(torch.randn(m, self.TOP_K, generator=self.g), dim=1)
        return x.cuda(), weights.cuda(), ids.cuda()

    def reference(self, x, weights, ids, expert_map: torch.Tensor | None = None):
        """(float32 output, kept routes): dropped routes get weight 0 on a valid expert, i.e. add exactly 0."""
        experts = self.e if expert_map is None else expert_map.shape[0]
        keep = kept_routes(ids, experts, expert_map)
        safe = torch.where(keep, ids.long(), torch.zeros_like(ids.long()))
        w = torch.where(keep, weights, torch.zeros_like(weights))
        if expert_map is None:
            ref, _, _ = moe_reference(x, self.w13_f, self.w2_f, w, safe, "silu")
        else:
            local = {g for g in range(experts) if int(expert_map[g]) >= 0}
            ref, _, _ = moe_reference(x, self.w13_f, self.w2_f, w, safe, "silu", local=local,
                                      expert_index=expert_map.long().clamp(min=0))
        return ref, keep


def run_and_check(layer: MoeLayer, model: Model, m: int, *, wide: bool, shift: int = 0, expert_map=None,
                  what: str = "") -> None:
    experts = model.e if expert_map is None else expert_map.shape[0]
    x, w, ids = model.inputs(m, experts)
    bad = spoil(ids, experts, wide=wide, shift=shift)
    layer.workspace().fc13.fill_(float("nan"))  # a dropped route's stale FC2 row must never be summed
    out = layer(x, w, bad, out=poisoned((m, model.H), torch.bfloat16))
    torch.cuda.synchronize()  # raises if the kernels touched memory out of bounds
    ref, keep = model.reference(x, w, bad, expert_map)
    check_tokens(out, ref, keep, f"{what} M={m} {'int64' if wide else 'int32'} shift={shift}")


def test_decode_path_drops_bad_ids(fused_bundle):
    model = Model(seed=101)
    layer = model.layer(fused_bundle)
    for m in (1, 2):
        assert layer.resolve(m).decode
        for wide in (False, True):
            for shift in range(len(bad_values(model.e, wide))):
                run_and_check(layer, model, m, wide=wide, shift=shift, what="decode")
    assert_clean(layer.workspace())


def test_packed_path_drops_bad_ids(fused_bundle):
    model = Model(seed=103)
    layer = model.layer(fused_bundle)
    for m in (3, 40):
        assert not layer.resolve(m).decode
        for wide in (False, True):
            run_and_check(layer, model, m, wide=wide, what="packed")
    assert_clean(layer.workspace())


def test_chunked_calls_drop_bad_ids(fused_bundle):
    model = Model(seed=107)
    layer = model.layer(fused_bundle, max_tokens=16)
    assert layer.resolve(1).decode and not layer.resolve(16).decode
    for wide in (False, True):
        run_and_check(layer, model, 33, wide=wide, what="chunks 16 + 16 + 1 (decode)")
    assert_clean(layer.workspace())


@pytest.mark.parametrize("m, wide", [(2, True), (40, False)], ids=["decode-int64", "packed-int32"])
def test_graph_replay_drops_bad_ids(fused_bundle, m, wide):
    """The ids are checked on the device at every replay: new bad ids in the captured buffer are dropped."""
    model = Model(seed=109)
    layer = model.layer(fused_bundle)
    x, w, ids = model.inputs(m)
    ids = spoil(ids, model.e, wide=wide)
    out = torch.empty(m, model.H, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, w, ids, out=out)  # warm-up on the capture stream: plans and its workspace
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        layer(x, w, ids, out=out)
    for shift in range(len(bad_values(model.e, wide))):
        nx, nw, nids = model.inputs(m)
        x.copy_(nx)
        w.copy_(nw)
        ids.copy_(spoil(nids, model.e, wide=wide, shift=shift))
        out.fill_(float("nan"))
        layer.workspace(stream.cuda_stream).fc13.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, keep = model.reference(x, w, ids)
        check_tokens(out, ref, keep, f"graph replay M={m} shift={shift}")
    assert_clean(layer.workspace(stream.cuda_stream))


def test_expert_map_drops_remote_and_bad_ids(fused_bundle):
    """16 global experts, this rank holds the even ones; odd (remote) and invalid ids contribute 0."""
    model = Model(seed=113, experts=8)
    expert_map = torch.full((16,), -1, dtype=torch.int32)
    expert_map[0::2] = torch.arange(8, dtype=torch.int32)
    expert_map = expert_map.cuda()
    layer = model.layer(fused_bundle, expert_map=expert_map)
    for m in (1, 2, 40):
        for wide in (False, True):
            run_and_check(layer, model, m, wide=wide, expert_map=expert_map, what="expert_map")
    assert_clean(layer.workspace())


# ---- the standalone GEMM and top-k sum (tiny-gemm: E 8, H 512, I 256, top_k 2) ----------------

GEMM_EXPERTS, GEMM_TOP_K = 8, 2


@pytest.fixture(scope="module")
def gemm_bundle(gemm_bundle_dir):
    return load_bundle(gemm_bundle_dir)


@pytest.mark.parametrize("which, n, k", [("w13", 512, 512), ("w2", 512, 256)])
def test_gemm_drops_bad_ids(gemm_bundle, which, n, k):
    """Direct routes (M <= 6) read raw ids, packed routes go through route packing: both drop bad ids,
    leave the dropped routes' rows unwritten and compute every valid route."""
    g = torch.Generator().manual_seed(127)
    q = quantize_nvfp4(torch.randn(GEMM_EXPERTS, n, k, generator=g) * 0.05)
    packed, w_f = pack_nvfp4(*q, "bf16").to("cuda"), dequantize_modelopt(*q).cuda()
    a_per_route = which == "w2"
    for m in (1, 2, 5, 64):
        for wide in (False, True):
            ids = torch.rand(m, GEMM_EXPERTS, generator=g).topk(GEMM_TOP_K, dim=1).indices
            bad = spoil(ids, GEMM_EXPERTS, wide=wide, shift=m).cuda()
            topk_w = torch.rand(m, GEMM_TOP_K, generator=g).cuda()
            rows = m * GEMM_TOP_K
            a = torch.randn(rows if a_per_route else m, k, generator=g).to(torch.bfloat16).cuda()
            out = poisoned((rows, n), torch.bfloat16)
            w4a16_moe_gemm(gemm_bundle, a, packed, bad, topk_weights=topk_w, mul_topk_weights=a_per_route,
                           a_per_route=a_per_route, out=out)
            torch.cuda.synchronize()
            keep = kept_routes(bad, GEMM_EXPERTS).view(-1)
            r = keep.nonzero().view(-1)
            src = a.float()[r if a_per_route else r // GEMM_TOP_K]
            ref = torch.einsum("rk,rnk->rn", src, w_f[bad.view(-1).long()[r]])
            if a_per_route:
                ref = ref * topk_w.view(-1)[r, None]
            what = f"{which} M={m} {'int64' if wide else 'int32'}"
            assert not out[r].isnan().any(), f"{what}: a valid route's row was not written"
            assert rel_err(out[r], ref) <= TOL, f"{what}: rel err {rel_err(out[r], ref):.2e}"
            assert out[~keep].isnan().all(), f"{what}: a dropped route's row was written"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_masked_topk_sum_skips_dropped_routes(gemm_bundle, dtype):
    """Rows of dropped routes hold NaN / Inf (stale workspace): the masked sum never adds them."""
    g = torch.Generator().manual_seed(131)
    for m in (1, 7, 128, 4097):
        for wide in (False, True):
            ids = torch.rand(m, GEMM_EXPERTS, generator=g).topk(GEMM_TOP_K, dim=1).indices
            bad = spoil(ids, GEMM_EXPERTS, wide=wide, shift=m).cuda()
            keep = kept_routes(bad, GEMM_EXPERTS)
            fc2 = torch.randn(m, GEMM_TOP_K, 512, generator=g).cuda()
            stale = torch.where(torch.arange(512, device="cuda") % 2 == 0, float("nan"), float("inf"))
            fc2 = torch.where(keep[..., None], fc2, stale).to(DTYPES[dtype])
            out = poisoned((m, 512), DTYPES[dtype])
            moe_topk_sum(gemm_bundle, fc2, out, topk_ids=bad, num_experts=GEMM_EXPERTS)
            torch.cuda.synchronize()
            ref = torch.where(keep[..., None], fc2.double(), 0.0).sum(dim=1)
            check_tokens(out, ref, keep, f"masked top-k sum {dtype} M={m} {'int64' if wide else 'int32'}")
