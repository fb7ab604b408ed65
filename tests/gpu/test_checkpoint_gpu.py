"""A layer loaded from a safetensors checkpoint straight onto the GPU serves the checkpoint's weights.

Bundle: specs/tiny-fused.yaml (the silu problem: H 512, I 256, 16 experts, top 4, bf16).  A
synthetic NVFP4 checkpoint (per-expert keys, two shards with an index; ModelOpt's names, or
compressed-tensors' with Mixtral's projection names) is written,
loaded with device="cuda", and the layer's output is compared with the float32 reference of the
dequantised checkpoint tensors, outputs poisoned first.
"""

from __future__ import annotations

import json

import pytest
import torch

from cuteaot.runtime import load_bundle, load_moe_layer
from cuteaot.runtime.moe import MoeLayer
from tests.reference.moe import moe_reference
from tests.reference.nvfp4 import dequantize_modelopt, random_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
save_file = pytest.importorskip("safetensors.torch", reason="checkpoint loading needs safetensors").save_file

H, I, E, TOP_K = 512, 256, 16, 4
PREFIX = "model.layers.0.mlp"


def _checkpoint(tmp_path, export: str = "modelopt"):
    """The layer's ModelOpt tensors, written as `export` stores them: "modelopt" (gate_proj / up_proj /
    down_proj, weight_scale_2) or "compressed-tensors" with Mixtral's names (w1 / w3 / w2, weight_packed,
    weight_global_scale = 1 / weight_scale_2)."""
    g = torch.Generator().manual_seed(21)
    w13, w2 = random_nvfp4(E, 2 * I, H, g), random_nvfp4(E, H, I, g)  # rows [gate | up]
    mixtral = export == "compressed-tensors"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    projections = dict(zip(names, (tuple(t[:, :I] if t.dim() == 3 else t for t in w13),
                                   tuple(t[:, I:] if t.dim() == 3 else t for t in w13), w2)))
    shards, weight_map = [{}, {}], {}
    for e in range(E):
        for proj, (weight, scale, scale_2) in projections.items():
            key = f"{PREFIX}.experts.{e}.{proj}"
            shard = shards[e * 2 // E]
            shard.update({f"{key}.weight": weight[e].contiguous(), f"{key}.weight_scale": scale[e].contiguous(),
                          f"{key}.weight_scale_2": scale_2[e].clone()})
            if mixtral:
                shard[f"{key}.weight_packed"] = shard.pop(f"{key}.weight")
                shard[f"{key}.weight_global_scale"] = (1 / shard.pop(f"{key}.weight_scale_2").double()).float()
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(tensors, str(tmp_path / name))
        weight_map.update({k: name for k in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return w13, w2


@pytest.mark.parametrize("export", ["modelopt", "compressed-tensors"])
def test_a_layer_loaded_onto_the_gpu_matches_the_checkpoint(fused_bundle_dir, tmp_path, export):
    bundle = load_bundle(fused_bundle_dir)
    w13_q, w2_q = _checkpoint(tmp_path, export)
    w13, w2 = load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", device="cuda")
    assert w13.device.type == w2.device.type == "cuda"
    _assert_serves(MoeLayer(bundle, w13, w2, top_k=TOP_K), w13_q, w2_q, (1, 37, 600), seed=22)


def _assert_serves(layer, w13_q, w2_q, tokens, seed: int) -> None:
    """The layer's output at each M against the float32 reference of the dequantised checkpoint tensors,
    the output poisoned with NaN first."""
    w13_f, w2_f = dequantize_modelopt(*w13_q).cuda(), dequantize_modelopt(*w2_q).cuda()
    g = torch.Generator().manual_seed(seed)
    for m in tokens:
        x = (torch.randn(m, H, generator=g) * 2).to(torch.bfloat16).cuda()
        ids = torch.rand(m, E, generator=g).topk(TOP_K, dim=1).indices.to(torch.int32).cuda()
        w = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=1).cuda()
        out = torch.full((m, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        layer(x, w, ids, out=out)
        ref, _, _ = moe_reference(x, w13_f, w2_f, w, ids, "silu")
        err = float((out.float() - ref).norm() / ref.norm())
        assert err <= 1e-2, f"M={m}: rel err {err:.2e}"


def test_a_model_directory_loads_into_layers_that_match_the_checkpoint(fused_bundle_dir, tmp_path):
    """load_model_moe: config.json + the checkpoint -> the model's MoE layers on the GPU, top-k and activation
    from the config, each against the float32 reference of its dequantised tensors."""
    from cuteaot.runtime import load_model_moe

    bundle = load_bundle(fused_bundle_dir)
    w13_q, w2_q = _checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": H, "intermediate_size": 4 * H, "moe_intermediate_size": I,
        "num_experts": E, "num_experts_per_tok": TOP_K, "hidden_act": "silu", "torch_dtype": "bfloat16"}))
    layers = load_model_moe(bundle, tmp_path, progress=False)
    assert list(layers) == [PREFIX]
    layer = layers[PREFIX]
    assert layer.w13.qweight.is_cuda and layer.top_k == TOP_K
    _assert_serves(layer, w13_q, w2_q, (1, 64), seed=23)


def test_expert_parallel_ranks_loaded_from_the_checkpoint_add_up_to_the_layer(fused_bundle_dir, tmp_path):
    """load_moe_layer(ep=(rank, 3)): each rank reads its experts of the per-expert checkpoint; the ranks' layers
    (expert maps from ep_partition), run one after another on one GPU, add up to the whole layer (what the
    all-reduce computes) and to the float32 reference."""
    from cuteaot.runtime.parallel import ep_partition

    bundle = load_bundle(fused_bundle_dir)
    w13_q, w2_q = _checkpoint(tmp_path)
    full = MoeLayer(bundle, *load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", device="cuda"),
                    top_k=TOP_K)
    ranks = [MoeLayer(bundle, *load_moe_layer(tmp_path, PREFIX, num_experts=E, dtype="bf16", device="cuda",
                                              ep=(rank, 3)),
                      top_k=TOP_K, expert_map=ep_partition(E, rank, 3, device="cuda")[0]) for rank in range(3)]
    assert [layer.w13.num_experts for layer in ranks] == [6, 5, 5]
    w13_f, w2_f = dequantize_modelopt(*w13_q).cuda(), dequantize_modelopt(*w2_q).cuda()
    g = torch.Generator().manual_seed(24)
    for m in (1, 37, 600):
        x = torch.randn(m, H, generator=g).to(torch.bfloat16).cuda()
        ids = torch.rand(m, E, generator=g).topk(TOP_K, dim=1).indices.to(torch.int32).cuda()
        w = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=1).cuda()
        total = sum(layer(x, w, ids).float() for layer in ranks)
        whole = full(x, w, ids).float()
        ref, _, _ = moe_reference(x, w13_f, w2_f, w, ids, "silu")
        for what, err in (("the whole layer", (total - whole).norm() / whole.norm()),
                          ("the float32 reference", (total - ref).norm() / ref.norm())):
            assert float(err) <= 1e-2, f"M={m}: the ranks' sum against {what}: rel err {float(err):.2e}"
