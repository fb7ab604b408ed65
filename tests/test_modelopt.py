"""NVFP4 read as ModelOpt stores it (weights: modelopt / modelopt_w31): preparation without copies,
refusals, spec and planner choices, the layer's launches, and a compile check of the kernels.

The decodes themselves are checked instruction by instruction in tests/test_modelopt_decode.py;
the GPU numerics in tests/gpu/test_modelopt_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cuteaot.runtime import ModelOptNvfp4, WeightFormat, prepare_w13_modelopt, prepare_w2_modelopt
from cuteaot.runtime.errors import BadInputError
from cuteaot.runtime.kernels.w4a16.fused_spec import FusedSpec
from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec
from cuteaot.runtime.modelopt import MODELOPT_COMPENSATION
from cuteaot.runtime.resolution import MoeLayerFacts
from cuteaot.runtime.types import DType
from tests.reference.nvfp4 import quantize_nvfp4

ROOT_SPEC = "specs/tiny-modelopt.yaml"


def _checkpoint(e=4, n=256, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_nvfp4(torch.randn(e, n, k, generator=g))


def test_prepare_keeps_the_checkpoint_tensors():
    weight, scale, scale_2 = _checkpoint()
    w13 = prepare_w13_modelopt(weight, scale, scale_2, "bf16")
    assert isinstance(w13, ModelOptNvfp4) and w13.weights is WeightFormat.MODELOPT
    assert w13.qweight.data_ptr() == weight.data_ptr() and w13.scales.data_ptr() == scale.data_ptr()
    assert w13.scales.dtype == torch.uint8 and torch.equal(w13.scales, scale.view(torch.uint8))
    # one global scale per projection, the bf16 decode's offset (2**111) folded in
    assert w13.global_scale.shape == (4, 2)
    assert torch.equal(w13.global_scale, torch.stack((scale_2, scale_2), 1) * 2.0**111)
    w2 = prepare_w2_modelopt(weight, scale, scale_2, "fp16")
    assert w2.global_scale.shape == (4,) and torch.equal(w2.global_scale, scale_2 * MODELOPT_COMPENSATION[DType.FP16])
    assert MODELOPT_COMPENSATION == {DType.BF16: 2.0**111, DType.FP16: 2.0**14}


def test_unpack_nvfp4_points_modelopt_weights_at_their_own_tensors():
    from cuteaot.runtime import unpack_nvfp4

    with pytest.raises(BadInputError, match="the checkpoint's own weight and weight_scale"):
        unpack_nvfp4(prepare_w2_modelopt(*_checkpoint(), "bf16"))


def test_w31_keeps_both_scales_and_reorders_only_the_bias():
    weight, scale, _ = _checkpoint()
    pair = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]) * 1e-3  # (gate, up)
    bias = torch.arange(4 * 256, dtype=torch.float32).view(4, 256)  # stored order: up rows first
    w = prepare_w13_modelopt(weight, scale, pair, "bf16", order="up_gate", bias=bias)
    assert w.weights is WeightFormat.MODELOPT_W31 and w.up_first
    assert torch.equal(w.global_scale, pair * 2.0**111)
    assert w.qweight.data_ptr() == weight.data_ptr()
    assert torch.equal(w.bias.float(), torch.cat((bias[:, 128:], bias[:, :128]), 1).bfloat16().float())
    relu2 = prepare_w13_modelopt(weight, scale, pair[:, 0].contiguous(), "fp16", gated=False)
    assert relu2.global_scale.shape == (4,)


@pytest.mark.parametrize("change, message", [
    (dict(order="interleaved"), "interleaved"),
    (dict(order="up_gate", gated=False), "relu2 W13 is one projection"),
    (dict(n=200), "multiple of 8|multiples of 64"),
    (dict(k=96), "multiples of 64"),
])
def test_prepare_refusals(change, message):
    n, k = change.pop("n", 256), change.pop("k", 128)
    weight, scale, scale_2 = _checkpoint(n=n, k=k)
    with pytest.raises(BadInputError, match=message):
        prepare_w13_modelopt(weight, scale, scale_2, "bf16", **change)


def test_prepare_refuses_nan_scales_and_a_sliced_weight():
    weight, scale, scale_2 = _checkpoint()
    bad = scale.clone()
    bad.view(torch.uint8)[0, 0, 0] = 0x7F  # e4m3 NaN
    with pytest.raises(BadInputError, match="NaN"):
        prepare_w2_modelopt(weight, bad, scale_2, "bf16")
    with pytest.raises(BadInputError, match="contiguous"):
        prepare_w2_modelopt(weight[:, ::2], scale[:, ::2], scale_2, "bf16")


def test_sizes_of_64_mod_128_are_read_as_stored_with_a_masked_last_n_tile():
    """Nemotron-3-Nano's I = 1856 and I / tp = 192 shards: 64-column slabs, no 128-wide tile divides them."""
    weight, scale, scale_2 = _checkpoint(n=192, k=320)
    w2 = prepare_w2_modelopt(weight, scale, scale_2, "bf16")
    assert (w2.n, w2.k, w2.n_stored, w2.k_stored) == (192, 320, 192, 320)
    assert w2.qweight.data_ptr() == weight.data_ptr()  # still no copy
    base = dict(dtype="bf16", n=192, k=512, top_k=2, tile_n=128, tile_k=64, moe_block_size=16, blocks_per_sm=1,
                layout="modelopt", scale_exponent=15)
    assert GemmSpec(**base).n_tail and GemmSpec(**base | dict(mainloop="wgmma", moe_block_size=64)).n_tail
    with pytest.raises(BadInputError, match="modelopt layout N only"):  # its k-tiles are never masked
        GemmSpec(**base | dict(n=256, k=320, tile_k=128))
    with pytest.raises(BadInputError, match="unrotated rows"):  # a run of rows from a rotated first one
        GemmSpec(**base | dict(n=576, n_rotation=128))
    fused = FusedSpec(dtype="bf16", hidden_size=512, intermediate_size=192, top_k=2, activation="relu2",
                      fc1_tile_n=128, fc1_tile_k=64, fc2_tile_n=128, fc2_tile_k=64, moe_block_size=16,
                      blocks_per_sm=2, scale_exponent=15, weights="modelopt")
    assert fused.fc1_gemm.n_tail and not fused.fc2_gemm.n_tail and not fused.fc2_gemm.k_tail


