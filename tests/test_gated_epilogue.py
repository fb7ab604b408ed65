"""FC1's gated epilogue (GemmSpec epilogue silu / swigluoai, both loops): what the spec accepts, what
its key holds, and where layer planning chooses it (split layers, and the fused kernel's FC1).  The kernel itself is checked on the GPU
(tests/gpu/test_moe_fused_gpu.py::test_gated_fc1_epilogue); the default bundle's build compiles one
(tests/test_default_bundle.py)."""

from __future__ import annotations

import dataclasses

import pytest

from cuteaot.codegen.kernels.w4a16 import fused_planning
from cuteaot.codegen.kernels.w4a16.fused_planning import split_layer
from cuteaot.runtime import PROFILES, BadInputError
from cuteaot.runtime.kernels.w4a16.gemm_spec import Epilogue, GemmSpec
from cuteaot.runtime.resolution import MoeLayerFacts
from cuteaot.runtime.types import Activation, DType, WeightFormat

H200 = PROFILES["h200"]
QWEN3 = MoeLayerFacts(dtype=DType.BF16, hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8,
                      activation=Activation.SILU)
GPT_OSS = MoeLayerFacts(dtype=DType.BF16, hidden_size=2880, intermediate_size=2880, num_experts=128, top_k=4,
                        activation=Activation.SWIGLUOAI, bias=True)


def _fc1(**kw) -> GemmSpec:
    base = dict(dtype="bf16", n=1536, k=2048, top_k=8, tile_n=128, tile_k=64, moe_block_size=128, blocks_per_sm=2,
                mainloop="wgmma", epilogue="silu", fast_math=True)
    return GemmSpec(**{**base, **kw})


def test_gated_spec_geometry_and_activation():
    spec = _fc1()
    assert spec.epilogue.is_gated and not Epilogue.RELU2.is_gated and not Epilogue.NONE.is_gated
    assert (spec.out_width, spec.bias_width) == (768, 1536)  # writes I columns, reads the 2I-wide bias
    act = spec.activation_spec
    assert (act.activation, act.intermediate_size, act.fast_math) == (Activation.SILU, 768, True)
    oai = _fc1(epilogue="swigluoai", swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0)
    assert (oai.activation_spec.swiglu_alpha, oai.activation_spec.swiglu_limit) == (1.702, 7.0)
    assert type(oai).from_facts(oai.key().facts) == oai


def test_gated_facts_stay_out_of_other_keys():
    plain = _fc1(epilogue="none", fast_math=None)
    assert not {"fast_math", "swiglu_alpha", "swiglu_beta", "swiglu_limit"} & set(plain.key().facts)
    assert _fc1().key().facts["fast_math"] is True
    assert _fc1().key() != _fc1(fast_math=False).key()


@pytest.mark.parametrize("kw, match", [
    (dict(mainloop="mma_sync", tile_n=64, tile_k=128, moe_block_size=32), "multiples of 128"),
    (dict(n_out=1528), "unpadded N"),
    (dict(fast_math=None), "fast_math True or False"),
    (dict(epilogue="swigluoai"), "swiglu parameters"),  # ActivationSpec.create would fill them
    (dict(epilogue="none"), "belong to the gated epilogues"),
    (dict(epilogue="relu2", fast_math=None, swiglu_limit=7.0), "belong to the gated epilogues"),
    (dict(swiglu_alpha=1.0), "swiglu_alpha/swiglu_beta apply to swigluoai only"),
])
def test_gated_spec_refuses(kw, match):
    with pytest.raises(BadInputError, match=match):
        _fc1(**kw)


def test_split_layers_apply_the_activation_in_fc1():
    for facts, m in ((QWEN3, 4096), (GPT_OSS, 4096), (dataclasses.replace(QWEN3, dtype=DType.FP16), 16384)):
        fc1, fc2 = split_layer(m, facts, H200)
        assert fc1.spec.epilogue.value == facts.activation.value and fc2.spec.epilogue is Epilogue.NONE
        assert fc1.spec.activation_spec.fast_math == facts.fast_math
        assert (fc1.spec.swiglu_alpha, fc1.spec.swiglu_limit) == (facts.swiglu_alpha, facts.swiglu_limit)
        assert fc1.spec.bias == facts.bias


