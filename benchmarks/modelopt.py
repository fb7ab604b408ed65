"""NVFP4 read as stored (weights: modelopt) against the packed layout, on the H200 (issue 15).

    python -m benchmarks.modelopt --bundle generated/bench-modelopt [--models qwen3-30b-a3b,glm-4.5-air,nemotron-3-nano]
                                  [--m 1,8,64,256,1024,4096] [--json docs/results/modelopt-<date>.json]

Per model and M, in one process, on one random ModelOpt NVFP4 checkpoint (gate and up quantized
apart, given one global scale so that the packed form is exact too; relu2 layers have one projection),
one routing (uniform top-k) and one input:

* `packed`    MoeLayer on prepare_w13 / prepare_w2 of the checkpoint (repacked);
* `modelopt`  MoeLayer on prepare_w13_modelopt / prepare_w2_modelopt of the same tensors (no copy).

Timing: benchmarks/common.FlushedTimer (each call replayed from a one-call CUDA graph after an untimed L2
flush, nothing subtracted, the layouts interleaved sample by sample; medians). Beside each time: the weight
bytes the routing touches (the distinct routed experts' codes and scales of W13 and W2; the same for both
layouts) at the measured copy bandwidth (`floor`). At --check-m both outputs are compared with the float32
reference on the dequantized checkpoint, after poisoning.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from benchmarks.common import compare_formats, layer_benchmark_main
from tests.reference.moe import moe_reference
from tests.reference.nvfp4 import dequantize_modelopt, random_nvfp4

REPO = Path(__file__).resolve().parents[1]
# H, I, E, top_k, activation.  Nemotron-3-Nano's I = 1856 is 64 (mod 128): read as stored, FC1's last N tile is
# masked and FC2's k-tiles are 64 deep.
MODELS = {"qwen3-30b-a3b": (2048, 768, 128, 8, "silu"), "glm-4.5-air": (4096, 1408, 128, 8, "silu"),
          "nemotron-3-nano": (2688, 1856, 128, 6, "relu2")}


def _expert_bytes(w) -> int:
    return (w.qweight.numel() * w.qweight.element_size() + w.scales.numel()) // w.num_experts


def _build(bundle, name, g):
    """Both layers of one model on one random checkpoint, with their float32 reference."""
    from cuteaot.runtime import MoeLayer, prepare_w2, prepare_w2_modelopt, prepare_w13, prepare_w13_modelopt

    h, i, e, top_k, activation = MODELS[name]
    gated = activation != "relu2"
    gate, down = random_nvfp4(e, i, h, g), random_nvfp4(e, h, i, g)
    if gated:
        up = random_nvfp4(e, i, h, g)
        w13_t = [torch.cat((gate[j], up[j]), dim=1) for j in (0, 1)]
        scale_2 = torch.stack((gate[2], gate[2]), dim=1)  # one global scale: the packed form is exact too
        w13_f = torch.cat((dequantize_modelopt(*gate), dequantize_modelopt(up[0], up[1], gate[2])), dim=1)
    else:
        w13_t, scale_2, w13_f = gate[:2], gate[2], dequantize_modelopt(*gate)
    ref_w = (w13_f, dequantize_modelopt(*down))

    def reference(x, w, ids):
        return moe_reference(x, *ref_w, w, ids, activation)[0]

    layers = {}
    for impl, (p13, p2) in {"packed": (prepare_w13, prepare_w2),
                            "modelopt": (functools.partial(prepare_w13_modelopt, gated=gated), prepare_w2_modelopt)}.items():
        w13, w2 = p13(*w13_t, scale_2, "bf16"), p2(*down, "bf16")
        layers[impl] = (MoeLayer(bundle, w13, w2, top_k=top_k, activation=activation), reference,
                        _expert_bytes(w13) + _expert_bytes(w2))
    return (h, e, top_k), layers


def run(bundle, models, ms, check_m, rounds) -> list[dict]:
    return compare_formats(bundle, models, ms, check_m, rounds, _build, floors=True)


def table(rows: list[dict]) -> str:
    by = {(r["model"], r["M"], r["impl"]): r for r in rows}
    lines = ["| model | M | floor µs | packed µs | modelopt µs | modelopt / packed time |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for model, m in dict.fromkeys((r["model"], r["M"]) for r in rows if "us" in r):
        a, b = by[(model, m, "packed")], by[(model, m, "modelopt")]
        lines.append(f"| {model} | {m} | {a['floor_us']:.1f} | {a['us']:.1f} | {b['us']:.1f} | {b['us'] / a['us']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    return layer_benchmark_main(argv, doc=__doc__, name="modelopt", models=MODELS, run=run, table=table,
                                defaults=dict(bundle=str(REPO / "generated" / "bench-modelopt"),
                                              m="1,8,64,256,1024,4096", check_m=64, rounds=5))


if __name__ == "__main__":
    raise SystemExit(main())
