"""A/B-test builds of the fused MoE layer on identical operands, in one process.

    python -m benchmarks.compare_layer --base generated/pf-off/bench-decode --new generated/pf-24m/bench-decode
                                       [--new LABEL=PATH ...] [--models qwen3-30b-a3b,...] [--m 1,2] [--rounds 5]
                                       [--weights nvfp4 | modelopt | nf3]

The layer-level twin of benchmarks/compare_gemm.py: every MoE layer problem the two bundles share
(plain variant: no expert map, no calibration, no bias, not deterministic, layers of `--weights`)
gets random NVFP4 weights (repacked for nvfp4 layers, read as stored for modelopt ones; random NF3 tensors
for nf3 layers) and, per M, one routing (uniform top-k) and one input; a MoeLayer of each bundle runs them.  Their
outputs are compared (‖new−base‖/‖base‖), then timed with benchmarks/common.FlushedTimer (each call
replayed from a one-call CUDA graph after an untimed L2 flush, nothing subtracted; base and every new
interleaved sample by sample, `--rounds` x 10 samples), and the medians are reported with new / base.
Interleaving makes clock and thermal drift hit all alike; judge a change by new / base within one call.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from benchmarks.common import FlushedTimer, comma_list, routing_generator, run_layers, uniform_routing
from cuteaot.runtime.types import SWIGLUOAI_DEFAULT_ALPHA, SWIGLUOAI_DEFAULT_BETA, SWIGLUOAI_DEFAULT_LIMIT, DType
from tests.reference.moe import moe_reference
from tests.reference.moe_elementwise import relative_error
from tests.reference.nf3 import dequantize_nf3, random_nf3
from tests.reference.nvfp4 import dequantize_modelopt, random_nvfp4



def _problems(bundle, weights: str = "nvfp4") -> dict[str, dict]:
    out = {}
    for row in bundle.manifest["resolution"]:
        f = row["facts"]
        if row["op"] != "moe_layer" or f.get("expert_map") or f.get("calibration") or f.get("bias") \
                or f.get("deterministic") or row["profile"] != bundle.profile.name \
                or f.get("weights", "nvfp4") != weights:
            continue
        out[row["problem"]] = f
    return out


def _layer(bundle, facts, w13, w2):
    from cuteaot.runtime import MoeLayer

    return MoeLayer(bundle, w13, w2, top_k=facts["top_k"], activation=facts["activation"],
                    swiglu_alpha=facts.get("swiglu_alpha"), swiglu_beta=facts.get("swiglu_beta"),
                    swiglu_limit=facts.get("swiglu_limit"), fast_math=facts.get("fast_math", True))


def random_layers(bundle, models=None):
    """(name, facts, layer, generator) for each packed-NVFP4 layer of the bundle's table (those named in `models`
    when given), on random weights from the generator seeded by the name; the layer is freed after its turn."""
    for name, facts in sorted(_problems(bundle).items()):
        if models and name not in models:
            continue
        g = torch.Generator(device="cuda").manual_seed(len(name))
        q13, q2 = random_layer_weights(facts, g)
        layer = _layer(bundle, facts, *_prepared(facts, q13, q2, "nvfp4"))
        yield name, facts, layer, g
        del layer
        torch.cuda.empty_cache()


def reference_params(facts: dict) -> dict:
    """moe_reference's swiglu alpha / beta / limit for a layer's facts: swigluoai's defaults where the facts
    leave them unset, as the layer does."""
    params = {key: facts.get(f"swiglu_{key}") for key in ("alpha", "beta", "limit")}
    if facts["activation"] == "swigluoai":
        defaults = (SWIGLUOAI_DEFAULT_ALPHA, SWIGLUOAI_DEFAULT_BETA, SWIGLUOAI_DEFAULT_LIMIT)
        params = {key: d if params[key] is None else params[key] for key, d in zip(params, defaults)}
    return params


def random_layer_weights(facts: dict, g: torch.Generator, weights: str = "nvfp4"):
    """Random ModelOpt NVFP4 (w13, w2) tensors for a layer problem's facts (`random_nvfp4`'s tuples), or
    NF3 ones (`random_nf3`'s) for nf3 layers."""
    h, i, e = facts["hidden_size"], facts["intermediate_size"], facts["num_experts"]
    n1 = 2 * i if facts["activation"] != "relu2" else i
    make = random_nf3 if weights == "nf3" else random_nvfp4
    return make(e, n1, h, g), make(e, h, i, g)


def layer_dtype(facts: dict) -> torch.dtype:
    """The activations' torch dtype of a layer problem (bf16 or fp16)."""
    return DType(facts.get("dtype", "bf16")).torch


def _prepared(facts: dict, q13, q2, weights: str):
    from cuteaot.runtime import (prepare_w2, prepare_w2_modelopt, prepare_w2_nf3, prepare_w13, prepare_w13_modelopt,
                                 prepare_w13_nf3)

    if weights == "nf3":
        return prepare_w13_nf3(*q13), prepare_w2_nf3(*q2)
    dtype = facts.get("dtype", "bf16")
    if weights == "modelopt":
        return (prepare_w13_modelopt(*q13, dtype, gated=facts["activation"] != "relu2"),
                prepare_w2_modelopt(*q2, dtype))
    return prepare_w13(*q13, dtype), prepare_w2(*q2, dtype)


def compare(base, news: dict, models, ms, rounds, check: bool = False, weights: str = "nvfp4") -> list[dict]:
    """Time `base` and every bundle of `news` (label -> bundle) on the same operands; with `check`,
    also each output's ‖out−ref‖/‖ref‖ against the float32 reference (tests/reference/moe.py)."""
    shared = set(_problems(base, weights))
    for bundle in news.values():
        shared &= set(_problems(bundle, weights))
    names = [m for m in (models or sorted(shared)) if m in shared]
    missing = sorted(set(models or []) - shared)
    if missing:
        raise SystemExit(f"not in every bundle: {missing}; shared: {sorted(shared)}")
    timer = FlushedTimer()
    rows = []
    for name in names:
        f = _problems(base, weights)[name]
        h, e, k = f["hidden_size"], f["num_experts"], f["top_k"]
        g = torch.Generator(device="cuda").manual_seed(len(name))
        q13, q2 = random_layer_weights(f, g, weights)
        w13, w2 = _prepared(f, q13, q2, weights)
        dequantize = dequantize_nf3 if weights == "nf3" else dequantize_modelopt
        w_ref = (dequantize(*q13), dequantize(*q2)) if check else None
        if weights != "modelopt":  # (read as stored: the layers hold the checkpoint tensors themselves)
            del q13, q2
        layers = {"base": _layer(base, f, w13, w2)}
        layers.update({label: _layer(bundle, f, w13, w2) for label, bundle in news.items()})
        for m in ms:
            x, w, ids = uniform_routing(m, h, e, k, routing_generator(name, m))  # whatever --m lists
            x = x.to(layer_dtype(f))
            references = None
            if check:
                params = reference_params(f)
                reference = functools.cache(
                    lambda w_ref=w_ref: moe_reference(x, *w_ref, w, ids, f["activation"], **params)[0])
                references = {n: reference for n in layers}
            checked, outs = run_layers(layers, x, w, ids, references=references, eager=True)
            timed, _ = run_layers(layers, x, w, ids, timer=timer, rounds=rounds)
            us = {n: timed[n]["us"] for n in layers}
            base_out = outs["base"]
            row = {"model": name, "M": m, "base_us": us["base"], "base_plan": layers["base"].resolve(m).describe(),
                   "new": {label: {"us": us[label], "ratio": us[label] / us["base"],
                                   "rel_diff": relative_error(outs[label], base_out),
                                   "plan": layers[label].resolve(m).describe()} for label in news}}
            if check:
                row["base_ref_err"] = checked["base"]["rel_err"]
                for label in news:
                    row["new"][label]["ref_err"] = checked[label]["rel_err"]
            rows.append(row)
            cells = "  ".join(f"{label} {v['us']:8.1f} us ({v['ratio']:.3f}, diff {v['rel_diff']:.1e})"
                              for label, v in row["new"].items())
            errs = "  ref err " + " ".join(f"{n} {v['rel_err']:.1e}" for n, v in checked.items()) if check else ""
            print(f"{name:22s} M={m:5d} base {row['base_us']:8.1f} us  {cells}{errs}", flush=True)
        del layers, w13, w2
        w_ref = None
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True)
    p.add_argument("--new", required=True, action="append",
                   help="a bundle to compare with the base; repeat for several (labelled by LABEL=PATH or the path)")
    p.add_argument("--models", default="", type=comma_list())
    p.add_argument("--m", default="1,2", type=comma_list(int))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--check", action="store_true", help="also each output's error against the float32 reference")
    p.add_argument("--weights", default="nvfp4", choices=("nvfp4", "modelopt", "nf3"),
                   help="the layers compared: packed NVFP4 ones, ones that read the weights as stored, or NF3 ones")
    args = p.parse_args(argv)
    from cuteaot.runtime import load_bundle

    paths = dict(item.split("=", 1) if "=" in item else (item, item) for item in args.new)
    news = {label: load_bundle(path) for label, path in paths.items()}
    rows = compare(load_bundle(args.base), news, args.models, args.m, args.rounds, args.check, args.weights)
    labels = list(news)
    print("\n| model | M | base µs | " + " | ".join(f"{x} µs | {x} / base" for x in labels) + " | max ‖new−base‖/‖base‖ |")
    print("| --- | ---: | ---: | " + " | ".join("---: | ---:" for _ in labels) + " | ---: |")
    for r in rows:
        cells = " | ".join(f"{r['new'][x]['us']:.1f} | {r['new'][x]['ratio']:.3f}" for x in labels)
        diff = max(v["rel_diff"] for v in r["new"].values())
        print(f"| {r['model']} | {r['M']} | {r['base_us']:.1f} | {cells} | {diff:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"base": args.base, "new": paths, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
