"""Layers whose weights are read as ModelOpt stores them (weights: modelopt / modelopt_w31), on the
GPU, against the float32 reference on the dequantized checkpoint tensors (tests/reference/nvfp4.py).

Bundle: specs/tiny-modelopt.yaml.  Gate and up are quantized separately, so W13 carries two
different global scales per expert ((E, 2) weight_scale_2), which this layout keeps exactly.
"""

from __future__ import annotations

import pytest
import torch

from cuteaot.runtime import load_bundle, prepare_w13_modelopt, prepare_w2_modelopt
from cuteaot.runtime.moe import MoeLayer
from tests.gpu.test_moe_fused_gpu import (  # noqa: F401 -- check is a fixture
    OAI, assert_clean, check, poisoned, rel_err, replayed, routed_inputs,
)
from tests.reference.moe import moe_reference
from tests.reference.nvfp4 import dequantize_modelopt, quantize_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

# name -> (H, I, E, top_k, activation, dtype, W13 row orders built), the problems of specs/tiny-modelopt.yaml
PROBLEMS = {
    "silu": (512, 384, 16, 4, "silu", "bf16", ("gate_up", "up_gate")),
    "silu-fp16": (512, 256, 16, 4, "silu", "fp16", ("gate_up",)),
    "swigluoai-bias": (512, 256, 8, 2, "swigluoai", "bf16", ("up_gate",)),
    "relu2-fp16": (768, 384, 8, 3, "relu2", "fp16", ("gate_up",)),
    "wide": (1024, 1024, 8, 2, "silu", "bf16", ("up_gate",)),
    # sizes 64 (mod 128): a last N tile masked past N, 64-deep k-tiles
    "relu2-tail": (512, 320, 8, 3, "relu2", "bf16", ("gate_up",)),
    "silu-tail": (576, 192, 16, 4, "silu", "bf16", ("gate_up", "up_gate")),
}
TOKENS = (1, 2, 3, 7, 8, 37, 64, 129, 512, 1000, 3000)


@pytest.fixture(scope="module")
def bundle(modelopt_bundle_dir):
    return load_bundle(modelopt_bundle_dir)


class Checkpoint:
    """Random weights of one problem as a ModelOpt checkpoint stores them (gate and up quantized apart,
    so with two global scales), and their float32 dequantization in the kernels' [gate | up] order."""

    def __init__(self, name: str, order: str, seed: int):
        h, i, e, top_k, activation, dtype, _ = PROBLEMS[name]
        self.h, self.e, self.top_k, self.activation, self.dtype = h, e, top_k, activation, dtype
        self.g = g = torch.Generator().manual_seed(seed)
        gated = activation != "relu2"
        halves = [quantize_nvfp4(torch.randn(e, i, h, generator=g) * s) for s in ((0.05, 0.2) if gated else (0.05,))]
        self.w13_f = torch.cat([dequantize_modelopt(*q) for q in halves], dim=1).cuda()  # [gate | up]
        stored = halves[::-1] if order == "up_gate" else halves
        self.w13 = [torch.cat([q[j] for q in stored], dim=1).cuda() for j in (0, 1)]  # weight, weight_scale
        self.w13_scale_2 = (torch.stack([q[2] for q in halves], dim=1) if gated else halves[0][2]).cuda()
        q2 = quantize_nvfp4(torch.randn(e, h, i, generator=g) * 0.05)
        self.w2 = [t.cuda() for t in q2]
        self.w2_f = dequantize_modelopt(*q2).cuda()
        self.order, self.gated = order, gated
        self.bias = {}
        if "bias" in name:
            self.bias = dict(b13=(torch.randn(e, 2 * i, generator=g) * 0.2).to(torch.bfloat16).cuda(),
                             b2=(torch.randn(e, h, generator=g) * 0.2).to(torch.bfloat16).cuda())

    def stored_bias13(self):
        b = self.bias.get("b13")
        if b is None or self.order == "gate_up":
            return b
        half = b.shape[1] // 2
        return torch.cat((b[:, half:], b[:, :half]), dim=1)  # as the checkpoint stores it (up first)

    def layer(self, bundle, **kw) -> MoeLayer:
        w13 = prepare_w13_modelopt(*self.w13, self.w13_scale_2, self.dtype, order=self.order, gated=self.gated,
                                   bias=self.stored_bias13())
        w2 = prepare_w2_modelopt(*self.w2, self.dtype, bias=self.bias.get("b2"))
        return MoeLayer(bundle, w13, w2, top_k=self.top_k, activation=self.activation, **kw)

    def reference(self, x, w, ids, **kw):
        extra = dict(OAI if self.activation == "swigluoai" else {}, **self.bias)
        return moe_reference(x, self.w13_f, self.w2_f, w, ids, self.activation, **extra, **kw)[0]


CASES = [(name, order) for name, p in PROBLEMS.items() for order in p[-1]]