def test_kernel_specs_refuse_what_the_layout_cannot_do():
    base = dict(dtype="bf16", n=512, k=512, top_k=2, tile_n=128, tile_k=64, moe_block_size=64, blocks_per_sm=1,
                layout="modelopt", scale_exponent=15)
    with pytest.raises(BadInputError, match="read as stored"):
        GemmSpec(**base | dict(n_out=504))
    with pytest.raises(BadInputError, match="n_rotation"):
        GemmSpec(**base | dict(n_rotation=64))  # the mma.sync loop reads whole tiles from one rotated row
    # gated epilogues read row by row (gate and up slabs of one tile), on either loop: any 64 rows
    for gated in (base | dict(epilogue="silu", fast_math=True),
                  base | dict(mainloop="wgmma", moe_block_size=128, epilogue="silu", fast_math=True)):
        assert GemmSpec(**gated, n_rotation=64, split_global_scale=True).modelopt
        with pytest.raises(BadInputError, match="n_rotation"):
            GemmSpec(**gated | dict(n_rotation=32))
    with pytest.raises(BadInputError, match="multiples of 128"):
        GemmSpec(**base | dict(epilogue="silu", fast_math=True, n=576, tile_n=64, tile_k=128))
    with pytest.raises(BadInputError, match="belong to the modelopt"):
        GemmSpec(**base | dict(layout="packed", n_rotation=256, scale_exponent=None))
    # a kernel built with another scale convention (or before it was recorded) is refused: the weights'
    # global scales undo this runtime's
    for other in (None, 23):
        with pytest.raises(BadInputError, match="rebuild it"):
            GemmSpec(**base | dict(scale_exponent=other))
    with pytest.raises(BadInputError, match="belong to the modelopt"):
        GemmSpec(**base | dict(layout="packed"))
    fused = dict(dtype="bf16", hidden_size=512, intermediate_size=256, top_k=2, activation="relu2", fc1_tile_n=128,
                 fc1_tile_k=64, fc2_tile_n=128, fc2_tile_k=64, moe_block_size=16, blocks_per_sm=2, scale_exponent=15)
    with pytest.raises(BadInputError, match="needs a gated activation"):
        FusedSpec(**fused, weights="modelopt_w31")
    with pytest.raises(BadInputError, match="multiples of 64"):
        FusedSpec(**fused | dict(activation="silu", intermediate_size=288), weights="modelopt")
    with pytest.raises(BadInputError, match="rebuild it"):
        FusedSpec(**fused | dict(activation="silu", scale_exponent=None), weights="modelopt")
    with pytest.raises(BadInputError, match="belongs to the modelopt"):
        FusedSpec(**fused)  # packed NVFP4
    spec = FusedSpec(**fused | dict(activation="silu"), weights="modelopt_w31")
    assert spec.fc1_gemm.scale_exponent == spec.fc2_gemm.scale_exponent == 15
    assert spec.fc1_gemm.n_rotation == 256 and spec.fc1_gemm.split_global_scale
    assert spec.fc2_gemm.n_rotation is None and spec.fc2_gemm.split_global_scale is None


