"""Tensor- and expert-parallel MoE on the H200s: shards run as single-GPU layers, and NCCL across GPUs.

One GPU (bundle specs/moe-models.yaml, CUTEAOT_MODELS_BUNDLE to override): the ranks of a TP
split run one after another on one GPU, each as an ordinary MoeLayer on its tp_shard_w13 /
tp_shard_w2 shard; their outputs must add up to the unsharded layer (what the all-reduce
computes) and to the float32 reference.  Gated: Qwen3-235B-A22B, whose TP 2/4/8 shard sizes
the bundle builds, for each checkpoint row order.  relu2: Nemotron-3-Nano (H 2688, I 1856,
E 128, top-k 6); the bundle builds it at I = 1856 only (no `tp:` list), so each rank's shard
runs in the I = 1856 layer with its rows / columns at its slice of I and zeros elsewhere,
which computes exactly the shard layer (relu2(0) = 0 and zero W2 columns add nothing).

Several GPUs: W = every GPU of the host, up to 4 (the TP shards specs/parallel.yaml builds).
Bundle: specs/parallel.yaml (CUTEAOT_PARALLEL_BUNDLE to override).  For Qwen3-30B-A3B and
gpt-oss-120b shapes at M in {1, 8, 64, 1024}, TP=W and EP=W outputs (local fused layer +
all-reduce) must equal the single-GPU layer with the full weights within bf16 tolerance, and a
CUDA graph captured per rank must replay what eager computed.  Skipped with fewer than 2 GPUs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


MAX_WORLD = 4  # the largest TP shard count of specs/parallel.yaml
TOKENS = (1, 37, 1000)
TOL = 1e-2
# specs/moe-models.yaml: (H, I, E, top_k)
QWEN3_235B = (4096, 1536, 128, 8)  # silu; built as qwen3-235b-a22b-tp1/2/4/8
NEMOTRON_3_NANO = (2688, 1856, 128, 6)  # relu2; built at I = 1856 only


@pytest.fixture(scope="module")
def models_bundle():
    from cuteaot.runtime import load_bundle

    path = Path(os.environ.get("CUTEAOT_MODELS_BUNDLE", ROOT / "generated" / "moe-models"))
    if not (path / "manifest.json").is_file():
        pytest.fail(f"{path} is not built: run `cuteaot build specs/moe-models.yaml --targets h200` first")
    return load_bundle(path)


def _stored_w13(gate, up, order: str):
    """A checkpoint W13 holding the (weight, weight_scale, weight_scale_2) rows `gate` and `up` in `order`."""
    from cuteaot.runtime.parallel import ModelOptTensors

    def join(a, b):
        if order == "interleaved":
            return torch.stack((a, b), 2).flatten(1, 2)
        return torch.cat((a, b) if order == "gate_up" else (b, a), 1)

    return ModelOptTensors(join(gate[0], up[0]), join(gate[1].view(torch.uint8), up[1].view(torch.uint8))
                           .view(torch.float8_e4m3fn), gate[2])


def _inputs(m: int, h: int, e: int, top_k: int, g: torch.Generator):
    x = torch.randn(m, h, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.rand(m, e, generator=g, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(m, top_k, generator=g, device="cuda"), dim=1)
    return x, weights, ids


def _assert_ranks_sum_to_the_layer(full, ranks, w13_f, w2_f, activation, h, e, top_k, seed, what):
    """sum over the rank layers == the unsharded layer and the float32 reference, for every M in TOKENS."""
    from tests.reference.moe import moe_reference

    g = torch.Generator(device="cuda").manual_seed(seed)
    for m in TOKENS:
        x, weights, ids = _inputs(m, h, e, top_k, g)
        whole = full(x, weights, ids, out=torch.full((m, h), float("nan"), dtype=torch.bfloat16, device="cuda"))
        total = torch.zeros(m, h, device="cuda")
        for rank, layer in enumerate(ranks):
            part = layer(x, weights, ids, out=torch.full((m, h), float("nan"), dtype=torch.bfloat16, device="cuda"))
            assert not part.isnan().any(), f"{what} M={m}: NaN in rank {rank}'s output"
            total += part.float()
        ref, _, _ = moe_reference(x, w13_f, w2_f, weights, ids, activation)
        assert not whole.isnan().any(), f"{what} M={m}: NaN in the unsharded output"
        vs_layer = float((total - whole.float()).norm() / whole.float().norm())
        vs_ref = float((total - ref).norm() / ref.norm())
        assert vs_layer <= TOL, f"{what} M={m}: sum over ranks vs unsharded layer rel err {vs_layer:.2e}"
        assert vs_ref <= TOL, f"{what} M={m}: sum over ranks vs float32 reference rel err {vs_ref:.2e}"


@pytest.mark.parametrize("world,order", [(2, "gate_up"), (4, "up_gate"), (8, "interleaved")])
def test_gated_tp_shard_layers_sum_to_the_whole_layer(models_bundle, world, order):
    """Qwen3-235B-A22B: the TP=world shard layers (kernels built for I / world) add up to TP=1."""
    from cuteaot.runtime import prepare_w2, prepare_w13
    from cuteaot.runtime.moe import MoeLayer
    from cuteaot.runtime.parallel import ModelOptTensors, tp_shard_w2, tp_shard_w13
    from tests.reference.nvfp4 import dequantize_modelopt, random_nvfp4

    h, i, e, top_k = QWEN3_235B
    g = torch.Generator(device="cuda").manual_seed(1000 + world)
    gate, up, w2 = random_nvfp4(e, i, h, g), random_nvfp4(e, i, h, g), ModelOptTensors(*random_nvfp4(e, h, i, g))
    w13 = _stored_w13(gate, (up[0], up[1], gate[2]), order)
    full = MoeLayer(models_bundle, prepare_w13(*w13, "bf16", order=order), prepare_w2(*w2, "bf16"), top_k=top_k)
    ranks = [MoeLayer(models_bundle, prepare_w13(*tp_shard_w13(w13, r, world, activation="silu", order=order), "bf16"),
                      prepare_w2(*tp_shard_w2(w2, r, world), "bf16"), top_k=top_k) for r in range(world)]
    assert all(layer.intermediate_size == i // world for layer in ranks)
    w13_f = torch.cat((dequantize_modelopt(*gate), dequantize_modelopt(up[0], up[1], gate[2])), 1)
    _assert_ranks_sum_to_the_layer(full, ranks, w13_f, dequantize_modelopt(*w2), "silu", h, e, top_k, world,
                                   f"qwen3-235b TP={world} {order}")


def _embedded(shard, full_shape, dim: int, part: slice):
    """A zero tensor of `full_shape` (u8, or e4m3 through its bytes) holding `shard` at `part` of `dim`."""
    out = torch.zeros(full_shape, dtype=torch.uint8, device=shard.device)
    index = [slice(None)] * len(full_shape)
    index[dim] = part
    out[tuple(index)] = shard.view(torch.uint8)
    return out.view(shard.dtype)


@pytest.mark.parametrize("world", [2, 4])
def test_relu2_tp_shards_sum_to_the_whole_layer(models_bundle, world):
    """Nemotron-3-Nano: rank r's relu2 shard, run in the I = 1856 layer at rows / columns
    [r*I/w, (r+1)*I/w) (the only size the bundle builds), adds up over ranks to the whole layer."""
    from cuteaot.runtime import prepare_w2, prepare_w13
    from cuteaot.runtime.moe import MoeLayer
    from cuteaot.runtime.parallel import ModelOptTensors, tp_shard_w2, tp_shard_w13
    from tests.reference.nvfp4 import dequantize_modelopt, random_nvfp4

    h, i, e, top_k = NEMOTRON_3_NANO
    g = torch.Generator(device="cuda").manual_seed(2000 + world)
    w13, w2 = ModelOptTensors(*random_nvfp4(e, i, h, g)), ModelOptTensors(*random_nvfp4(e, h, i, g))
    full = MoeLayer(models_bundle, prepare_w13(*w13, "bf16"), prepare_w2(*w2, "bf16"), top_k=top_k, activation="relu2")
    part = i // world
    ranks = []
    for r in range(world):
        s13, s2 = tp_shard_w13(w13, r, world, activation="relu2"), tp_shard_w2(w2, r, world)
        assert s13.weight.shape == (e, part, h // 2) and s2.weight.shape == (e, h, part // 2)
        rows = slice(r * part, (r + 1) * part)  # the rank's slice of I, by hand
        e13 = (_embedded(s13.weight, w13.weight.shape, 1, rows),
               _embedded(s13.weight_scale, w13.weight_scale.shape, 1, rows), s13.weight_scale_2)
        e2 = (_embedded(s2.weight, w2.weight.shape, 2, slice(rows.start // 2, rows.stop // 2)),
              _embedded(s2.weight_scale, w2.weight_scale.shape, 2, slice(rows.start // 16, rows.stop // 16)),
              s2.weight_scale_2)
        ranks.append(MoeLayer(models_bundle, prepare_w13(*e13, "bf16"), prepare_w2(*e2, "bf16"), top_k=top_k,
                              activation="relu2"))
    _assert_ranks_sum_to_the_layer(full, ranks, dequantize_modelopt(*w13), dequantize_modelopt(*w2), "relu2",
                                   h, e, top_k, world, f"nemotron-3-nano relu2 TP={world}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs of one host")
def test_tp_and_ep_equal_one_gpu():
    from benchmarks.parallel import run

    path = Path(os.environ.get("CUTEAOT_PARALLEL_BUNDLE", ROOT / "generated" / "parallel"))
    if not (path / "manifest.json").is_file():
        pytest.fail(f"{path} is not built: run `cuteaot build specs/parallel.yaml` first")
    world = min(torch.cuda.device_count(), MAX_WORLD)
    rows = run(str(path), world, timing=False, watchdog=420)
    assert len(rows) == world * 2 * 4
    for r in rows:
        what = f"{r['model']} M={r['M']} rank {r['rank']} of {world}"
        assert r["tp_rel_err"] <= 1e-2, f"{what}: TP rel err {r['tp_rel_err']:.2e}"
        assert r["ep_rel_err"] <= 1e-2, f"{what}: EP rel err {r['ep_rel_err']:.2e}"
        assert r["tp_graph_vs_eager"] <= 5e-3 and r["ep_graph_vs_eager"] <= 5e-3, what
    print(f"\nworst TP={world} / EP={world} rel err vs one GPU:", max(r["tp_rel_err"] for r in rows),
          max(r["ep_rel_err"] for r in rows))
