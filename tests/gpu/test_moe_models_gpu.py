"""Every model of specs/moe-models.yaml through MoeLayer on the H200, against the float32 reference.

Bundle: `cuteaot build specs/moe-models.yaml --targets h200` (CUTEAOT_MODELS_BUNDLE to override).
Weights are fresh random NVFP4 per expert (quantised on the GPU), inputs fresh per M, outputs
poisoned with NaN; the reference runs one float32 matmul per expert on the dequantised weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cuteaot.runtime import load_bundle, prepare_w2, prepare_w2_mxfp4, prepare_w13, prepare_w13_mxfp4
from cuteaot.runtime.kernels.w4a16.fused_spec import PACK_MAX_ROUTES
from cuteaot.runtime.moe import MoeLayer
from tests.reference.moe import moe_reference, skewed_topk_ids
from tests.reference.mxfp4 import dequantize_mxfp4, random_mxfp4
from tests.reference.nvfp4 import dequantize_modelopt, random_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
# 12000: 256-row blocks (two warpgroups) in every layer that takes them (measured_blocks.json "wide")
TOKENS = (1, 2, 3, 4, 8, 16, 37, 64, 512, 1000, 4096, 12000)
OAI = dict(alpha=1.702, beta=1.0, limit=7.0)
# the problems of specs/moe-models.yaml: name -> (H, I, E, top_k, activation)
PROBLEMS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, "silu"),
    "qwen3-235b-a22b-tp1": (4096, 1536, 128, 8, "silu"),
    "qwen3-235b-a22b-tp2": (4096, 768, 128, 8, "silu"),
    "qwen3-235b-a22b-tp4": (4096, 384, 128, 8, "silu"),
    "qwen3-235b-a22b-tp8": (4096, 192, 128, 8, "silu"),
    "gpt-oss-120b": (2880, 2880, 128, 4, "swigluoai"),
    "gpt-oss-20b": (2880, 2880, 32, 4, "swigluoai"),
    "glm-4.5-air": (4096, 1408, 128, 8, "silu"),
    "nemotron-3-nano": (2688, 1856, 128, 6, "relu2"),
    "mixtral-8x7b": (4096, 14336, 8, 2, "silu"),
}


@pytest.fixture(scope="module")
def bundle():
    path = Path(os.environ.get("CUTEAOT_MODELS_BUNDLE", ROOT / "generated" / "moe-models"))
    if not (path / "manifest.json").is_file():
        pytest.fail(f"{path} is not built: run `cuteaot build specs/moe-models.yaml --targets h200` first")
    return load_bundle(path)


def test_bundle_serves_every_listed_model(bundle):
    assert {row["problem"] for row in bundle.manifest["resolution"]} == set(PROBLEMS)


def _assert_matches_reference(layer, label, g, h, e, top_k, act, w13_f, w2_f, tokens=TOKENS, skewed=(False,),
                              **bias):
    """Every M of `tokens`, with uniform routing and (skewed) routing where 80 % of the tokens put experts 0 and 1
    first: fresh inputs, output poisoned, rel err <= 1e-2 against the float32 reference."""
    worst = 0.0
    for m in tokens:
        for skew in skewed:
            x = torch.randn(m, h, generator=g, device="cuda").to(torch.bfloat16)
            ids = (skewed_topk_ids(m, e, top_k, g) if skew
                   else torch.rand(m, e, generator=g, device="cuda").topk(top_k, dim=1).indices.to(torch.int32))
            weights = torch.softmax(torch.randn(m, top_k, generator=g, device="cuda"), dim=1)
            out = layer(x, weights, ids, out=torch.full((m, h), float("nan"), dtype=torch.bfloat16, device="cuda"))
            ref, _, _ = moe_reference(x, w13_f, w2_f, weights, ids, act, **(OAI if act == "swigluoai" else {}), **bias)
            where = f"{label} M={m} skewed={skew} ({layer.resolve(m).describe()})"
            assert not out.isnan().any(), f"{where}: NaN in the output"
            err = float((out.float() - ref).norm() / ref.norm())
            assert err <= 1e-2, f"{where}: rel err {err:.2e}"
            worst = max(worst, err)
    print(f"\n{label:24s} worst rel err {worst:.2e} over M in {tuple(tokens)}, skewed {skewed}")


def _nvfp4_layer(bundle, name, g, **layer_args):
    """The problem's MoeLayer on fresh random NVFP4 weights, and the dequantised (w13, w2) of the reference."""
    h, i, e, top_k, act = PROBLEMS[name]
    q13 = random_nvfp4(e, 2 * i if act != "relu2" else i, h, g)
    q2 = random_nvfp4(e, h, i, g)
    layer = MoeLayer(bundle, prepare_w13(*q13, "bf16"), prepare_w2(*q2, "bf16"), top_k=top_k, activation=act,
                     **layer_args)
    return layer, dequantize_modelopt(*q13), dequantize_modelopt(*q2)


