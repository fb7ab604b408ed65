"""Checkpoint loading: synthetic ModelOpt NVFP4 checkpoints (per-expert sharded, fused w13 / w31)
written with safetensors, loaded, and compared with prepare_w13 / prepare_w2 of hand-stacked tensors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types

import pytest
import torch

from cuteaot.runtime import BadInputError, CheckpointError, CheckpointFiles, load_moe_layer, load_moe_layers
from cuteaot.runtime.parallel import (
    ModelOptTensors, ep_partition, ep_select, tp_shard_bias13, tp_shard_w2, tp_shard_w2_mxfp4, tp_shard_w13,
    tp_shard_w13_mxfp4,
)
from cuteaot.runtime.weights import prepare_w2, prepare_w2_mxfp4, prepare_w13, prepare_w13_mxfp4, unpack_nvfp4

from tests.reference.mxfp4 import dequantize_mxfp4, random_mxfp4
from tests.reference.nvfp4 import decode_packed_like_device, random_nvfp4

save_file = pytest.importorskip("safetensors.torch", reason="checkpoint loading needs safetensors").save_file

E, H, I = 4, 256, 128
PREFIX = "model.layers.3.mlp"
PROJ_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")


@pytest.fixture(scope="module")
def moe():
    """One layer's ModelOpt tensors: gate and up share each expert's global scale (quantized together)."""
    gen = torch.Generator().manual_seed(15)
    w13 = random_nvfp4(E, 2 * I, H, gen)  # rows [gate | up]
    w2 = random_nvfp4(E, H, I, gen)
    gate = tuple(t[:, :I].contiguous() if t.dim() == 3 else t for t in w13)
    up = tuple(t[:, I:].contiguous() if t.dim() == 3 else t for t in w13)
    return {"gate_proj": gate, "up_proj": up, "down_proj": w2}


def _per_expert_tensors(moe, experts) -> dict[str, torch.Tensor]:
    out = {}
    for e in experts:
        for proj, tensors in moe.items():
            key = f"{PREFIX}.experts.{e}.{proj}"
            for suffix, t in zip(PROJ_SUFFIXES, tensors):
                out[f"{key}.{suffix}"] = t[e].clone()  # weight_scale_2: a 0-d f32, as ModelOpt writes it
            out[f"{key}.input_scale"] = torch.tensor(0.02)
    return out


def _write_sharded(tmp_path, tensors_per_file: list[dict[str, torch.Tensor]]):
    """Shard files + model.safetensors.index.json; returns the directory."""
    weight_map = {}
    for i, tensors in enumerate(tensors_per_file):
        name = f"model-{i + 1:05d}-of-{len(tensors_per_file):05d}.safetensors"
        save_file(tensors, str(tmp_path / name))
        weight_map.update({k: name for k in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


def _per_expert_checkpoint(tmp_path, moe, edit=None):
    """Experts 0, 1 in shard 1 (with the router, which is not ours to read), 2, 3 in shard 2."""
    first = _per_expert_tensors(moe, range(0, 2))
    first[f"{PREFIX}.gate.weight"] = torch.randn(E, H).to(torch.bfloat16)
    second = _per_expert_tensors(moe, range(2, E))
    if edit is not None:
        edit(first, second)
    return _write_sharded(tmp_path, [first, second])


def _fused_tensors(moe, name13: str) -> dict[str, torch.Tensor]:
    first, second = ("gate_proj", "up_proj") if name13 == "w13" else ("up_proj", "gate_proj")
    base = f"{PREFIX}.experts."
    out = {
        f"{base}{name13}_weight": torch.cat((moe[first][0], moe[second][0]), dim=1),
        f"{base}{name13}_weight_scale": torch.cat((moe[first][1], moe[second][1]), dim=1),
        f"{base}{name13}_weight_scale_2": moe["gate_proj"][2].clone(),
        f"{base}{name13}_input_scale": torch.full((E, 2), 0.02),
        f"{base}w2_input_scale": torch.full((E,), 0.02),
    }
    out.update({f"{base}w2_{s}": t.clone() for s, t in zip(PROJ_SUFFIXES, moe["down_proj"])})
    return out


def _expected(moe, dtype):
    """prepare_w13 / prepare_w2 of the tensors stacked by hand: [gate | up], (E, 2) global pair."""
    gate, up, down = moe["gate_proj"], moe["up_proj"], moe["down_proj"]
    w13 = prepare_w13(
        torch.cat((gate[0], up[0]), dim=1),
        torch.cat((gate[1], up[1]), dim=1),
        torch.stack((gate[2], up[2]), dim=1),
        dtype,
    )
    return w13, prepare_w2(*down, dtype)


def _assert_same(got, want, moe):
    for g, w in zip(got, want):
        assert (g.n, g.k, g.num_experts, g.dtype) == (w.n, w.k, w.num_experts, w.dtype)
        assert torch.equal(g.qweight, w.qweight)
        assert torch.equal(g.scales, w.scales)
        assert torch.equal(g.global_scale, w.global_scale)
    # and back to the checkpoint's own tensors (no zero block scales in Gaussian weights)
    gate, up, down = moe["gate_proj"], moe["up_proj"], moe["down_proj"]
    weight, scale, scale_2 = unpack_nvfp4(got[0])
    assert torch.equal(weight, torch.cat((gate[0], up[0]), dim=1))
    assert torch.equal(scale.view(torch.uint8), torch.cat((gate[1], up[1]), dim=1).view(torch.uint8))
    assert torch.equal(scale_2, gate[2])
    weight, scale, scale_2 = unpack_nvfp4(got[1])
    assert torch.equal(weight, down[0])
    assert torch.equal(scale.view(torch.uint8), down[1].view(torch.uint8))
    assert torch.equal(scale_2, down[2])


# ---- layouts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_per_expert_sharded_with_index(tmp_path, moe, dtype):
    root = _per_expert_checkpoint(tmp_path, moe)
    files = CheckpointFiles.open(root)
    assert len(files.files) == 2
    got = load_moe_layer(files, PREFIX, num_experts=E, dtype=dtype)
    _assert_same(got, _expected(moe, dtype), moe)
    assert (got[0].n, got[0].k, got[1].n, got[1].k) == (2 * I, H, H, I)


def test_per_expert_distinct_gate_up_global_scales(tmp_path, moe):
    """Different gate and up weight_scale_2 reach prepare_w13 as the (E, 2) (gate, up) pair."""
    scaled = dict(moe)
    scaled["up_proj"] = (moe["up_proj"][0], moe["up_proj"][1], moe["up_proj"][2] * 0.5)
    root = _per_expert_checkpoint(tmp_path, scaled)
    got = load_moe_layer(root, PREFIX, num_experts=E, dtype="bf16", layout="per_expert")
    want = _expected(scaled, "bf16")
    assert torch.equal(got[0].qweight, want[0].qweight) and torch.equal(got[0].scales, want[0].scales)
    assert torch.equal(got[0].global_scale, want[0].global_scale)
    assert not torch.equal(got[0].scales, _expected(moe, "bf16")[0].scales), "the up half was not rescaled"


def test_checkpoint_files_print_a_summary(tmp_path, moe):
    files = CheckpointFiles.open(_per_expert_checkpoint(tmp_path, moe))
    assert repr(files) == f"CheckpointFiles({tmp_path}: 2 file(s), {len(files.key_files)} tensors)"


def test_file_list_without_index(tmp_path, moe):
    save_file(_per_expert_tensors(moe, range(0, 3)), str(tmp_path / "a.safetensors"))
    save_file(_per_expert_tensors(moe, range(3, E)), str(tmp_path / "b.safetensors"))
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    _assert_same(load_moe_layer(paths, PREFIX, num_experts=E, dtype="bf16"), _expected(moe, "bf16"), moe)
    # a directory without an index: every *.safetensors in it
    _assert_same(load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16"), _expected(moe, "bf16"), moe)


@pytest.mark.parametrize("name13", ["w13", "w31"])
def test_fused_layouts(tmp_path, moe, name13):
    path = tmp_path / "model.safetensors"
    save_file(_fused_tensors(moe, name13), str(path))
    with CheckpointFiles.open(path) as files:
        got = load_moe_layer(files, PREFIX, num_experts=E, dtype="bf16")  # auto-detected
        again = load_moe_layer(files, PREFIX, num_experts=E, dtype="bf16", layout=name13)
    _assert_same(got, _expected(moe, "bf16"), moe)
    assert torch.equal(again[0].qweight, got[0].qweight)


@pytest.mark.parametrize("layout", ["per_expert", "w13", "w31"])
def test_as_stored_keeps_the_checkpoint_bytes(tmp_path, moe, layout):
    """as_stored: ModelOptNvfp4 holding the stored bytes (W13 rows in the checkpoint's own order) and
    both projections' global scales, for the `weights: modelopt` / `modelopt_w31` kernels."""
    from cuteaot.runtime import ModelOptNvfp4, WeightFormat
    from cuteaot.runtime.modelopt import MODELOPT_COMPENSATION

    scaled = dict(moe)
    scaled["up_proj"] = (moe["up_proj"][0], moe["up_proj"][1], moe["up_proj"][2] * 0.5)
    if layout == "per_expert":
        root = _per_expert_checkpoint(tmp_path, scaled)
    else:
        root = tmp_path / "model.safetensors"
        tensors = _fused_tensors(scaled, layout)
        tensors[f"{PREFIX}.experts.{layout}_weight_scale_2"] = torch.stack(
            (scaled["gate_proj"][2], scaled["up_proj"][2]), dim=1)
        save_file(tensors, str(root))
    w13, w2 = load_moe_layer(root, PREFIX, num_experts=E, dtype="bf16", as_stored=True)
    assert isinstance(w13, ModelOptNvfp4) and isinstance(w2, ModelOptNvfp4)
    assert w13.weights is (WeightFormat.MODELOPT_W31 if layout == "w31" else WeightFormat.MODELOPT)
    first, second = ("up_proj", "gate_proj") if layout == "w31" else ("gate_proj", "up_proj")
    assert torch.equal(w13.qweight, torch.cat((scaled[first][0], scaled[second][0]), dim=1))
    assert torch.equal(w13.scales, torch.cat((scaled[first][1], scaled[second][1]), dim=1).view(torch.uint8))
    pair = torch.stack((scaled["gate_proj"][2], scaled["up_proj"][2]), dim=1)
    assert torch.equal(w13.global_scale, pair * MODELOPT_COMPENSATION[w13.dtype])
    assert torch.equal(w2.qweight, moe["down_proj"][0])


def test_as_stored_refuses_gpt_oss(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_gpt_oss_tensors(), str(path))
    with pytest.raises(CheckpointError, match="as_stored reads ModelOpt NVFP4"):
        load_moe_layer(path, PREFIX, num_experts=E, dtype="bf16", as_stored=True)


def test_load_moe_layers_progress_without_tqdm(tmp_path, moe, monkeypatch, capsys):
    tensors = _fused_tensors(moe, "w13")
    second = {k.replace("layers.3", "layers.4"): v for k, v in _fused_tensors(moe, "w31").items()}
    save_file({**tensors, **second}, str(tmp_path / "model.safetensors"))
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    layers = load_moe_layers(tmp_path, [PREFIX, "model.layers.4.mlp"], num_experts=E, dtype="bf16")
    assert len(layers) == 2
    for got in layers:
        _assert_same(got, _expected(moe, "bf16"), moe)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"cuteaot: loaded MoE layer 1/2 ({PREFIX})",
        "cuteaot: loaded MoE layer 2/2 (model.layers.4.mlp)",
    ]