@pytest.mark.parametrize("name, order", CASES)
def test_modelopt_layer_matches_reference(bundle, check, name, order):
    ckpt = Checkpoint(name, order, seed=61)
    layer = ckpt.layer(bundle)
    assert layer.facts.weights.value == ("modelopt_w31" if order == "up_gate" else "modelopt")
    assert layer.w13.qweight.data_ptr() == ckpt.w13[0].data_ptr()  # read as stored: no copy
    activated_in_fc1 = masked = 0
    for m in TOKENS:
        x, w, ids = routed_inputs(m, ckpt.h, ckpt.e, ckpt.top_k, ckpt.g, ckpt.dtype)
        out = layer(x, w, ids, out=poisoned(m, ckpt.h, ckpt.dtype))
        r = layer.resolve(m)
        check(out, ckpt.reference(x, w, ids), f"{name} {order} M={m} ({r.describe()})", f"modelopt {name} {order}")
        assert_clean(layer.workspace())
        fused = None if r.launch.split else r.kernels["fused"].spec
        gemms = (fused.fc1_gemm, fused.fc2_gemm) if fused is not None else (r.kernels["fc1"].spec, r.kernels["fc2"].spec)
        # a last N tile is masked exactly where a tile does not divide its GEMM's N (the stored layout's 64-wide
        # deep tiles divide N = 320 where 128-wide ones do not)
        assert any(g.n_tail for g in gemms) == any(g.n % g.tile_n for g in gemms), r.describe()
        masked += any(g.n_tail for g in gemms)
        if ckpt.gated and fused is not None and fused.fc1_tile_n % 128 == 0:
            assert fused.gated_epilogue, r.describe()  # FC1 activates: gate | up slabs of one tile
            activated_in_fc1 += 1
    assert activated_in_fc1 or not ckpt.gated, "no fused plan of a gated layer took the gated epilogue"
    assert (masked > 0) == name.endswith("-tail"), (name, masked)  # a tail problem's plans mask, others' do not


def test_modelopt_large_m_runs_the_wgmma_loop(bundle):
    """From the M where packed NVFP4 splits into two wgmma GEMMs, the stored layout does too (the
    numerics of those plans are in the tests above: M = 1000 and 3000)."""
    plans = {name: Checkpoint(name, PROBLEMS[name][-1][0], seed=60).layer(bundle).resolve(3000).describe()
             for name in PROBLEMS}
    assert all(p.startswith("split ") and "wgmma" in p for p in plans.values()), plans
    assert "b256" in plans["wide"], plans["wide"]  # two warpgroups per CTA


def test_modelopt_skewed_routing(bundle, check):
    """Most tokens on two experts: long experts, many full blocks, split-K tails."""
    ckpt = Checkpoint("silu", "up_gate", seed=62)
    layer = ckpt.layer(bundle)
    for m in (129, 1000, 3000):
        x, w, _ = routed_inputs(m, ckpt.h, ckpt.e, ckpt.top_k, ckpt.g)
        scores = torch.rand(m, ckpt.e, generator=ckpt.g)
        scores[torch.rand(m, generator=ckpt.g) < 0.8, :] += torch.isin(torch.arange(ckpt.e), torch.tensor([3, 11])).float()
        ids = scores.topk(ckpt.top_k, dim=1).indices.to(torch.int32).cuda()  # 80 % of tokens on experts 3 and 11
        out = layer(x, w, ids, out=poisoned(m, ckpt.h, "bf16"))
        check(out, ckpt.reference(x, w, ids), f"skewed M={m}", "modelopt silu skewed")


def test_modelopt_router_weight_on_input_and_expert_map(bundle, check):
    ckpt = Checkpoint("silu", "gate_up", seed=63)
    layer = ckpt.layer(bundle, router_weight_on_input=True)
    for m in (1, 7, 129, 1000):
        x, w, ids = routed_inputs(m, ckpt.h, ckpt.e, ckpt.top_k, ckpt.g)
        out = layer(x, w, ids, out=poisoned(m, ckpt.h, "bf16"))
        check(out, ckpt.reference(x, w, ids, on_input=True), f"on_input M={m}", "modelopt silu on_input")
    local = torch.arange(ckpt.e, device="cuda", dtype=torch.int32)
    local[::3] = -1  # every third expert lives on another rank
    mapped = ckpt.layer(bundle, expert_map=local)
    for m in (1, 64, 1000):
        x, w, ids = routed_inputs(m, ckpt.h, ckpt.e, ckpt.top_k, ckpt.g)
        out = mapped(x, w, ids, out=poisoned(m, ckpt.h, "bf16"))
        keep = (local[ids.long()] >= 0).float()
        check(out, ckpt.reference(x, w * keep, ids), f"expert_map M={m}", "modelopt silu expert_map")


def test_modelopt_graph_replay_equals_eager(bundle):
    ckpt = Checkpoint("swigluoai-bias", "up_gate", seed=65)
    layer = ckpt.layer(bundle)
    for m in (1, 64, 1000):
        eager, out = replayed(layer, *routed_inputs(m, ckpt.h, ckpt.e, ckpt.top_k, ckpt.g))
        tol = 0 if m > 2 else 5e-3  # decode sums the top-k rows with bf16 atomics (order varies)
        assert rel_err(out, eager.float()) <= tol, m