def test_planner_runs_modelopt_layers_where_packed_ones_run():
    """The fused kernel stays on the mma.sync loop; from the M where packed NVFP4 splits into two
    wgmma GEMMs, the stored layout splits at the same M, on 128-wide tiles."""
    from cuteaot.codegen.kernels.w4a16.fused_planning import fused_spec_for, plan_layer, split_layer
    from cuteaot.codegen.kernels.w4a16.planning import MODELOPT_WGMMA_SHORT_BLOCKS, select_route_block_size
    from cuteaot.runtime.devices import PROFILES

    h200 = PROFILES["h200"]
    nvfp4 = MoeLayerFacts(dtype="bf16", hidden_size=4096, intermediate_size=1408, num_experts=128, top_k=8,
                          activation="silu")
    for weights in ("modelopt", "modelopt_w31"):
        # I = 1408 = 5.5 x 256: FC1 tiles of 256 would straddle gate | up
        facts = dataclasses.replace(nvfp4, weights=weights)
        splits = 0
        for m in (1, 2, 5, 8, 64, 256, 1024, 4096, 16384):
            spec = fused_spec_for(plan_layer(m, facts, h200), facts)
            assert spec.mainloop.value == "mma_sync" and spec.fc1_gemm.modelopt and spec.fc2_gemm.modelopt
            assert 1408 % spec.fc1_tile_n == 0, (m, spec.fc1_tile_n)
            split, packed = split_layer(m, facts, h200), split_layer(m, nvfp4, h200)
            # as packed NVFP4, except for the short blocks MODELOPT_WGMMA_SHORT_BLOCKS leaves out (and where a packed
            # 8-row block was promoted to 16 rows, measured for packed layers only)
            block = None if packed is None else packed[0].plan.moe_block_size
            promoted = packed is not None and select_route_block_size(m, 8, 128) == 8
            short_out = block is not None and block < 64 and block not in MODELOPT_WGMMA_SHORT_BLOCKS
            assert (split is None) == (packed is None or promoted or short_out), m
            if split is None:
                continue
            splits += 1
            fc1, fc2 = (phase.spec for phase in split)
            assert fc1.modelopt and fc2.modelopt and fc1.mainloop.value == fc2.mainloop.value == "wgmma"
            assert fc1.tile_n == fc2.tile_n == 128 and fc1.epilogue.value == "silu"
            assert fc1.n_rotation == (1408 if weights == "modelopt_w31" else None) and fc1.split_global_scale
            assert fc2.n_rotation is None and fc2.split_global_scale is None
            assert fc1.moe_block_size == fc2.moe_block_size >= packed[0].spec.moe_block_size  # taller: see the rule
        assert splits >= 3  # M = 1024, 4096, 16384