def test_padded_or_switched_off_fc1_keeps_the_activation_kernel(monkeypatch):
    padded = MoeLayerFacts(dtype=DType.BF16, hidden_size=736, intermediate_size=352, num_experts=8, top_k=2,
                           activation=Activation.SWIGLUOAI)  # 2I = 704, stored as 768: no whole gate | up slabs
    assert split_layer(4096, padded, H200)[0].spec.epilogue is Epilogue.NONE
    relu2 = dataclasses.replace(QWEN3, activation=Activation.RELU2)
    assert split_layer(4096, relu2, H200)[0].spec.epilogue is Epilogue.RELU2
    monkeypatch.setattr(fused_planning, "GATED_FC1_EPILOGUE", False)
    assert split_layer(4096, QWEN3, H200)[0].spec.epilogue is Epilogue.NONE


def test_fused_kernels_activate_in_fc1_where_the_tiles_allow(monkeypatch):
    """The fused kernel's FC1 applies a gated activation in its epilogue (no activation pass, one grid
    barrier fewer) for every weight format (NVFP4 packed or read as stored, NF3) with unpadded 2I and
    128-multiple tiles, on both loops; a w31 layer's FC1 reads its rows rotated, each slab with its half's
    global scale."""
    cases = [(QWEN3, 1), (QWEN3, 8), (QWEN3, 256), (GPT_OSS, 1), (GPT_OSS, 256),
             (dataclasses.replace(QWEN3, expert_map=True), 4096),  # (the fused wgmma loop: no split there)
             # stored rows, gate | up slabs (its decode tiles: 8-row packed blocks take 64-wide deep tiles, which
             # activate in a pass, tests/test_modelopt.py)
             (dataclasses.replace(QWEN3, weights=WeightFormat.MODELOPT), 1),
             (dataclasses.replace(QWEN3, weights=WeightFormat.MODELOPT_W31), 2),
             (dataclasses.replace(QWEN3, weights=WeightFormat.NF3), 1),  # NF3 slabs
             (dataclasses.replace(QWEN3, weights=WeightFormat.NF3), 37)]
    for facts, m in cases:
        plan = fused_planning.plan_layer(m, facts, H200)
        spec = fused_planning.fused_spec_for(plan, facts)
        assert spec.gated_epilogue is True, (facts, m)
        fc1 = spec.fc1_gemm
        assert fc1.epilogue.value == facts.activation.value and fc1.out_width == facts.intermediate_size
        assert (fc1.fast_math, fc1.swiglu_limit) == (facts.fast_math, facts.swiglu_limit)
        assert spec.fc2_gemm.epilogue is Epilogue.NONE
        assert "gated_epilogue" in spec.key().facts
        assert type(spec).from_facts(spec.key().facts) == spec
    assert any(fused_planning.fused_spec_for(fused_planning.plan_layer(m, f, H200), f).mainloop.value == "wgmma"
               for f, m in cases)
    padded = MoeLayerFacts(dtype=DType.BF16, hidden_size=736, intermediate_size=352, num_experts=8, top_k=2,
                           activation=Activation.SWIGLUOAI)
    relu2 = dataclasses.replace(QWEN3, activation=Activation.RELU2)
    nf3_tall = dataclasses.replace(QWEN3, weights=WeightFormat.NF3)  # 32-row blocks at M = 256: measured slower
    assert fused_planning.plan_layer(256, nf3_tall, H200).moe_block_size > fused_planning.NF3_GATED_MAX_BLOCK
    for facts, m in ((padded, 8), (relu2, 8), (nf3_tall, 256)):
        spec = fused_planning.fused_spec_for(fused_planning.plan_layer(m, facts, H200), facts)
        assert spec.gated_epilogue is None and "gated_epilogue" not in spec.key().facts, facts
        assert spec.fc1_gemm.epilogue in (Epilogue.NONE, Epilogue.RELU2)
    monkeypatch.setattr(fused_planning, "FUSED_GATED_EPILOGUE", False)
    assert fused_planning.fused_spec_for(fused_planning.plan_layer(8, QWEN3, H200), QWEN3).gated_epilogue is None


def test_fused_gated_epilogue_needs_a_gated_activation():
    spec = fused_planning.fused_spec_for(fused_planning.plan_layer(8, QWEN3, H200), QWEN3)
    with pytest.raises(BadInputError, match="gated_epilogue"):
        dataclasses.replace(spec, activation=Activation.RELU2)
    with pytest.raises(BadInputError, match="gated_epilogue"):
        dataclasses.replace(spec, gated_epilogue=False)
