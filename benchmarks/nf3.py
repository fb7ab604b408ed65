"""NF3 against NVFP4 on the same models, on the H200 (issue 15: NF3 moves 3/4 of NVFP4's code bytes).

    python -m benchmarks.nf3 --bundle generated/bench-nf3 [--models qwen3-30b-a3b,gpt-oss-120b]
                             [--m 1,8,64,256] [--json docs/results/nf3-<date>.json]

Per model and M, in one process, on one routing (uniform top-k) and one input:

* `nvfp4`  MoeLayer on random ModelOpt NVFP4 weights (prepare_w13 / prepare_w2);
* `nf3`    MoeLayer on random NF3 tensors of the same shapes (prepare_w13_nf3 / prepare_w2_nf3).

gpt-oss layers carry bf16 expert biases in both. Timing: benchmarks/common.FlushedTimer (each call replayed
from a one-call CUDA graph between two events after an untimed L2 flush, nothing subtracted, the formats
interleaved sample by sample; medians). Beside each time: the weight bytes the routing touches (the distinct
routed experts' packed codes and scales of W13 and W2, from the packed tensors themselves) and that many
bytes at the measured copy bandwidth (`floor`). At --check-m both outputs are compared with the float32
reference after poisoning. Target: NF3 >= 1.2x faster than NVFP4 at M <= 8.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import compare_formats, layer_benchmark_main
from tests.reference.moe import moe_reference
from tests.reference.nf3 import dequantize_nf3, random_nf3
from tests.reference.nvfp4 import dequantize_modelopt, random_nvfp4

REPO = Path(__file__).resolve().parents[1]
# H, I, E, top_k, activation, biases
MODELS = {"qwen3-30b-a3b": (2048, 768, 128, 8, "silu", False), "gpt-oss-120b": (2880, 2880, 128, 4, "swigluoai", True)}
OAI = dict(alpha=1.702, beta=1.0, limit=7.0)


def _expert_bytes(w) -> int:
    return (w.qweight.numel() * 4 + w.scales.numel()) // w.num_experts


def _build(bundle, name, g):
    """The NVFP4 and the NF3 layer of one model (random weights of the same shapes), with their references."""
    from cuteaot.runtime import MoeLayer, prepare_w2, prepare_w2_nf3, prepare_w13, prepare_w13_nf3

    h, i, e, top_k, activation, biases = MODELS[name]
    b13 = (torch.randn(e, 2 * i, generator=g, device="cuda") * 0.5).to(torch.bfloat16) if biases else None
    b2 = (torch.randn(e, h, generator=g, device="cuda") * 0.5).to(torch.bfloat16) if biases else None
    kw = dict(b13=b13, b2=b2, **(OAI if activation == "swigluoai" else {}))

    def reference(ref_w):
        return lambda x, w, ids: moe_reference(x, *ref_w, w, ids, activation, **kw)[0]

    layers = {}
    q13, q2 = random_nvfp4(e, 2 * i, h, g), random_nvfp4(e, h, i, g)
    w13, w2 = prepare_w13(*q13, "bf16", bias=b13), prepare_w2(*q2, "bf16", bias=b2)
    layers["nvfp4"] = (MoeLayer(bundle, w13, w2, top_k=top_k, activation=activation),
                       reference((dequantize_modelopt(*q13), dequantize_modelopt(*q2))),
                       _expert_bytes(w13) + _expert_bytes(w2))
    del q13, q2
    q13, q2 = random_nf3(e, 2 * i, h, g, scale_2=2e-4), random_nf3(e, h, i, g, scale_2=2e-4)
    w13, w2 = prepare_w13_nf3(*q13, bias=b13), prepare_w2_nf3(*q2, bias=b2)
    layers["nf3"] = (MoeLayer(bundle, w13, w2, top_k=top_k, activation=activation),
                     reference((dequantize_nf3(*q13), dequantize_nf3(*q2))), _expert_bytes(w13) + _expert_bytes(w2))
    return (h, e, top_k), layers


def run(bundle, models, ms, check_m, rounds) -> list[dict]:
    return compare_formats(bundle, models, ms, check_m, rounds, _build, floors=True)


def table(rows: list[dict]) -> str:
    by = {(r["model"], r["M"], r["impl"]): r for r in rows}
    lines = ["| model | M | NVFP4 µs | NVFP4 floor µs | NF3 µs | NF3 floor µs | NVFP4 / NF3 time |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model, m in dict.fromkeys((r["model"], r["M"]) for r in rows if "us" in r):
        a, b = by[(model, m, "nvfp4")], by[(model, m, "nf3")]
        lines.append(f"| {model} | {m} | {a['us']:.1f} | {a['floor_us']:.1f} | {b['us']:.1f} | {b['floor_us']:.1f} "
                     f"| {a['us'] / b['us']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    return layer_benchmark_main(argv, doc=__doc__, name="nf3", models=MODELS, run=run, table=table,
                                defaults=dict(bundle=str(REPO / "generated" / "bench-nf3"), m="1,8,64,256",
                                              check_m=8, rounds=5))


if __name__ == "__main__":
    raise SystemExit(main())