def _packing_tokens(layer) -> tuple[int, ...]:
    """For each fused kernel of the layer that packs its routes itself, the largest M it serves."""
    largest = {}  # kernel digest -> the largest M it packs
    for m in range(1, PACK_MAX_ROUTES // layer.top_k + 1):
        r = layer.resolve(m)
        if r.packs_routes:
            largest[r.launch.kernels["fused"]] = m
    return tuple(sorted(largest.values()))


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_model_layer_matches_reference(bundle, name):
    h, i, e, top_k, act = PROBLEMS[name]
    g = torch.Generator(device="cuda").manual_seed(len(name))
    layer, w13_f, w2_f = _nvfp4_layer(bundle, name, g)
    _assert_matches_reference(layer, name, g, h, e, top_k, act, w13_f, w2_f)


@pytest.mark.parametrize("name", ["gpt-oss-120b", "gpt-oss-20b"])
def test_gpt_oss_mxfp4_with_biases_matches_reference(bundle, name):
    """The checkpoint's format: MXFP4 blocks/scales with interleaved gate/up rows and expert biases.

    Scales spread over 2**-12 .. 2**-2 (e8m0 115..125); the reference dequantizes from the MXFP4
    definition and splits gate (even rows) and up (odd rows) as gpt-oss does."""
    h, i, e, top_k, act = PROBLEMS[name]
    g = torch.Generator(device="cuda").manual_seed(len(name) + 1)
    blocks13, scales13 = random_mxfp4(e, 2 * i, h, g, spread=5, center=120)
    blocks2, scales2 = random_mxfp4(e, h, i, g, spread=5, center=120)
    bias13 = (torch.randn(e, 2 * i, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    bias2 = (torch.randn(e, h, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    layer = MoeLayer(bundle, prepare_w13_mxfp4(blocks13, scales13, "bf16", bias=bias13),
                     prepare_w2_mxfp4(blocks2, scales2, "bf16", bias=bias2), top_k=top_k, activation=act)
    w13_f = dequantize_mxfp4(blocks13, scales13)
    w13_f = torch.cat((w13_f[:, 0::2], w13_f[:, 1::2]), dim=1)
    b13 = torch.cat((bias13[:, 0::2], bias13[:, 1::2]), dim=1)
    tokens = sorted(set(TOKENS) | set(_packing_tokens(layer)))  # biased layers have their own kernels
    _assert_matches_reference(layer, f"{name} mxfp4+bias", g, h, e, top_k, act, w13_f,
                              dequantize_mxfp4(blocks2, scales2), tokens=tokens, b13=b13, b2=bias2)


# token counts at which a layer may run 128-row blocks (the measured "tallwide" ranges lie among them)
TALL_TOKENS = (384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


def _two_warpgroup_tall(resolved) -> bool:
    return resolved.launch.split and any(k.spec.moe_block_size == 128 and k.spec.threads == 256
                                         for k in resolved.kernels.values())


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_tall_blocks_on_two_warpgroups_match_reference(bundle, name):
    """Where the measured "tallwide" choice (measured_blocks.json) runs a layer's 128-row blocks on the 256-wide
    tile of two warpgroups: uniform routing and skewed routing (80 % of the tokens put experts 0 and 1 first:
    many full blocks there, part-filled ones elsewhere), output poisoned, against the float32 reference."""
    h, i, e, top_k, act = PROBLEMS[name]
    g = torch.Generator(device="cuda").manual_seed(7 * len(name))
    layer, w13_f, w2_f = _nvfp4_layer(bundle, name, g)
    ms = [m for m in TALL_TOKENS if _two_warpgroup_tall(layer.resolve(m))]
    if not ms:
        pytest.skip(f"{name}: no token count of {TALL_TOKENS} takes the two-warpgroup 128-row tile")
    _assert_matches_reference(layer, f"{name} two warpgroups", g, h, e, top_k, act, w13_f, w2_f, tokens=ms,
                              skewed=(False, True))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_every_in_kernel_packing_kernel_matches_reference(bundle, name, deterministic):
    """Each fused kernel that packs its routes itself (FusedSpec.pack_experts, mma.sync and wgmma loops) at the
    largest M it serves up to the packing limit: skewed and uniform routing, output poisoned, float32 reference.
    Deterministic layers have their own plans (the one wgmma packing kernel of moe-models: Qwen3-235B tp8)."""
    h, i, e, top_k, act = PROBLEMS[name]
    g = torch.Generator(device="cuda").manual_seed(11 * len(name) + deterministic)
    layer, w13_f, w2_f = _nvfp4_layer(bundle, name, g, deterministic=deterministic)
    tokens = _packing_tokens(layer)
    if not tokens:
        pytest.skip(f"{name}: no plan packs its routes in the kernel")
    _assert_matches_reference(layer, f"{name} in-kernel packing", g, h, e, top_k, act, w13_f, w2_f,
                              tokens=tokens, skewed=(False, True))