def test_stored_rows_are_read_in_64_byte_pieces_where_k_allows():
    """8-row blocks of the stored layout take the 128-deep tile (64 bytes of each K-contiguous row a stage) per GEMM
    whose K is a multiple of 128, else the packed 64-deep one; packed layers keep theirs.  Decode plans of the stored
    layout never widen to the 64-deep 256-wide tile."""
    from cuteaot.codegen.kernels.w4a16.fused_planning import WIDE_TILE, fused_spec_for, plan_layer
    from cuteaot.codegen.kernels.w4a16.planning import MODELOPT_DEEP_TILE, PACKED_M8_TILE
    from cuteaot.runtime.devices import PROFILES

    h200 = PROFILES["h200"]
    deep = MODELOPT_DEEP_TILE
    cases = [  # (hidden, inter, top_k, activation): FC1 and FC2 tiles of the stored layout at 8-row blocks
        ((2048, 768, 8, "silu"), (deep, deep)),  # Qwen3-30B: both K multiples of 128
        ((2688, 1856, 6, "relu2"), (deep, (64, 128))),  # Nemotron-3-Nano: FC2's K = 1856 = 64 (mod 128)
    ]
    for (hidden, inter, top_k, activation), tiles in cases:
        for weights, expected in (("modelopt", tiles), ("nvfp4", ((64, 128),) * 2)):
            facts = MoeLayerFacts(dtype="bf16", hidden_size=hidden, intermediate_size=inter, num_experts=128,
                                  top_k=top_k, activation=activation, weights=weights)
            for m in (8, 64):
                plan = plan_layer(m, facts, h200)
                assert plan.moe_block_size == 8 and not plan.decode, (weights, m)
                got = tuple((t.tile_k, t.tile_n) for t in (plan.fc1_tile, plan.fc2_tile))
                assert got == tuple(expected) and plan.blocks_per_sm == 4, (weights, m, got)
                spec = fused_spec_for(plan, facts)
                # a gated FC1 64 wide activates in a pass of its own, not in its epilogue
                assert bool(spec.gated_epilogue) == (facts.gated and plan.fc1_tile.tile_n % 128 == 0)
            assert plan.fc1_tile.tile_k * plan.fc1_tile.tile_n == PACKED_M8_TILE.tile_k * PACKED_M8_TILE.tile_n
        stored = dataclasses.replace(facts, weights="modelopt")
        # 16-row blocks too; a GEMM the deep tile does not fit keeps its general tile (the same 128 threads)
        plan = plan_layer(200 if hidden == 2688 else 150, stored, h200)
        got = tuple((t.tile_k, t.tile_n) for t in (plan.fc1_tile, plan.fc2_tile))
        assert plan.moe_block_size == 16 and got == tuple(tiles), got
        for m in (1, 2):
            plan = plan_layer(m, stored, h200)
            assert plan.decode and WIDE_TILE not in (plan.fc1_tile, plan.fc2_tile), m


@pytest.mark.parametrize("hidden, inter, top_k, activation", [
    (2688, 1856, 6, "relu2"),  # Nemotron-3-Nano: FC1's N = I = 1856 ends in a masked tile, FC2's K in 64-deep ones
    (4096, 192, 8, "silu"),  # Qwen3-235B-A22B on 8 ranks: FC2's K = 192
    (2880, 2880, 4, "swigluoai"),  # gpt-oss dims: FC1's K and FC2's N and K
])
def test_planner_reads_sizes_of_64_mod_128_as_stored(hidden, inter, top_k, activation):
    """Every token count plans, with a masked last N tile wherever a GEMM's N is 64 (mod 128) on a 128-wide tile,
    and never a masked k-tile (the stored layout's loops mask none: K = 64 mod 128 takes 64-deep tiles)."""
    from cuteaot.codegen.kernels.w4a16.fused_planning import fused_spec_for, plan_layer, split_layer
    from cuteaot.runtime.devices import PROFILES

    for weights in ("modelopt", "modelopt_w31") if activation != "relu2" else ("modelopt",):
        facts = MoeLayerFacts(dtype="bf16", hidden_size=hidden, intermediate_size=inter, num_experts=128,
                              top_k=top_k, activation=activation, weights=weights)
        for m in (1, 2, 8, 64, 256, 1024, 4096, 16384):
            split = split_layer(m, facts, PROFILES["h200"])
            if split is None:
                spec = fused_spec_for(plan_layer(m, facts, PROFILES["h200"]), facts)
                gemms = (spec.fc1_gemm, spec.fc2_gemm)
            else:
                gemms = tuple(phase.spec for phase in split)
            for g in gemms:
                assert g.modelopt and not g.k_tail and g.k % g.tile_k == 0, (m, g.key().describe())
                assert g.n_tail == (g.n % g.tile_n != 0) and (not g.n_tail or g.n % 128 == 64), (m, g.n, g.tile_n)
            assert any(g.n_tail for g in gemms) == any(g.n % 128 == 64 and g.tile_n >= 128 for g in gemms)