def test_load_moe_layers_uses_tqdm_and_closes_it(tmp_path, moe, monkeypatch):
    save_file(_fused_tensors(moe, "w13"), str(tmp_path / "model.safetensors"))
    events = []

    class FakeBar:
        def __init__(self, total, **_):
            events.append(("total", total))

        def set_postfix_str(self, text, refresh=True):
            events.append(("at", text))

        def update(self, n):
            events.append(("update", n))

        def close(self):
            events.append(("close",))

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=FakeBar))
    with pytest.raises(CheckpointError, match="model.layers.9.mlp"):
        load_moe_layers(tmp_path, [PREFIX, "model.layers.9.mlp"], num_experts=E, dtype="bf16")
    assert events == [("total", 2), ("at", PREFIX), ("update", 1), ("close",)]


# ---- errors --------------------------------------------------------------------------------------


def test_missing_key_names_key_prefix_files_and_close_matches(tmp_path, moe):
    key = f"{PREFIX}.experts.2.up_proj.weight_scale"
    root = _per_expert_checkpoint(tmp_path, moe, edit=lambda first, second: second.pop(key))
    with pytest.raises(CheckpointError) as info:
        load_moe_layer(root, PREFIX, num_experts=E, dtype="bf16")
    msg = str(info.value)
    assert repr(key) in msg and repr(PREFIX) in msg
    assert "model-00001-of-00002.safetensors" in msg and "model-00002-of-00002.safetensors" in msg
    assert f"{PREFIX}.experts.2.up_proj.weight_scale_2" in msg.split("close matches:")[1]
    assert isinstance(info.value, BadInputError)


def test_too_few_experts_in_checkpoint(tmp_path, moe):
    root = _per_expert_checkpoint(tmp_path, moe)
    with pytest.raises(CheckpointError, match=rf"'{PREFIX}\.experts\.4\.gate_proj\.weight'.*not in the checkpoint"):
        load_moe_layer(root, PREFIX, num_experts=E + 1, dtype="bf16")


def test_wrong_dtype_names_key_and_file(tmp_path, moe):
    key = f"{PREFIX}.experts.1.down_proj.weight_scale"

    def edit(first, second):
        first[key] = first[key].float()

    root = _per_expert_checkpoint(tmp_path, moe, edit=edit)
    with pytest.raises(CheckpointError) as info:
        load_moe_layer(root, PREFIX, num_experts=E, dtype="bf16")
    msg = str(info.value)
    assert msg.startswith(f"{key} in {root / 'model-00001-of-00002.safetensors'}")
    assert "expected dtype float8_e4m3fn" in msg and "got float32" in msg


