"""NF3 against NVFP4 on the same models, on the H200 (issue 15: NF3 moves 3/4 of NVFP4's code bytes).

    python -m benchmarks.nf3 --bundle generated/bench-nf3 [--models qwen3-30b-a3b,gpt-oss-120b]
                             [--m 1,8,64,256] [--json docs/results/nf3-<date>.json]

Per model and M, in one process, on one routing (uniform top-k) and one input:

* `nvfp4`  MoeLayer on random ModelOpt NVFP4 weights (prepare_w13 / prepare_w2);
* `nf3`    MoeLayer on random NF3 tensors of the same shapes (prepare_w13_nf3 / prepare_w2_nf3).

gpt-oss layers carry bf16 expert biases in both.  Timing: benchmarks/common.FlushedTimer (CUDA-graph replay
of (L2 flush, layer call), the flush's own time subtracted, medians over interleaved rounds).  Beside
each time: the weight bytes the routing touches (the distinct routed experts' packed codes and
scales of W13 and W2, from the packed tensors themselves) and that many bytes at the measured copy
bandwidth (`floor`).  At --check-m both outputs are compared with the float32 reference after
poisoning.  Target: NF3 >= 1.2x faster than NVFP4 at M <= 8.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.common import FlushedTimer, hbm_copy_bandwidth, layer_benchmark_main, run_layers, uniform_routing
from tests.reference.moe import moe_reference
from tests.reference.nf3 import dequantize_nf3, random_nf3
from tests.reference.nvfp4 import dequantize_modelopt, random_nvfp4

REPO = Path(__file__).resolve().parents[1]
# H, I, E, top_k, activation, biases
MODELS = {"qwen3-30b-a3b": (2048, 768, 128, 8, "silu", False), "gpt-oss-120b": (2880, 2880, 128, 4, "swigluoai", True)}
OAI = dict(alpha=1.702, beta=1.0, limit=7.0)


def _expert_bytes(w) -> int:
    return (w.qweight.numel() * 4 + w.scales.numel()) // w.num_experts


def _layers(bundle, h, i, e, top_k, activation, biases, g):
    from cuteaot.runtime import MoeLayer, prepare_w2, prepare_w2_nf3, prepare_w13, prepare_w13_nf3

    b13 = (torch.randn(e, 2 * i, generator=g, device="cuda") * 0.5).to(torch.bfloat16) if biases else None
    b2 = (torch.randn(e, h, generator=g, device="cuda") * 0.5).to(torch.bfloat16) if biases else None
    out = {}
    q13, q2 = random_nvfp4(e, 2 * i, h, g), random_nvfp4(e, h, i, g)
    w13, w2 = prepare_w13(*q13, "bf16", bias=b13), prepare_w2(*q2, "bf16", bias=b2)
    out["nvfp4"] = (MoeLayer(bundle, w13, w2, top_k=top_k, activation=activation),
                    (dequantize_modelopt(*q13), dequantize_modelopt(*q2)), _expert_bytes(w13) + _expert_bytes(w2))
    del q13, q2
    q13, q2 = random_nf3(e, 2 * i, h, g, scale_2=2e-4), random_nf3(e, h, i, g, scale_2=2e-4)
    w13, w2 = prepare_w13_nf3(*q13, bias=b13), prepare_w2_nf3(*q2, bias=b2)
    out["nf3"] = (MoeLayer(bundle, w13, w2, top_k=top_k, activation=activation),
                  (dequantize_nf3(*q13), dequantize_nf3(*q2)), _expert_bytes(w13) + _expert_bytes(w2))
    return out, (b13, b2)


def run(bundle, models, ms, check_m, rounds) -> list[dict]:
    timer = FlushedTimer()
    bandwidth = hbm_copy_bandwidth()
    rows = []
    for name in models:
        h, i, e, top_k, activation, biases = MODELS[name]
        g = torch.Generator(device="cuda").manual_seed(len(name))
        layers, (b13, b2) = _layers(bundle, h, i, e, top_k, activation, biases, g)
        kw = dict(b13=b13, b2=b2, **(OAI if activation == "swigluoai" else {}))
        for m in sorted(set(ms) | {check_m}):
            x, w, ids = uniform_routing(m, h, e, top_k, g)
            experts = int(ids.unique().numel())
            references = None
            if m == check_m:
                references = {impl: (lambda ref_w=ref_w: moe_reference(x, *ref_w, w, ids, activation, **kw)[0])
                              for impl, (_, ref_w, _) in layers.items()}
            found, _ = run_layers({impl: layer for impl, (layer, _, _) in layers.items()}, x, w, ids,
                                  references=references, timer=timer if m in ms else None, rounds=rounds)
            for impl, (layer, _, per_expert) in layers.items():
                touched = experts * per_expert
                row = {"model": name, "M": m, "impl": impl, "plan": layer.resolve(m).describe(), "experts": experts,
                       "weight_bytes": touched, "floor_us": touched / bandwidth * 1e6, **found[impl]}
                rows.append(row)
                us = f"{row['us']:9.1f} us (floor {row['floor_us']:6.1f})" if "us" in row else " " * 26
                err = f" rel_err {row['rel_err']:.2e}" if row.get("rel_err") is not None else ""
                print(f"{name:14s} M={m:5d} {row['impl']:6s} {us}{err}  {row['plan']}", flush=True)
        del layers
        torch.cuda.empty_cache()
    return rows


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
