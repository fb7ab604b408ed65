"""gpt-oss in its checkpoint format (MXFP4 + expert biases) against the same layer in NVFP4, on the H200.

    python -m benchmarks.mxfp4 --bundle generated/moe-models [--models gpt-oss-120b,gpt-oss-20b]
                               [--m 1,8,64,256,1024,4096] [--json docs/results/mxfp4-<date>.json]

Per model and M, in one process on one routing (uniform top-k):

* `nvfp4`       MoeLayer on random ModelOpt NVFP4 weights, no biases (what the peer benchmark runs);
* `nvfp4+bias`  the same weights with bf16 biases (the bias epilogue's cost);
* `mxfp4+bias`  MoeLayer on random MXFP4 blocks/scales with gpt-oss's interleaved gate/up rows and
                bf16 biases, packed by prepare_w13_mxfp4 / prepare_w2_mxfp4 (the checkpoint's format).

Timing as in benchmarks/peers.py (benchmarks/common.FlushedTimer): each call replayed from a one-call
CUDA graph between two events after an untimed L2 flush, nothing subtracted, the three layers
interleaved sample by sample (`--rounds` x 10 samples, so clock drift hits all alike); medians.  At one
M (--check-m) the outputs are compared with the float32 reference (tests/reference/moe.py) after
poisoning.  Issue 15's target: MXFP4 within 5 % of NVFP4 at every M (the packed bytes per weight
are the same, 4.5 bits; the biases add one 16-byte load per stored output chunk).
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import compare_formats, layer_benchmark_main
from tests.reference.moe import moe_reference
from tests.reference.mxfp4 import dequantize_mxfp4, random_mxfp4
from tests.reference.nvfp4 import dequantize_modelopt, random_nvfp4

REPO = Path(__file__).resolve().parents[1]
MODELS = {"gpt-oss-120b": (2880, 2880, 128, 4), "gpt-oss-20b": (2880, 2880, 32, 4)}  # H, I, E, top_k
OAI = dict(alpha=1.702, beta=1.0, limit=7.0)


def _build(bundle, name, g):
    """The three layers of one model (NVFP4, NVFP4 + biases, MXFP4 + biases), with their references."""
    from cuteaot.runtime import MoeLayer, prepare_w2, prepare_w2_mxfp4, prepare_w13, prepare_w13_mxfp4

    h, i, e, top_k = MODELS[name]
    q13, q2 = random_nvfp4(e, 2 * i, h, g), random_nvfp4(e, h, i, g)
    bias13 = (torch.randn(e, 2 * i, generator=g, device="cuda") * 0.5).to(torch.bfloat16)  # [gate | up]
    bias2 = (torch.randn(e, h, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    nvfp4 = MoeLayer(bundle, prepare_w13(*q13, "bf16"), prepare_w2(*q2, "bf16"), top_k=top_k, activation="swigluoai")
    nv_bias = MoeLayer(bundle, prepare_w13(*q13, "bf16", bias=bias13), prepare_w2(*q2, "bf16", bias=bias2),
                       top_k=top_k, activation="swigluoai")
    ref_nv = (dequantize_modelopt(*q13), dequantize_modelopt(*q2), None, None)
    ref_nv_bias = (*ref_nv[:2], bias13, bias2)
    del q13, q2
    b13, s13 = random_mxfp4(e, 2 * i, h, g, spread=5, center=120)
    b2, s2 = random_mxfp4(e, h, i, g, spread=5, center=120)
    bias13 = (torch.randn(e, 2 * i, generator=g, device="cuda") * 0.5).to(torch.bfloat16)  # interleaved, as stored
    mx = MoeLayer(bundle, prepare_w13_mxfp4(b13, s13, "bf16", bias=bias13),
                  prepare_w2_mxfp4(b2, s2, "bf16", bias=bias2), top_k=top_k, activation="swigluoai")
    w13 = dequantize_mxfp4(b13, s13)
    ref_mx = (torch.cat((w13[:, 0::2], w13[:, 1::2]), dim=1), dequantize_mxfp4(b2, s2),
              torch.cat((bias13[:, 0::2], bias13[:, 1::2]), dim=1), bias2)
    layers = {"nvfp4": (nvfp4, ref_nv), "nvfp4+bias": (nv_bias, ref_nv_bias), "mxfp4+bias": (mx, ref_mx)}

    def reference(r):
        return lambda x, w, ids: moe_reference(x, r[0], r[1], w, ids, "swigluoai", b13=r[2], b2=r[3], **OAI)[0]

    return (h, e, top_k), {impl: (layer, reference(r), None) for impl, (layer, r) in layers.items()}


def run(bundle, models, ms, check_m, rounds) -> list[dict]:
    return compare_formats(bundle, models, ms, check_m, rounds, _build, floors=False)


def table(rows: list[dict]) -> str:
    by = {(r["model"], r["M"], r["impl"]): r for r in rows}
    lines = ["| model | M | NVFP4 µs | NVFP4 + bias µs | MXFP4 + bias µs | MXFP4+bias / NVFP4 | MXFP4+bias / NVFP4+bias |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model, m in dict.fromkeys((r["model"], r["M"]) for r in rows if "us" in r):
        a, b, c = (by[(model, m, impl)]["us"] for impl in ("nvfp4", "nvfp4+bias", "mxfp4+bias"))
        lines.append(f"| {model} | {m} | {a:.1f} | {b:.1f} | {c:.1f} | {c / a:.3f} | {c / b:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    return layer_benchmark_main(argv, doc=__doc__, name="mxfp4", models=MODELS, run=run, table=table,
                                defaults=dict(bundle=str(REPO / "generated" / "moe-models"),
                                              m="1,8,64,256,1024,4096", check_m=64, rounds=3))


if __name__ == "__main__":
    raise SystemExit(main())