def test_wrong_shape_names_key_and_file(tmp_path, moe):
    key = f"{PREFIX}.experts.3.up_proj.weight"

    def edit(first, second):
        second[key] = second[key][:, : H // 2 - 16].contiguous()

    root = _per_expert_checkpoint(tmp_path, moe, edit=edit)
    with pytest.raises(CheckpointError) as info:
        load_moe_layer(root, PREFIX, num_experts=E, dtype="bf16")
    msg = str(info.value)
    assert msg.startswith(f"{key} in {root / 'model-00002-of-00002.safetensors'}")
    assert f"expected shape {(I, H // 2)}" in msg and f"got {(I, H // 2 - 16)}" in msg


def test_wrong_input_scale_is_reported_although_unused(tmp_path, moe):
    key = f"{PREFIX}.experts.0.gate_proj.input_scale"

    def edit(first, second):
        first[key] = torch.ones(3)

    root = _per_expert_checkpoint(tmp_path, moe, edit=edit)
    with pytest.raises(CheckpointError, match=rf"{key} in .*expected shape \(\) or \(1,\).*got \(3,\)"):
        load_moe_layer(root, PREFIX, num_experts=E, dtype="bf16")


def test_inconsistent_experts(tmp_path, moe):
    base = f"{PREFIX}.experts.3.gate_proj"

    def edit(first, second):  # expert 3 quantized for another I: its gate has 2x the rows
        for suffix in ("weight", "weight_scale"):
            second[f"{base}.{suffix}"] = torch.cat((second[f"{base}.{suffix}"],) * 2)

    root = _per_expert_checkpoint(tmp_path, moe, edit=edit)
    with pytest.raises(CheckpointError, match=rf"{base}\.weight in .* has shape \({2 * I}, {H // 2}\), expert 0's"):
        load_moe_layer(root, PREFIX, num_experts=E, dtype="bf16")


def test_fused_expert_count_mismatch(tmp_path, moe):
    save_file(_fused_tensors(moe, "w13"), str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=rf"w13_weight in .*expected shape \(E=8, 2I or I, H/2\), got \({E}, "):
        load_moe_layer(tmp_path, PREFIX, num_experts=8, dtype="bf16")


def test_fused_wrong_w2_dtype(tmp_path, moe):
    tensors = _fused_tensors(moe, "w31")
    tensors[f"{PREFIX}.experts.w2_weight_scale_2"] = tensors[f"{PREFIX}.experts.w2_weight_scale_2"].double()
    save_file(tensors, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"w2_weight_scale_2 in .*expected dtype float32.*got float64"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16")


def test_auto_layout_ambiguous(tmp_path, moe):
    save_file({**_per_expert_tensors(moe, range(E)), **_fused_tensors(moe, "w13")}, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"several layouts \['per_expert', 'w13'\].*pass layout="):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16")
    got = load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", layout="w13")
    _assert_same(got, _expected(moe, "bf16"), moe)


def test_auto_layout_not_found(tmp_path, moe):
    save_file(_fused_tensors(moe, "w13"), str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.5\.mlp' has none of the NVFP4 / MXFP4 MoE keys"):
        load_moe_layer(tmp_path, "model.layers.5.mlp", num_experts=E, dtype="bf16")


def _gpt_oss_tensors(seed: int = 3) -> dict[str, torch.Tensor]:
    """A gpt-oss MXFP4 layer as the checkpoint stores it: gate/up rows interleaved, bf16 biases."""
    gen = torch.Generator().manual_seed(seed)
    blocks13, scales13 = random_mxfp4(E, 2 * I, H, gen)
    blocks2, scales2 = random_mxfp4(E, H, I, gen)
    base = f"{PREFIX}.experts."
    return {
        f"{base}gate_up_proj_blocks": blocks13, f"{base}gate_up_proj_scales": scales13,
        f"{base}gate_up_proj_bias": torch.randn(E, 2 * I, generator=gen).to(torch.bfloat16),
        f"{base}down_proj_blocks": blocks2, f"{base}down_proj_scales": scales2,
        f"{base}down_proj_bias": torch.randn(E, H, generator=gen).to(torch.bfloat16),
        f"{PREFIX}.router.weight": torch.randn(E, H, generator=gen).to(torch.bfloat16),  # not ours to read
    }


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gpt_oss_mxfp4_layer(tmp_path, dtype):
    tensors = _gpt_oss_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    w13, w2 = load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype=dtype)  # auto-detected
    base = f"{PREFIX}.experts."
    want13 = prepare_w13_mxfp4(tensors[f"{base}gate_up_proj_blocks"], tensors[f"{base}gate_up_proj_scales"], dtype,
                               order="interleaved", bias=tensors[f"{base}gate_up_proj_bias"])
    want2 = prepare_w2_mxfp4(tensors[f"{base}down_proj_blocks"], tensors[f"{base}down_proj_scales"], dtype,
                             bias=tensors[f"{base}down_proj_bias"])
    for got, want in ((w13, want13), (w2, want2)):
        assert (got.n, got.k, got.num_experts) == (want.n, want.k, want.num_experts)
        for name in ("qweight", "scales", "global_scale", "bias"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    # and, independently of the packer, the values the kernels will compute with
    w13_f = dequantize_mxfp4(tensors[f"{base}gate_up_proj_blocks"], tensors[f"{base}gate_up_proj_scales"])
    gate_up = torch.cat((w13_f[:, 0::2], w13_f[:, 1::2]), dim=1)
    assert torch.equal(decode_packed_like_device(w13.qweight, w13.scales, w13.global_scale, dtype)[:, : 2 * I, :H],
                       gate_up)
    bias = tensors[f"{base}gate_up_proj_bias"]
    assert torch.equal(w13.bias, torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1).to(w13.bias.dtype))


def test_gpt_oss_wrong_scale_dtype_and_bias_shape(tmp_path):
    base = f"{PREFIX}.experts."
    tensors = _gpt_oss_tensors()
    tensors[f"{base}down_proj_scales"] = tensors[f"{base}down_proj_scales"].to(torch.int32)
    save_file(tensors, str(tmp_path / "a.safetensors"))
    with pytest.raises(CheckpointError, match=r"down_proj_scales in .*a\.safetensors: expected dtype uint8"):
        load_moe_layer(tmp_path / "a.safetensors", PREFIX, num_experts=E, dtype="bf16")
    tensors = _gpt_oss_tensors()
    tensors[f"{base}gate_up_proj_bias"] = tensors[f"{base}gate_up_proj_bias"][:, :I].contiguous()
    save_file(tensors, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError, match=r"gate_up_proj_bias in .*: expected shape \(4, 256\)"):
        load_moe_layer(tmp_path / "b.safetensors", PREFIX, num_experts=E, dtype="bf16")


def test_nvfp4_biases_are_read_in_every_layout(tmp_path, moe):
    gen = torch.Generator().manual_seed(9)
    gate_b, up_b = torch.randn(E, I, generator=gen), torch.randn(E, I, generator=gen)
    down_b = torch.randn(E, H, generator=gen)

    def add_per_expert(first, second):
        for shard in (first, second):
            for key in [k for k in shard if k.endswith(".gate_proj.weight")]:
                e = int(key.split(".experts.")[1].split(".")[0])
                stem = key.removesuffix(".gate_proj.weight")
                shard[f"{stem}.gate_proj.bias"] = gate_b[e].clone()
                shard[f"{stem}.up_proj.bias"] = up_b[e].clone()
                shard[f"{stem}.down_proj.bias"] = down_b[e].clone()

    (tmp_path / "pe").mkdir()
    w13, w2 = load_moe_layer(_per_expert_checkpoint(tmp_path / "pe", moe, add_per_expert), PREFIX,
                             num_experts=E, dtype="bf16")
    assert torch.equal(w13.bias, torch.cat((gate_b, up_b), dim=1).to(torch.bfloat16))
    assert torch.equal(w2.bias, down_b.to(torch.bfloat16))
    fused = _fused_tensors(moe, "w31")
    fused[f"{PREFIX}.experts.w31_bias"] = torch.cat((up_b, gate_b), dim=1)  # up rows first, like the weight
    fused[f"{PREFIX}.experts.w2_bias"] = down_b
    save_file(fused, str(tmp_path / "f.safetensors"))
    w13, w2 = load_moe_layer(tmp_path / "f.safetensors", PREFIX, num_experts=E, dtype="bf16")
    assert torch.equal(w13.bias, torch.cat((gate_b, up_b), dim=1).to(torch.bfloat16))
    assert torch.equal(w2.bias, down_b.to(torch.bfloat16))


def test_bad_values_name_the_layer(tmp_path, moe):
    tensors = _fused_tensors(moe, "w13")
    tensors[f"{PREFIX}.experts.w2_weight_scale_2"] = torch.full((E,), -1.0)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=rf"layer '{PREFIX}' \(w13 layout.*w2_weight_scale_2 must be finite"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16")


def test_bad_arguments(tmp_path, moe):
    save_file(_fused_tensors(moe, "w13"), str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"layout must be one of .*got 'fused'"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", layout="fused")
    with pytest.raises(CheckpointError, match="num_experts must be a positive int"):
        load_moe_layer(tmp_path, PREFIX, num_experts=0, dtype="bf16")


def test_index_naming_a_missing_shard(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"names shard file\(s\) that do not exist: .*gone\.safetensors"):
        CheckpointFiles.open(tmp_path)


def test_index_disagreeing_with_its_shard(tmp_path, moe):
    root = _per_expert_checkpoint(tmp_path, moe)
    index = root / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    key = f"{PREFIX}.experts.0.gate_proj.weight"
    data["weight_map"][key] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=rf"index puts '{key}' in .*00002.*does not hold it"):
        load_moe_layer(root, PREFIX, num_experts=E, dtype="bf16")


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"not a safetensors header")
    with pytest.raises(CheckpointError, match=rf"cannot open {path} as a safetensors file"):
        CheckpointFiles.open(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor any"):
        CheckpointFiles.open(empty)


def test_duplicate_key_across_files(tmp_path, moe):
    tensors = _fused_tensors(moe, "w13")
    save_file(tensors, str(tmp_path / "a.safetensors"))
    save_file(tensors, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError, match=r"is in both .*a\.safetensors and .*b\.safetensors"):
        CheckpointFiles.open(tmp_path)


def test_missing_safetensors_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match="pip install safetensors"):
        CheckpointFiles.open(tmp_path / "model.safetensors")


def test_runtime_import_does_not_load_safetensors():
    script = "import sys, cuteaot.runtime; assert 'safetensors' not in sys.modules, 'imported eagerly'; print('ok')"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ---- a whole model: config.json + checkpoint -> MoeLayers ---------------------------------------


def test_load_model_moe_builds_every_layer_from_the_config(tmp_path, monkeypatch):
    """Two MoE layers (fused w13 keys, layers 2 and 10) and a dense one, at tiny-fused's shape (the stub
    bundle's table): each becomes a MoeLayer with the config's top-k and activation and the weights
    load_moe_layer reads; layer options pass through; the config's own options cannot be overridden."""
    import cuteaot.runtime.moe as moe_module
    from cuteaot.runtime import load_model_moe
    from cuteaot.runtime.checkpoint import moe_layer_prefixes
    from tests.stub_bundle import StubLaunch, stub_bundle

    e, h, i = 16, 512, 256
    gen = torch.Generator().manual_seed(21)
    tensors = {}
    for layer in (10, 2):
        w13, w2 = random_nvfp4(e, 2 * i, h, gen), random_nvfp4(e, h, i, gen)
        base = f"model.layers.{layer}.mlp.experts."
        tensors.update({f"{base}w13_{s}": t for s, t in zip(PROJ_SUFFIXES, w13)})
        tensors.update({f"{base}w2_{s}": t for s, t in zip(PROJ_SUFFIXES, w2)})
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = torch.zeros(e, h, dtype=torch.bfloat16)
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(h, 4 * h, dtype=torch.bfloat16)  # a dense layer
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": h, "intermediate_size": 4 * h, "moe_intermediate_size": i,
        "num_experts": e, "num_experts_per_tok": 4, "hidden_act": "silu", "torch_dtype": "bfloat16"}))
    monkeypatch.setattr(moe_module, "persistent_launch", StubLaunch)  # building a layer loads no kernel here

    assert moe_layer_prefixes(CheckpointFiles.open(tmp_path)) == ["model.layers.2.mlp", "model.layers.10.mlp"]
    layers = load_model_moe(stub_bundle(), tmp_path, progress=False, max_tokens=64)
    assert list(layers) == ["model.layers.2.mlp", "model.layers.10.mlp"]
    for prefix, layer in layers.items():
        assert (layer.top_k, layer.activation.value, layer.max_tokens, layer.num_experts) == (4, "silu", 64, e)
        want13, want2 = load_moe_layer(tmp_path, prefix, num_experts=e, dtype="bf16")
        assert torch.equal(layer.w13.qweight, want13.qweight) and torch.equal(layer.w2.scales, want2.scales)
    with pytest.raises(CheckpointError, match="top_k comes from"):
        load_model_moe(stub_bundle(), tmp_path, progress=False, top_k=2)
    assert list(load_model_moe(stub_bundle(), tmp_path, progress=False, prefixes=["model.layers.10.mlp"])) == [
        "model.layers.10.mlp"]  # one pipeline stage's layers
    with pytest.raises(CheckpointError, match=r"\['model.layers.0.mlp'\] are not MoE layers of .*model.layers.2.mlp"):
        load_model_moe(stub_bundle(), tmp_path, progress=False, prefixes=["model.layers.0.mlp"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": h}))
    with pytest.raises(BadInputError, match="has no expert count"):
        load_model_moe(stub_bundle(), tmp_path, progress=False)


def test_relu2_experts_without_a_gate_projection(tmp_path):
    """Per-expert keys with up_proj and down_proj only (relu2, Nemotron): W13 is the up projection (N = I),
    packed as prepare_w13 packs it, or read as stored as a one-projection (non-gated) W13."""
    from cuteaot.runtime.modelopt import prepare_w13_modelopt

    gen = torch.Generator().manual_seed(31)
    up, down = random_nvfp4(E, I, H, gen), random_nvfp4(E, H, I, gen)
    tensors = {}
    for e in range(E):
        for proj, ts in (("up_proj", up), ("down_proj", down)):
            tensors.update({f"{PREFIX}.experts.{e}.{proj}.{s}": t[e].clone() for s, t in zip(PROJ_SUFFIXES, ts)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    w13, w2 = load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16")
    want13, want2 = prepare_w13(*up, "bf16"), prepare_w2(*down, "bf16")
    assert (w13.n, w13.k) == (I, H)
    for got, want in ((w13, want13), (w2, want2)):
        for name in ("qweight", "scales", "global_scale"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    _assert_packed_equal(load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", tp=(1, 2)),
                         (prepare_w13(*tp_shard_w13(ModelOptTensors(*up), 1, 2, activation="relu2"), "bf16"),
                          prepare_w2(*tp_shard_w2(ModelOptTensors(*down), 1, 2), "bf16")))  # rows of the one projection
    stored13, _ = load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", as_stored=True)
    assert stored13.global_scale.dim() == prepare_w13_modelopt(*up, "bf16", gated=False).global_scale.dim() == 1
    del tensors[f"{PREFIX}.experts.1.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts\.1\.up_proj\.weight"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16")


def test_load_model_moe_reads_a_relu2_model(tmp_path, monkeypatch):
    """A Nemotron-H style config (mlp_hidden_act relu2, n_routed_experts) and checkpoint (backbone.layers.N.mixer.
    experts.{e}.{up,down}_proj) at tiny-fused-relu2's shape: a relu2 MoeLayer of the loaded weights."""
    import cuteaot.runtime.moe as moe_module
    from cuteaot.runtime import load_model_moe
    from tests.stub_bundle import StubLaunch, stub_bundle

    e, h, i, top_k = 8, 576, 320, 3
    gen = torch.Generator().manual_seed(32)
    up, down = random_nvfp4(e, i, h, gen), random_nvfp4(e, h, i, gen)
    prefix = "backbone.layers.1.mixer"
    tensors = {f"{prefix}.experts.{x}.{proj}.{s}": t[x].clone() for x in range(e)
               for proj, ts in (("up_proj", up), ("down_proj", down)) for s, t in zip(PROJ_SUFFIXES, ts)}
    tensors[f"{prefix}.shared_experts.up_proj.weight"] = torch.zeros(8, h // 2, dtype=torch.uint8)  # not routed
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "nemotron_h", "hidden_size": h, "moe_intermediate_size": i, "n_routed_experts": e,
        "num_experts_per_tok": top_k, "mlp_hidden_act": "relu2", "n_shared_experts": 1, "torch_dtype": "bfloat16"}))
    monkeypatch.setattr(moe_module, "persistent_launch", StubLaunch)
    (layer,) = load_model_moe(stub_bundle(), tmp_path, progress=False).values()
    assert (layer.activation.value, layer.top_k, layer.w13.n, layer.intermediate_size) == ("relu2", top_k, i, i)
    assert torch.equal(layer.w13.qweight, prepare_w13(*up, "bf16").qweight)


# ---- one rank's part: tensor- and expert-parallel loading ----------------------------------------


def _stacked(moe):
    """The layer's ModelOpt tensors stacked as prepare_w13 / prepare_w2 take them ([gate | up], (E, 2) scales)."""
    gate, up, down = moe["gate_proj"], moe["up_proj"], moe["down_proj"]
    w13 = ModelOptTensors(torch.cat((gate[0], up[0]), dim=1), torch.cat((gate[1], up[1]), dim=1),
                          torch.stack((gate[2], up[2]), dim=1))
    return w13, ModelOptTensors(*down)


def _assert_packed_equal(got, want):
    for g, w in zip(got, want):
        assert (g.n, g.k, g.num_experts) == (w.n, w.k, w.num_experts)
        for name in ("qweight", "scales", "global_scale", "bias"):
            a, b = getattr(g, name), getattr(w, name)
            assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("layout", ["per_expert", "w31"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_loads_its_slice_of_every_expert(tmp_path, moe, layout, rank):
    """tp=(rank, 2): the packing of tp_shard_w13 / tp_shard_w2 of the whole layer's tensors, whatever the layout."""
    if layout == "per_expert":
        _per_expert_checkpoint(tmp_path, moe)
    else:
        save_file(_fused_tensors(moe, "w31"), str(tmp_path / "model.safetensors"))
    w13, w2 = _stacked(moe)
    want = (prepare_w13(*tp_shard_w13(w13, rank, 2, activation="silu"), "bf16"),
            prepare_w2(*tp_shard_w2(w2, rank, 2), "bf16"))
    got = load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", tp=(rank, 2))
    assert got[0].n == 2 * I // 2 and got[1].k == I // 2
    _assert_packed_equal(got, want)


@pytest.mark.parametrize("layout", ["per_expert", "w13"])
def test_an_expert_parallel_rank_loads_its_experts(tmp_path, moe, layout):
    """ep=(rank, 3) over 4 experts: ranks hold 2, 1, 1 experts, each the packing of ep_select's tensors."""
    if layout == "per_expert":
        _per_expert_checkpoint(tmp_path, moe)
    else:
        save_file(_fused_tensors(moe, "w13"), str(tmp_path / "model.safetensors"))
    w13, w2 = _stacked(moe)
    for rank, count in enumerate((2, 1, 1)):
        local = ep_partition(E, rank, 3)[1]
        got = load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", ep=(rank, 3))
        assert got[0].num_experts == count
        want = prepare_w13(*ep_select(w13, local), "bf16"), prepare_w2(*ep_select(w2, local), "bf16")
        _assert_packed_equal(got, want)


def test_gpt_oss_loads_per_rank(tmp_path):
    """MXFP4 under tp=(1, 2): rows cut from the interleaved gate/up pairs, W2's bias on rank 0 only; under ep:
    the local experts' blocks, scales and biases."""
    tensors = _gpt_oss_tensors(seed=9)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    base = f"{PREFIX}.experts."
    blocks13, scales13, bias13 = (tensors[f"{base}gate_up_proj_{n}"] for n in ("blocks", "scales", "bias"))
    blocks2, scales2, bias2 = (tensors[f"{base}down_proj_{n}"] for n in ("blocks", "scales", "bias"))
    w13, w2 = load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", tp=(1, 2))
    want13 = prepare_w13_mxfp4(*tp_shard_w13_mxfp4(blocks13, scales13, 1, 2), "bf16", order="gate_up",
                               bias=tp_shard_bias13(bias13, 1, 2, activation="swigluoai", order="interleaved"))
    want2 = prepare_w2_mxfp4(*tp_shard_w2_mxfp4(blocks2, scales2, 1, 2), "bf16")
    _assert_packed_equal((w13, w2), (want13, want2))
    assert w2.bias is None  # rank 1: the all-reduce adds rank 0's
    w13, w2 = load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", ep=(1, 2))
    want13 = prepare_w13_mxfp4(blocks13[2:], scales13[2:], "bf16", order="interleaved", bias=bias13[2:])
    want2 = prepare_w2_mxfp4(blocks2[2:], scales2[2:], "bf16", bias=bias2[2:])
    _assert_packed_equal((w13, w2), (want13, want2))


def test_a_rank_that_cannot_be_cut_says_why(tmp_path, moe):
    _per_expert_checkpoint(tmp_path, moe)
    with pytest.raises(CheckpointError, match="pass tp= or ep=, not both"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", tp=(0, 2), ep=(0, 2))
    with pytest.raises(CheckpointError, match=r"tp must be \(rank, world\)"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", tp=2)
    with pytest.raises(BadInputError, match="need 0 <= rank < world"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", ep=(3, 3))
    with pytest.raises(BadInputError, match="5 experts|4 experts cannot be spread over 5 ranks"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", ep=(0, 5))
    with pytest.raises(CheckpointError, match=r"layer 'model.layers.3.mlp'.*does not split 3 ways"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", tp=(0, 3))


def test_load_model_moe_builds_one_ranks_parallel_layers(tmp_path, monkeypatch):
    """With ep=: ParallelMoeLayers whose local layer holds the rank's experts and ep_partition's map (a
    one-process gloo group stands in for NCCL)."""
    import torch.distributed as dist

    import cuteaot.runtime.moe as moe_module
    from cuteaot.runtime import load_model_moe
    from cuteaot.runtime.parallel import ParallelMoeLayer
    from tests.stub_bundle import StubLaunch, stub_bundle

    e, h, i = 16, 512, 256
    gen = torch.Generator().manual_seed(41)
    w13, w2 = random_nvfp4(e, 2 * i, h, gen), random_nvfp4(e, h, i, gen)
    base = "model.layers.0.mlp.experts."
    tensors = {f"{base}w13_{s}": t for s, t in zip(PROJ_SUFFIXES, w13)}
    tensors.update({f"{base}w2_{s}": t for s, t in zip(PROJ_SUFFIXES, w2)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": h, "moe_intermediate_size": i, "num_experts": e,
        "num_experts_per_tok": 4, "hidden_act": "silu", "torch_dtype": "bfloat16"}))
    monkeypatch.setattr(moe_module, "persistent_launch", StubLaunch)
    with pytest.raises(CheckpointError, match=r"expert_map comes from ep=\(rank, world\)"):
        load_model_moe(stub_bundle(), tmp_path, progress=False, expert_map=torch.zeros(e, dtype=torch.int32))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        # the one process is rank 0 of 1: a shard cut for another group is refused before anything is read
        with monkeypatch.context() as m:
            m.setattr(CheckpointFiles, "read", lambda *a: pytest.fail("read a tensor"))
            with pytest.raises(BadInputError, match="the weights are shard 1 of 4, but this process is rank 0 of a "
                                                    "group of 1: pass group="):
                load_model_moe(stub_bundle(), tmp_path, progress=False, ep=(1, 4))
            with pytest.raises(BadInputError, match="shard 0 of 2, but this process is rank 0 of a group of 1"):
                load_model_moe(stub_bundle(), tmp_path, progress=False, tp=(0, 2))
        # rank 1 of a group of 4, as the group says it is
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
        (layer,) = load_model_moe(stub_bundle(), tmp_path, progress=False, ep=(1, 4)).values()
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    assert isinstance(layer, ParallelMoeLayer) and layer.layer.w13.num_experts == 4 and layer.world == 4
    assert torch.equal(layer.layer.expert_map, ep_partition(e, 1, 4)[0])


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_model_directory_goes_through_spec_bundle_and_layers(tmp_path, monkeypatch, family):
    """The whole path on the CPU: config.json + checkpoint -> `cuteaot spec` -> the spec's planned table (the
    stub bundle a build of it would load) -> load_model_moe.  The layers resolve every token count of the
    spec: what the spec declares (swigluoai's default limit, gpt-oss's biases) and what the loader builds are
    the same layer facts.  (It found that a bias read in place from the file may start 8-byte aligned.)"""
    import cuteaot.runtime.moe as moe_module
    from cuteaot.codegen.from_config import write_spec
    from cuteaot.runtime import load_model_moe
    from tests.reference.mxfp4 import random_mxfp4
    from tests.stub_bundle import StubLaunch, stub_bundle

    e, h, i, top_k = 8, 512, 256, 2
    gen = torch.Generator().manual_seed(51)
    base = "model.layers.0.mlp.experts."
    if family == "gpt_oss":
        config = {"num_local_experts": e, "intermediate_size": i, "swiglu_limit": 7.0,
                  "quantization_config": {"quant_method": "mxfp4"}}
        (b13, s13), (b2, s2) = random_mxfp4(e, 2 * i, h, gen), random_mxfp4(e, h, i, gen)
        tensors = {f"{base}gate_up_proj_blocks": b13, f"{base}gate_up_proj_scales": s13,
                   f"{base}gate_up_proj_bias": torch.randn(e, 2 * i, generator=gen).to(torch.bfloat16),
                   f"{base}down_proj_blocks": b2, f"{base}down_proj_scales": s2,
                   f"{base}down_proj_bias": torch.randn(e, h, generator=gen).to(torch.bfloat16)}
    else:
        config = {"num_experts": e, "moe_intermediate_size": i, "intermediate_size": 4 * h}
        w13, w2 = random_nvfp4(e, 2 * i, h, gen), random_nvfp4(e, h, i, gen)
        tensors = {f"{base}w13_{s}": t for s, t in zip(PROJ_SUFFIXES, w13)}
        tensors.update({f"{base}w2_{s}": t for s, t in zip(PROJ_SUFFIXES, w2)})
    config.update(model_type=family, hidden_size=h, num_experts_per_tok=top_k, hidden_act="silu",
                  torch_dtype="bfloat16")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, spec = write_spec(tmp_path, tmp_path / "spec.yaml", targets=("h200",), max_tokens=64)
    monkeypatch.setattr(moe_module, "persistent_launch", StubLaunch)
    (layer,) = load_model_moe(stub_bundle(spec), tmp_path, progress=False).values()
    assert [layer.resolve(m).launch.m_min <= m for m in range(1, 65)] == [True] * 64
    assert (layer.w13_bias is not None) == (family == "gpt_oss")
    assert layer.facts.swiglu_limit == (7.0 if family == "gpt_oss" else None)  # the layer's facts fill the default


# ---- other exports' names: Mixtral's projections, compressed-tensors' tensors ----------------------------------

MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
COMPRESSED = {"weight": "weight_packed", "weight_scale": "weight_scale", "weight_scale_2": "weight_global_scale"}


def _renamed_checkpoint(tmp_path, moe, projections: dict, tensors: dict, inverse: bool, prefix: str = PREFIX):
    """moe's per-expert tensors under other names; `inverse`: the global scale stored as 1 / weight_scale_2
    (computed in float64, so the file holds the nearest float32 to the exact reciprocal)."""
    out = {}
    for e in range(E):
        for proj, ts in moe.items():
            base = f"{prefix}.experts.{e}.{projections.get(proj, proj)}"
            for suffix, t in zip(PROJ_SUFFIXES, ts):
                value = t[e].clone()
                if suffix == "weight_scale_2":
                    value = (1.0 / value.double()).float().reshape(1) if inverse else value
                out[f"{base}.{tensors.get(suffix, suffix)}"] = value
            out[f"{base}.{'input_global_scale' if inverse else 'input_scale'}"] = torch.tensor([50.0])
    out[f"{prefix}.gate.weight"] = torch.zeros(E, H, dtype=torch.bfloat16)  # the router: not the experts'
    save_file(out, str(tmp_path / "model.safetensors"))
    return out


@pytest.mark.parametrize("projections", [{}, MIXTRAL], ids=["hf_names", "mixtral_names"])
def test_mixtral_projection_names(tmp_path, moe, projections):
    """experts.{e}.{w1,w3,w2} (Mixtral, Phi-3.5-MoE: w1 gate, w3 up, w2 down) load as gate/up/down_proj do."""
    _renamed_checkpoint(tmp_path, moe, projections, {}, inverse=False)
    _assert_same(load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16"), _expected(moe, "bf16"), moe)


@pytest.mark.parametrize("projections", [{}, MIXTRAL], ids=["hf_names", "mixtral_names"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_compressed_tensors_nvfp4(tmp_path, moe, projections, dtype):
    """llm-compressor's NVFP4 export (weight_packed, weight_scale, weight_global_scale = 1 / ModelOpt's
    weight_scale_2): the layer's values are codes x block scale / global scale, checked against an
    independent float64 dequantization of the file's own tensors; the codes and block scales are kept
    byte for byte."""
    from tests.reference.nvfp4 import decode_packed_like_device

    written = _renamed_checkpoint(tmp_path, moe, projections, COMPRESSED, inverse=True)
    w13, w2 = load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype=dtype)
    names = {p: projections.get(p, p) for p in moe}

    def reference(rows: list[str]) -> torch.Tensor:  # (E, N, K) float64 of the file's tensors
        per_expert = []
        for e in range(E):
            parts = []
            for proj in rows:
                base = f"{PREFIX}.experts.{e}.{names[proj]}."
                codes = written[base + "weight_packed"].long()
                codes = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)
                magnitude = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)[codes & 7]
                e2m1 = torch.where(codes >= 8, -magnitude, magnitude)
                block = written[base + "weight_scale"].double().repeat_interleave(16, dim=-1)
                parts.append(e2m1 * block / written[base + "weight_global_scale"].double())
            per_expert.append(torch.cat(parts))
        return torch.stack(per_expert)

    for got, rows in ((w13, ["gate_proj", "up_proj"]), (w2, ["down_proj"])):
        want = reference(rows)
        have = decode_packed_like_device(got.qweight, got.scales, got.global_scale, dtype).double()
        assert want.abs().max() > 0
        # the reciprocal in float32 (one rounding) and the packed global scale's own: a few float32 ulps
        torch.testing.assert_close(have, want, rtol=4e-7, atol=0)
        weight, scale, _ = unpack_nvfp4(got)
        assert torch.equal(weight, torch.cat([moe[p][0] for p in rows], dim=1))
        assert torch.equal(scale.view(torch.uint8), torch.cat([moe[p][1] for p in rows], dim=1).view(torch.uint8))


def test_compressed_tensors_as_stored_tensor_parallel_and_expert_parallel(tmp_path, moe):
    """The same reads as ModelOpt's per-expert keys: as stored (the checkpoint's bytes, the reciprocal global
    scales), one tensor-parallel rank's slice, one expert-parallel rank's experts."""
    from cuteaot.runtime import ModelOptNvfp4

    written = _renamed_checkpoint(tmp_path, moe, {}, COMPRESSED, inverse=True)
    inverse = {p: torch.stack([torch.reciprocal(written[f"{PREFIX}.experts.{e}.{p}.weight_global_scale"][0])
                               for e in range(E)]) for p in moe}
    as_modelopt = {p: (ts[0], ts[1], inverse[p]) for p, ts in moe.items()}
    w13, w2 = load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", as_stored=True)
    assert isinstance(w13, ModelOptNvfp4)
    assert torch.equal(w13.qweight, torch.cat((moe["gate_proj"][0], moe["up_proj"][0]), dim=1))
    assert torch.equal(w2.qweight, moe["down_proj"][0])
    _assert_packed_equal(load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16"), _expected(as_modelopt, "bf16"))
    full13, full2 = _stacked(as_modelopt)
    _assert_packed_equal(load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", tp=(1, 2)),
                         (prepare_w13(*tp_shard_w13(full13, 1, 2, activation="silu"), "bf16"),
                          prepare_w2(*tp_shard_w2(full2, 1, 2), "bf16")))
    local = ep_partition(E, 1, 2)[1]
    _assert_packed_equal(load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", ep=(1, 2)),
                         (prepare_w13(*ep_select(full13, local), "bf16"), prepare_w2(*ep_select(full2, local), "bf16")))


@pytest.mark.parametrize("bad", [0.0, -2.0, float("inf"), float("nan")])
def test_a_compressed_tensors_global_scale_that_cannot_divide_is_refused(tmp_path, moe, bad):
    written = _renamed_checkpoint(tmp_path, moe, {}, COMPRESSED, inverse=True)
    key = f"{PREFIX}.experts.2.up_proj.weight_global_scale"
    written[key] = torch.tensor([bad])
    save_file(written, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{re.escape(key)} = {bad:g}: .* must be positive and finite"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16")


def test_a_compressed_tensors_scale_of_the_wrong_dtype_names_the_key(tmp_path, moe):
    written = _renamed_checkpoint(tmp_path, moe, MIXTRAL, COMPRESSED, inverse=True)
    key = f"{PREFIX}.experts.1.w2.weight_scale"
    written[key] = written[key].float()
    save_file(written, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{re.escape(key)} in .*expected dtype float8_e4m3fn .*got float32"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16")


def test_two_exports_of_one_layer_are_refused(tmp_path, moe):
    """A file with expert 0 both as ModelOpt's weight and compressed-tensors' weight_packed: which one is meant
    is not ours to guess."""
    written = _renamed_checkpoint(tmp_path, moe, {}, COMPRESSED, inverse=True)
    written.update(_per_expert_tensors(moe, range(E)))
    save_file(written, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="several namings.*gate_proj.weight'.*gate_proj.weight_packed"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16")


def test_load_model_moe_reads_a_compressed_tensors_mixtral(tmp_path, monkeypatch):
    """A Mixtral config with llm-compressor's quantization_config and its checkpoint (model.layers.N.
    block_sparse_moe.experts.{e}.{w1,w3,w2}.weight_packed ...), at tiny-fused's shape: MoeLayers of the
    weights load_moe_layer reads."""
    import cuteaot.runtime.moe as moe_module
    from cuteaot.runtime import load_model_moe
    from tests.stub_bundle import StubLaunch, stub_bundle

    e, h, i = 16, 512, 256
    gen = torch.Generator().manual_seed(41)
    tensors = {}
    for layer in (0, 1):
        w13, w2 = random_nvfp4(e, 2 * i, h, gen), random_nvfp4(e, h, i, gen)
        for x in range(e):
            base = f"model.layers.{layer}.block_sparse_moe.experts.{x}."
            for name, rows in (("w1", slice(0, i)), ("w3", slice(i, 2 * i))):
                tensors[base + f"{name}.weight_packed"] = w13[0][x, rows].clone()
                tensors[base + f"{name}.weight_scale"] = w13[1][x, rows].clone()
                tensors[base + f"{name}.weight_global_scale"] = (1 / w13[2][x].double()).float().reshape(1)
            tensors[base + "w2.weight_packed"] = w2[0][x].clone()
            tensors[base + "w2.weight_scale"] = w2[1][x].clone()
            tensors[base + "w2.weight_global_scale"] = (1 / w2[2][x].double()).float().reshape(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": h, "intermediate_size": i, "num_local_experts": e,
        "num_experts_per_tok": 4, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}}))
    monkeypatch.setattr(moe_module, "persistent_launch", StubLaunch)

    layers = load_model_moe(stub_bundle(), tmp_path, progress=False, max_tokens=64)
    assert list(layers) == ["model.layers.0.block_sparse_moe", "model.layers.1.block_sparse_moe"]
    for prefix, layer in layers.items():
        assert (layer.top_k, layer.num_experts, layer.w13.n, layer.w13.k) == (4, e, 2 * i, h)
        want13, want2 = load_moe_layer(tmp_path, prefix, num_experts=e, dtype="bf16")
        assert torch.equal(layer.w13.qweight, want13.qweight) and torch.equal(layer.w2.global_scale, want2.global_scale)


def test_is_draft_layer():
    from cuteaot.runtime.checkpoint import is_draft_layer

    assert is_draft_layer("model.layers.61.mlp", 61) and not is_draft_layer("model.layers.60.mlp", 61)
    assert not is_draft_layer("model.layers.61.mlp", None)  # no layer count in the config: nothing is dropped
    assert is_draft_layer("mtp.layers.0.mlp", 48) and is_draft_layer("model.mtp_layers.0.mlp", 36)
    assert not is_draft_layer("language_model.model.layers.47.feed_forward", 48)
    assert not is_draft_layer("backbone.layers.51.mixer", 52) and not is_draft_layer("model.layers.2.smtp.mlp", 3)


def test_load_model_moe_leaves_out_multi_token_prediction_layers(tmp_path, monkeypatch):
    """DeepSeek-V3-style: num_hidden_layers = 2 and the checkpoint's MoE layers 1 and 2 (2: the MTP layer a
    draft model uses), plus Qwen3-Next-style `mtp.layers.0.mlp`: the main model's layer 1 only, unless
    `prefixes=` names the others."""
    import cuteaot.runtime.moe as moe_module
    from cuteaot.runtime import load_model_moe
    from tests.stub_bundle import StubLaunch, stub_bundle

    e, h, i = 16, 512, 256
    gen = torch.Generator().manual_seed(43)
    tensors = {}
    for prefix in ("model.layers.1.mlp", "model.layers.2.mlp", "mtp.layers.0.mlp"):
        w13, w2 = random_nvfp4(e, 2 * i, h, gen), random_nvfp4(e, h, i, gen)
        tensors.update({f"{prefix}.experts.w13_{s}": t for s, t in zip(PROJ_SUFFIXES, w13)})
        tensors.update({f"{prefix}.experts.w2_{s}": t for s, t in zip(PROJ_SUFFIXES, w2)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = {"model_type": "deepseek_v3", "hidden_size": h, "moe_intermediate_size": i, "n_routed_experts": e,
              "num_experts_per_tok": 4, "hidden_act": "silu", "torch_dtype": "bfloat16", "num_hidden_layers": 2,
              "num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(moe_module, "persistent_launch", StubLaunch)

    assert list(load_model_moe(stub_bundle(), tmp_path, progress=False, max_tokens=64)) == ["model.layers.1.mlp"]
    drafts = ["model.layers.2.mlp", "mtp.layers.0.mlp"]
    assert list(load_model_moe(stub_bundle(), tmp_path, progress=False, max_tokens=64, prefixes=drafts)) == drafts
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=1)))
    with pytest.raises(CheckpointError, match="every MoE layer .* is a multi-token-prediction layer"):
        load_model_moe(stub_bundle(), tmp_path, progress=False, prefixes=None)


def test_compressed_tensors_relu2_experts(tmp_path):
    """Nemotron-style experts (up_proj and down_proj only) in compressed-tensors' names: W13 is the up projection,
    its global scale the reciprocal of the file's divisor."""
    gen = torch.Generator().manual_seed(47)
    up, down = random_nvfp4(E, I, H, gen), random_nvfp4(E, H, I, gen)
    tensors = {}
    for e in range(E):
        for proj, (weight, scale, scale_2) in (("up_proj", up), ("down_proj", down)):
            base = f"{PREFIX}.experts.{e}.{proj}."
            tensors[base + "weight_packed"], tensors[base + "weight_scale"] = weight[e].clone(), scale[e].clone()
            tensors[base + "weight_global_scale"] = (1 / scale_2[e].double()).float().reshape(1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    w13, w2 = load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16")
    inverse = {p: torch.stack([torch.reciprocal(tensors[f"{PREFIX}.experts.{e}.{p}.weight_global_scale"][0])
                               for e in range(E)]) for p in ("up_proj", "down_proj")}
    _assert_packed_equal((w13, w2), (prepare_w13(up[0], up[1], inverse["up_proj"], "bf16"),
                                     prepare_w2(down[0], down[1], inverse["down_proj"], "bf16")))
    assert (w13.n, w13.k) == (I, H)


@pytest.mark.parametrize("projections, tensors", [({}, {}), (MIXTRAL, COMPRESSED)], ids=["modelopt", "compressed"])
def test_a_layer_with_more_experts_than_asked_is_refused(tmp_path, moe, projections, tensors):
    """num_experts=3 on a 4-expert layer would drop expert 3: refused, with the count the layer holds."""
    _renamed_checkpoint(tmp_path, moe, projections, tensors, inverse=bool(tensors))
    with pytest.raises(CheckpointError, match=r"holds 4 experts .*experts\.3\..* but num_experts=3"):
        load_moe_layer(tmp_path, PREFIX, num_experts=3, dtype="bf16")
    load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", ep=(0, 2))  # a rank's part is not a smaller E


def test_expert_0_without_a_gate_projection_among_gated_experts_is_refused(tmp_path, moe):
    written = _per_expert_tensors(moe, range(E))
    for suffix in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
        del written[f"{PREFIX}.experts.0.gate_proj.{suffix}"]
    save_file(written, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"expert 0 has no gate_proj but experts \[1, 2, 3\] do"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16")


@pytest.mark.parametrize("dtype", ["bfloat16", "torch.bfloat16", torch.bfloat16])
def test_hugging_face_dtype_spellings(tmp_path, moe, dtype):
    _per_expert_checkpoint(tmp_path, moe)
    assert load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype=dtype)[0].dtype.value == "bf16"


def test_a_bad_dtype_is_refused_before_any_read(tmp_path, moe, monkeypatch):
    from cuteaot.runtime import load_model_moe

    _per_expert_checkpoint(tmp_path, moe)
    monkeypatch.setattr(CheckpointFiles, "read", lambda *a: pytest.fail("read a tensor"))
    with pytest.raises(BadInputError, match=r"dtype .* must be one of \['bf16', 'fp16'\].*got 'float32'"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": H, "moe_intermediate_size": I, "num_experts": E,
        "num_experts_per_tok": 2, "hidden_act": "silu", "torch_dtype": "bfloat16"}))
    with pytest.raises(BadInputError, match="got torch.float32"):
        load_model_moe(None, tmp_path, dtype=torch.float32)


def test_a_stacked_relu2_layer_is_read_ungated(tmp_path):
    """experts.w13_* with I rows (relu2's up projection alone; w2's K says I): packed as one projection, and a
    tensor-parallel rank takes the same I slice of W13's rows as of W2's columns."""
    gen = torch.Generator().manual_seed(53)
    up, down = random_nvfp4(E, I, H, gen), random_nvfp4(E, H, I, gen)
    base = f"{PREFIX}.experts."
    tensors = {f"{base}w31_{s}": t for s, t in zip(PROJ_SUFFIXES, up)}  # the order name means nothing here
    tensors.update({f"{base}w2_{s}": t for s, t in zip(PROJ_SUFFIXES, down)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _assert_packed_equal(load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16"),
                         (prepare_w13(*up, "bf16"), prepare_w2(*down, "bf16")))
    _assert_packed_equal(load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", tp=(1, 2)),
                         (prepare_w13(*tp_shard_w13(ModelOptTensors(*up), 1, 2, activation="relu2"), "bf16"),
                          prepare_w2(*tp_shard_w2(ModelOptTensors(*down), 1, 2), "bf16")))
    tensors[f"{base}w31_weight"] = torch.zeros(E, I + 16, H // 2, dtype=torch.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{I + 16} rows, but w2's K is I = {I}: W13 holds 2I"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16")


@pytest.mark.parametrize("layout", ["per_expert", "w13", "gpt_oss"])
def test_a_tensor_parallel_degree_that_cannot_cut_i_is_refused_before_any_read(tmp_path, moe, layout, monkeypatch):
    if layout == "per_expert":
        _per_expert_checkpoint(tmp_path, moe)
    elif layout == "w13":
        save_file(_fused_tensors(moe, "w13"), str(tmp_path / "model.safetensors"))
    else:
        save_file(_gpt_oss_tensors(), str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(CheckpointFiles, "read", lambda *a: pytest.fail("read a tensor"))
    with pytest.raises(BadInputError, match="does not split 3 ways"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", tp=(0, 3))
    with pytest.raises(BadInputError, match=r"need 0 <= rank < world, got rank=2, world=2"):
        load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", tp=(2, 2))


def test_an_index_whose_weight_map_is_not_a_mapping(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a", "b"]}))
    with pytest.raises(CheckpointError, match="not a readable safetensors index .*'weight_map' is a JSON list"):
        CheckpointFiles.open(tmp_path)

