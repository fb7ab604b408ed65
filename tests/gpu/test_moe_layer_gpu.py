"""A whole MoE layer from the unfused kernels (the path issue 4 will fuse), on the H200.

    fc1 = w4a16_moe_gemm(x, W13)                          (M*top_k, 2I), gate | up
    act = moe_activation(fc1, "silu")                     (M*top_k, I)
    fc2 = w4a16_moe_gemm(act, W2, router weights, per route)
    out = moe_topk_sum(fc2.view(M, top_k, H))             (M, H)

against a float32 reference of the same layer built from the dequantised ModelOpt weights,
with the activation applied in float32 (the kernels round fc1/act to bf16 in between).
"""

from __future__ import annotations

import pytest
import torch

from cuteaot.runtime import load_bundle, moe_activation, moe_topk_sum, prepare_w2, prepare_w13, w4a16_moe_gemm
from tests.reference.nvfp4 import dequantize_modelopt, quantize_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

HIDDEN, INTER, EXPERTS, TOP_K = 512, 256, 8, 2  # the tiny-gemm-silu problem of specs/tiny-gemm.yaml


@pytest.fixture(scope="module")
def bundle(gemm_bundle_dir):
    return load_bundle(gemm_bundle_dir)


def test_moe_layer_matches_float32_reference(bundle):
    g = torch.Generator().manual_seed(11)
    w13_q = quantize_nvfp4(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.05)
    w2_q = quantize_nvfp4(torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.05)
    w13 = prepare_w13(*w13_q, "bf16").to("cuda")
    w2 = prepare_w2(*w2_q, "bf16").to("cuda")
    w13_f, w2_f = dequantize_modelopt(*w13_q).cuda(), dequantize_modelopt(*w2_q).cuda()
    worst = 0.0
    for m in (1, 3, 8, 64, 1000):
        x = torch.randn(m, HIDDEN, generator=g).to(torch.bfloat16).cuda()
        ids = torch.rand(m, EXPERTS, generator=g).topk(TOP_K, dim=1).indices.to(torch.int32).cuda()
        weights = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=1).cuda()

        fc1 = w4a16_moe_gemm(bundle, x, w13, ids)
        act = moe_activation(bundle, fc1, activation="silu")
        fc2 = w4a16_moe_gemm(bundle, act, w2, ids, topk_weights=weights, mul_topk_weights=True, a_per_route=True)
        out = torch.full((m, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
        moe_topk_sum(bundle, fc2.view(m, TOP_K, HIDDEN), out)
        torch.cuda.synchronize()

        e = ids.view(-1).long()
        h = torch.einsum("rk,rnk->rn", x.float().repeat_interleave(TOP_K, 0), w13_f[e])
        a = torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]
        y = torch.einsum("rk,rnk->rn", a, w2_f[e]) * weights.view(-1, 1)
        ref = y.view(m, TOP_K, HIDDEN).sum(1)
        err = float((out.float() - ref).norm() / ref.norm())
        assert not out.isnan().any()
        assert err <= 1e-2, f"M={m}: rel err {err:.2e}"
        worst = max(worst, err)
    print(f"moe layer (unfused) bf16: worst rel err {worst:.2e}")
