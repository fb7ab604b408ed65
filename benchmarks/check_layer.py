"""A bundle's MoE layers against the float32 reference at given token counts, uniform and skewed routing
(benchmarks.common), the output poisoned with NaN first.  Prints the plan, ‖out−ref‖/‖ref‖ and whether every
output is finite; runs under compute-sanitizer as it is:

    python -m benchmarks.check_layer generated/moe-models qwen3-30b-a3b,qwen3-235b-a22b-tp2 2560,3584
    compute-sanitizer --tool memcheck --report-api-errors no python -m benchmarks.check_layer <bundle> <problem> 3072
"""
from __future__ import annotations

import sys

import torch

from benchmarks.common import skewed_routing, uniform_routing
from benchmarks.compare_layer import _layer, _prepared, _problems, layer_dtype, random_layer_weights, reference_params
from cuteaot.runtime import load_bundle
from tests.reference.moe import moe_reference
from tests.reference.moe_elementwise import relative_error
from tests.reference.nvfp4 import dequantize_modelopt


def check(bundle_path: str, problems: list[str], ms: list[int]) -> None:
    bundle = load_bundle(bundle_path)
    for name in problems:
        f = _problems(bundle, "nvfp4")[name]
        g = torch.Generator(device="cuda").manual_seed(7)
        q13, q2 = random_layer_weights(f, g)
        w_ref = (dequantize_modelopt(*q13), dequantize_modelopt(*q2))
        layer = _layer(bundle, f, *_prepared(f, q13, q2, "nvfp4"))
        for m in ms:
            for routing in (uniform_routing, skewed_routing):
                x, w, ids = routing(m, f["hidden_size"], f["num_experts"], f["top_k"], g)
                x = x.to(layer_dtype(f))
                out = torch.full_like(x, float("nan"))
                layer(x, w, ids, out=out)
                ref = moe_reference(x, *w_ref, w, ids, f["activation"], **reference_params(f))[0]
                plan = layer.resolve(min(m, layer.max_tokens)).describe()  # larger calls run in chunks
                if m > layer.max_tokens:
                    plan = f"chunks of {layer.max_tokens}: {plan}"
                print(f"{name} M={m} {routing.__name__} plan: {plan} "
                      f"rel err {relative_error(out, ref):.3e} finite {bool(torch.isfinite(out).all())}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: python -m benchmarks.check_layer BUNDLE PROBLEM[,PROBLEM...] M[,M...]")
    check(sys.argv[1], sys.argv[2].split(","), [int(v) for v in sys.argv[3].split(",")])
