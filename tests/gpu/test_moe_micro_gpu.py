"""The micro kernel (FusedSpec.micro: decode without a grid barrier) on the GPU, against a float32 reference.

Bundles: specs/tiny-micro.yaml planned by the rule and with the micro kernel wherever it runs
(`python -m benchmarks.tune_blocks build specs/tiny-micro.yaml --knob micro,microstored --targets h200 --out
generated/tune-micro`; CUTEAOT_MICRO_BUNDLES names another such directory).  Every test draws fresh
random weights and inputs and poisons the output first; the weights are packed, or read as ModelOpt stores
them (its "micro-stored-*" problems).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch

from cuteaot.runtime import load_bundle, prepare_w2, prepare_w2_modelopt, prepare_w13, prepare_w13_modelopt
from cuteaot.runtime.moe import MoeLayer
from tests.gpu.test_moe_fused_gpu import on_two_streams, poisoned, rel_err, replayed
from tests.reference.moe import moe_reference, skewed_topk_ids
from tests.reference.nvfp4 import dequantize_modelopt, quantize_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
# name -> (H, I, E, top_k, activation, dtype): the problems of specs/tiny-micro.yaml
PROBLEMS = {
    "silu-bf16": (512, 256, 16, 4, "silu", "bf16"),
    "silu-fp16": (512, 256, 16, 4, "silu", "fp16"),
    "swigluoai": (576, 384, 8, 2, "swigluoai", "bf16"),
    "relu2": (640, 256, 8, 3, "relu2", "bf16"),
    "many-items": (512, 2048, 16, 8, "silu", "bf16"),  # M = 2: 512 work items on 264 CTAs
}
# the "micro-stored-*" problems, read as stored: name -> (H, I, E, top_k, activation, dtype, W13 orders)
STORED = {
    "stored-silu-bf16": (512, 256, 16, 4, "silu", "bf16", ("gate_up", "up_gate")),
    "stored-silu-fp16": (512, 256, 16, 4, "silu", "fp16", ("gate_up", "up_gate")),
    "stored-relu2": (640, 256, 8, 3, "relu2", "bf16", ("gate_up",)),
    "stored-swigluoai-bias": (576, 384, 8, 2, "swigluoai", "bf16", ("up_gate",)),  # H = 64 (mod 128)
}
OAI = dict(alpha=1.702, beta=1.0, limit=7.0)
TOL = 1e-2


def _bundle(policy: str):
    root = Path(os.environ.get("CUTEAOT_MICRO_BUNDLES", ROOT / "generated" / "tune-micro"))
    path = root / policy / "tiny-micro"
    if not (path / "manifest.json").exists():
        pytest.skip(f"no {path}: python -m benchmarks.tune_blocks build specs/tiny-micro.yaml --knob micro "
                    f"--targets h200 --out {root}")
    return load_bundle(path)


@pytest.fixture(scope="module")
def micro():
    return _bundle("always")


@pytest.fixture(scope="module")
def rule():
    return _bundle("rule")


class Model:
    def __init__(self, name: str):
        h, i, e, top_k, activation, dtype = PROBLEMS[name]
        self.h, self.e, self.top_k, self.activation, self.dtype = h, e, top_k, activation, dtype
        self.g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        n1 = 2 * i if activation != "relu2" else i
        q13 = quantize_nvfp4(torch.randn(e, n1, h, generator=self.g) * 0.05)
        q2 = quantize_nvfp4(torch.randn(e, h, i, generator=self.g) * 0.05)
        self.q13, self.q2 = q13, q2
        self.w13, self.w2 = prepare_w13(*q13, dtype).to("cuda"), prepare_w2(*q2, dtype).to("cuda")
        self.w13_f, self.w2_f = dequantize_modelopt(*q13).cuda(), dequantize_modelopt(*q2).cuda()
        self.ref_kw = OAI if activation == "swigluoai" else {}

    def layer(self, bundle) -> MoeLayer:
        return MoeLayer(bundle, self.w13, self.w2, top_k=self.top_k, activation=self.activation)

    def inputs(self, m: int, skewed: bool = False):
        torch_dtype = torch.bfloat16 if self.dtype == "bf16" else torch.float16
        x = (torch.randn(m, self.h, generator=self.g) * 2).to(torch_dtype)
        if skewed:
            ids = skewed_topk_ids(m, self.e, self.top_k, self.g)
        else:
            ids = torch.rand(m, self.e, generator=self.g).topk(self.top_k, dim=1).indices.to(torch.int32)
        weights = torch.softmax(torch.randn(m, self.top_k, generator=self.g), dim=1)
        return x.cuda(), weights.cuda(), ids.cuda()

    def reference(self, x, w, ids):
        return moe_reference(x, self.w13_f, self.w2_f, w, ids, self.activation, **self.ref_kw)[0]


class StoredModel(Model):
    """A problem's weights as a ModelOpt checkpoint stores them: gate and up quantized apart (two global
    scales), W13 gate rows first or up rows first (`order`), optional biases; the reference in [gate | up]
    order."""

    def __init__(self, name: str, order: str):
        h, i, e, top_k, activation, dtype, _ = STORED[name]
        self.h, self.e, self.top_k, self.activation, self.dtype = h, e, top_k, activation, dtype
        self.g = g = torch.Generator().manual_seed(zlib.crc32(f"{name} {order}".encode()))
        gated = activation != "relu2"
        halves = [quantize_nvfp4(torch.randn(e, i, h, generator=g) * s) for s in ((0.05, 0.2) if gated else (0.05,))]
        self.w13_f = torch.cat([dequantize_modelopt(*q) for q in halves], dim=1).cuda()  # [gate | up]
        stored = halves[::-1] if order == "up_gate" else halves
        weight, weight_scale = (torch.cat([q[j] for q in stored], dim=1).cuda() for j in (0, 1))
        scale_2 = (torch.stack([q[2] for q in halves], dim=1) if gated else halves[0][2]).cuda()
        q2 = quantize_nvfp4(torch.randn(e, h, i, generator=g) * 0.05)
        self.w2_f = dequantize_modelopt(*q2).cuda()
        self.bias = {}
        b13 = None
        if "bias" in name:
            self.bias = dict(b13=(torch.randn(e, 2 * i, generator=g) * 0.2).to(torch.bfloat16).cuda(),
                             b2=(torch.randn(e, h, generator=g) * 0.2).to(torch.bfloat16).cuda())
            b13 = self.bias["b13"]
            if order == "up_gate":  # as the checkpoint stores it: up first
                b13 = torch.cat((b13[:, i:], b13[:, :i]), dim=1)
        self.w13 = prepare_w13_modelopt(weight, weight_scale, scale_2, dtype, order=order, gated=gated, bias=b13)
        self.w2 = prepare_w2_modelopt(*(t.cuda() for t in q2), dtype, bias=self.bias.get("b2"))
        self.ref_kw = dict(OAI if activation == "swigluoai" else {}, **self.bias)


def assert_clean(layer) -> None:
    """Every lock word but the barrier's top bit back at zero: the micro kernel's counter and sums too."""
    locks = layer.workspace().locks.cpu()
    assert int(locks[0]) & 0x7FFFFFFF == 0 and int(locks[1:].abs().sum()) == 0, "dirty workspace"


def check_against_reference(model, micro, rule, label: str, worst_errors) -> MoeLayer:
    """M = 1, 2 on the micro kernel, back to 1 after a larger launch (the sums were cleaned), then 3 (not micro);
    uniform and skewed routing; the persistent kernel on the same inputs; the workspace clean after each M."""
    layer, persistent = model.layer(micro), model.layer(rule)
    for m in (1, 2, 1, 3):
        fused = layer.resolve(m).kernels.get("fused")
        assert bool(fused is not None and fused.spec.micro) == (m <= 2), f"M={m}: the plan is not the tested one"
        for skewed in (False, True):
            x, w, ids = model.inputs(m, skewed)
            out = layer(x, w, ids, out=poisoned(m, model.h, model.dtype))
            ref = model.reference(x, w, ids)
            assert not out.isnan().any(), f"{label} M={m}: a row was never written"
            err = rel_err(out, ref)
            worst_errors.record(f"micro {label}", err)
            assert err <= TOL, f"{label} M={m} skewed={skewed}: rel err {err:.2e}"
            assert rel_err(persistent(x, w, ids), ref) <= TOL
        assert_clean(layer)
    return layer


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_micro_layer_matches_reference(micro, rule, name, worst_errors):
    check_against_reference(Model(name), micro, rule, name, worst_errors)


@pytest.mark.parametrize("name, order", [(n, o) for n, p in STORED.items() for o in p[-1]])
def test_micro_stored_layer_matches_reference(micro, rule, name, order, worst_errors):
    """The micro kernel on weights read as stored (FC2's k-contiguous rows loaded straight into registers, the
    MMA's k slots relabelled), against the float32 reference and the persistent decode kernel."""
    layer = check_against_reference(StoredModel(name, order), micro, rule, f"{name} {order}", worst_errors)
    assert layer.facts.weights.value == ("modelopt_w31" if order == "up_gate" else "modelopt")


def test_micro_biases(micro, worst_errors):
    """FC1's bias in its epilogue, FC2's (times the router weight) added once per route."""
    model = Model("swigluoai")
    dt = torch.bfloat16
    b13 = (torch.randn(model.e, model.w13.n, generator=model.g) * 0.5).to(dt)
    b2 = (torch.randn(model.e, model.h, generator=model.g) * 0.5).to(dt)
    w13 = prepare_w13(*model.q13, model.dtype, bias=b13).to("cuda")
    w2 = prepare_w2(*model.q2, model.dtype, bias=b2).to("cuda")
    layer = MoeLayer(micro, w13, w2, top_k=model.top_k, activation=model.activation)
    for m in (1, 2):
        assert layer.resolve(m).kernels["fused"].spec.micro and layer.facts.bias
        x, w, ids = model.inputs(m)
        out = layer(x, w, ids, out=poisoned(m, model.h, model.dtype))
        ref, _, _ = moe_reference(x, model.w13_f, model.w2_f, w, ids, model.activation, b13=b13.cuda(),
                                  b2=b2.cuda(), **model.ref_kw)
        err = rel_err(out, ref)
        worst_errors.record("micro swigluoai+bias", err)
        assert err <= TOL, f"M={m}: rel err {err:.2e}"
    assert_clean(layer)


def test_micro_drops_masked_and_out_of_range_routes(micro):
    """A route id outside [0, E) (-1: masked; E: a caller's bug) adds nothing: the others' sum is the output."""
    model = Model("silu-bf16")
    layer = model.layer(micro)
    x, w, ids = model.inputs(2)
    bad = ids.clone()
    bad[0, 1] = -1
    bad[1, 3] = model.e
    out = layer(x, w, bad, out=poisoned(2, model.h, model.dtype))
    dropped = w.clone()
    dropped[0, 1] = 0
    dropped[1, 3] = 0
    assert rel_err(out, model.reference(x, dropped, ids)) <= TOL
    every = torch.full_like(ids, -1)  # no route at all: zeros, every row written
    out = layer(x, w, every, out=poisoned(2, model.h, model.dtype))
    assert torch.equal(out, torch.zeros_like(out))
    assert_clean(layer)


def test_micro_graph_replay_and_two_streams(micro):
    model = Model("many-items")
    layer = model.layer(micro)
    assert layer.resolve(2).kernels["fused"].spec.micro
    eager, out = replayed(layer, *model.inputs(2), times=5)
    assert rel_err(out, eager.float()) <= 5e-3  # float32 sums in no fixed order: the last bf16 bit may differ
    assert_clean(layer)
    data = [model.inputs(m) for m in (1, 2)]
    want = [layer(*d).clone() for d in data]
    for o, t in zip(on_two_streams(layer, data), want):
        assert rel_err(o, t.float()) <= 5e-3