def test_layer_launches_read_the_checkpoint_tensors(monkeypatch):
    """A stand-in bundle planned from specs/tiny-modelopt.yaml: the fused kernel gets the stored tensors'
    own addresses, and a w31 layer resolves the modelopt_w31 kernels."""
    import cuteaot.runtime.moe as moe_module
    from cuteaot.runtime.moe import MoeLayer
    from tests.stub_bundle import StubLaunch, stub_bundle, stub_launches

    calls = stub_launches(monkeypatch)
    bundle = stub_bundle(ROOT_SPEC)
    g = torch.Generator().manual_seed(3)
    gate, up = (quantize_nvfp4(torch.randn(16, 384, 512, generator=g)) for _ in range(2))
    w13_t = [torch.cat((up[j], gate[j]), 1) for j in (0, 1)]  # w31: up rows first
    w2_t = quantize_nvfp4(torch.randn(16, 512, 384, generator=g))
    w13 = prepare_w13_modelopt(*w13_t, torch.stack((gate[2], up[2]), 1), "bf16", order="up_gate")
    layer = MoeLayer(bundle, w13, prepare_w2_modelopt(*w2_t, "bf16"), top_k=4, activation="silu")
    assert layer.facts.weights is WeightFormat.MODELOPT_W31
    x = torch.zeros(7, 512, dtype=torch.bfloat16)
    ids = (torch.arange(7 * 4, dtype=torch.int32).view(7, 4) % 16)
    layer(x, torch.full((7, 4), 0.25), ids)
    fused = [c for c in calls if c[0] == "fused"]
    assert len(fused) == 1
    values = fused[0][2]
    assert values["w13"] == w13_t[0].data_ptr() and values["w13_scales"] == w13_t[1].data_ptr()
    assert values["w2"] == w2_t[0].data_ptr() and values["w13_global_scale"] == w13.global_scale.data_ptr()
    spec = bundle.specs[layer.resolve(7).launch.kernels["fused"]]
    assert spec.weights is WeightFormat.MODELOPT_W31 and spec.fc1_gemm.n_rotation == 384
    # from 32-row blocks (M = 64 here) two wgmma GEMMs, reading the same tensors
    calls.clear()
    layer(torch.zeros(64, 512, dtype=torch.bfloat16), torch.full((64, 4), 0.25),
          torch.arange(64 * 4, dtype=torch.int32).view(64, 4) % 16)
    fc1, fc2 = (c[2] for c in calls if c[0] == "fused")
    assert (fc1["qweight"], fc1["scales"], fc2["qweight"]) == (w13_t[0].data_ptr(), w13_t[1].data_ptr(),
                                                              w2_t[0].data_ptr())
    assert bundle.specs[layer.resolve(64).launch.kernels["fc1"]].n_rotation == 384
    assert moe_module and StubLaunch


def test_layer_refuses_mixed_or_mismatched_preparations(monkeypatch):
    from cuteaot.runtime.moe import MoeLayer
    from cuteaot.runtime.weights import prepare_w2
    from tests.stub_bundle import stub_bundle, stub_launches

    stub_launches(monkeypatch)
    bundle = stub_bundle(ROOT_SPEC)
    w13 = prepare_w13_modelopt(*_checkpoint(e=16, n=768, k=512), "bf16")
    w2_t = _checkpoint(e=16, n=512, k=384)
    with pytest.raises(BadInputError, match="one format"):
        MoeLayer(bundle, w13, prepare_w2(*w2_t, "bf16"), top_k=4, activation="silu")
    relu2_w13 = prepare_w13_modelopt(*_checkpoint(e=16, n=384, k=512), "bf16", gated=False)
    with pytest.raises(BadInputError, match="gated=True"):
        MoeLayer(bundle, relu2_w13, prepare_w2_modelopt(*w2_t, "bf16"), top_k=4, activation="silu")


def test_modelopt_kernels_compile_without_spills():
    pytest.importorskip("cutlass", reason="compiling needs CuTeDSL (cuteaot[codegen])")
    from cuteaot.codegen.compile import compile_kernel
    from cuteaot.codegen.kernels.w4a16.planning import WGMMA_REGISTERS_SM90_MODELOPT
    from cuteaot.runtime.kernels.w4a16.gemm_spec import modelopt_scale_exponent

    for dtype, block, routes, tile_n, tile_k, bps, extra in (
            ("bf16", 8, "direct", 128, 64, 4, {}),
            ("fp16", 64, "packed", 128, 128, 1, {}),
            ("bf16", 16, "packed", 128, 64, 2, dict(n_rotation=256, split_global_scale=True)),
            # the fused kernel's FC1 with the gated epilogue (gate | up slabs of a w31 layer, rotated rows)
            ("bf16", 8, "direct", 128, 64, 4, dict(n_rotation=256, split_global_scale=True, epilogue="silu",
                                                    fast_math=True)),
            ("fp16", 32, "packed", 128, 64, 2, dict(epilogue="silu", fast_math=True, split_global_scale=True))):
        spec = GemmSpec(dtype=dtype, n=512, k=512, top_k=2, tile_n=tile_n, tile_k=tile_k, moe_block_size=block,
                        blocks_per_sm=bps, mul_topk_weights=True, routes=routes, layout="modelopt",
                        scale_exponent=modelopt_scale_exponent(dtype), **extra)
        record = compile_kernel(spec.key(), "sm_90a").record
        assert record["local_bytes"] == 0 and record["stack_bytes"] == 0, record
        assert record["dynamic_smem_bytes"] == spec.shared_bytes
    # the wgmma loop's tiles for every block size, at the CTAs per SM the planner derives from the
    # register table: no spills, and no more registers than the table says (a gated FC1, w31)
    for block, bps in ((16, 4), (32, 4), (48, 3), (64, 2), (128, 2), (256, 1)):
        spec = GemmSpec(dtype="bf16", n=1024, k=1024, top_k=2, tile_n=128, tile_k=64, moe_block_size=block,
                        blocks_per_sm=bps, mainloop="wgmma", epilogue="silu", fast_math=True, layout="modelopt",
                        n_rotation=512, split_global_scale=True, scale_exponent=modelopt_scale_exponent("bf16"))
        record = compile_kernel(spec.key(), "sm_90a").record
        assert record["local_bytes"] == 0 and record["stack_bytes"] == 0, (block, record)
        assert record["registers"] <= WGMMA_REGISTERS_SM90_MODELOPT[(block, 128)], (block, record["registers"])


def test_stored_copies_have_l2_fetch_whole_rows():
    """Every copy of the stored layout's weight and scale pieces carries the L2 fetch size its main loop's
    MODELOPT_L2_PREFETCH names (SASS `LDGSTS... .LTC<n>B`), so L2 reads a row's next stages with this one."""
    pytest.importorskip("cutlass", reason="compiling needs CuTeDSL (cuteaot[codegen])")
    import re

    from cuteaot.codegen.compile import compile_kernel
    from cuteaot.codegen.kernels.w4a16.mainloop import MODELOPT_L2_PREFETCH
    from cuteaot.codegen.resources import read_sass
    from cuteaot.runtime.kernels.w4a16.gemm_spec import modelopt_scale_exponent

    for mainloop, block, tile_k, tile_n in (("mma_sync", 8, 128, 64), ("wgmma", 32, 64, 128)):
        spec = GemmSpec(dtype="bf16", n=512, k=512, top_k=2, tile_n=tile_n, tile_k=tile_k, moe_block_size=block,
                        blocks_per_sm=2, routes="packed", layout="modelopt", mainloop=mainloop,
                        scale_exponent=modelopt_scale_exponent("bf16"))
        copies = re.findall(r"LDGSTS\.[\w.]*", read_sass(compile_kernel(spec.key(), "sm_90a").cubin))
        fetching = [c for c in copies if f"LTC{MODELOPT_L2_PREFETCH[mainloop]}B" in c]
        # the weights' 16-byte and the scales' 4- or 8-byte copies of each (unrolled) stage; activations may differ
        assert any(".128" in c for c in fetching) and any(".128" not in c for c in fetching), (mainloop, copies)


def test_kernels_built_with_another_scale_convention_are_refused():
    """The runtime rebuilds each kernel's spec from its manifest facts (PersistentLaunch, before any
    launch): a modelopt kernel without scale_exponent (an older bundle) or with another one would
    scale every output by a wrong power of two, so it is refused."""
    from tests.stub_bundle import _planned

    _, specs = _planned(str(ROOT_SPEC))
    modelopt = [s for s in specs.values()
                if getattr(s, "layout", None) == "modelopt"
                or getattr(s, "weights", None) in (WeightFormat.MODELOPT, WeightFormat.MODELOPT_W31)]
    assert {type(s).__name__ for s in modelopt} == {"GemmSpec", "FusedSpec"}  # both families, as planned
    for spec in modelopt:
        facts = dict(spec.key().facts)
        assert type(spec).from_facts(facts) == spec
        for stale in ({k: v for k, v in facts.items() if k != "scale_exponent"}, facts | {"scale_exponent": 23}):
            with pytest.raises(BadInputError, match="rebuild it"):
                type(spec).from_facts(stale)
