"""A bundle's MoE layers against the float32 reference at given token counts, uniform and skewed routing
(most routes on five experts, the rest spread thin), the output poisoned with NaN first.  Prints the plan,
‖out−ref‖/‖ref‖ and whether every output is finite; runs under compute-sanitizer as it is:

    python -m benchmarks.check_layer generated/moe-models qwen3-30b-a3b,qwen3-235b-a22b-tp2 2560,3584
    compute-sanitizer --tool memcheck --report-api-errors no python -m benchmarks.check_layer <bundle> <problem> 3072
"""
from __future__ import annotations

import sys

import torch

from benchmarks.compare_layer import _layer, _prepared, _problems, random_layer_weights
from cuteaot.runtime import load_bundle
from cuteaot.runtime.types import SWIGLUOAI_DEFAULT_ALPHA, SWIGLUOAI_DEFAULT_BETA, SWIGLUOAI_DEFAULT_LIMIT
from tests.reference.moe import moe_reference
from tests.reference.moe_elementwise import relative_error
from tests.reference.nvfp4 import dequantize_modelopt


def check(bundle_path: str, problems: list[str], ms: list[int]) -> None:
    bundle = load_bundle(bundle_path)
    for name in problems:
        f = _problems(bundle, "nvfp4")[name]
        h, e, k = f["hidden_size"], f["num_experts"], f["top_k"]
        g = torch.Generator(device="cuda").manual_seed(7)
        q13, q2 = random_layer_weights(f, g)
        w13, w2 = _prepared(f, q13, q2, "nvfp4")
        w_ref = (dequantize_modelopt(*q13), dequantize_modelopt(*q2))
        layer = _layer(bundle, f, w13, w2)
        params = {key: f.get(f"swiglu_{key}") for key in ("alpha", "beta", "limit")}
        if f["activation"] == "swigluoai":  # the layer's defaults where the facts leave them unset
            defaults = (SWIGLUOAI_DEFAULT_ALPHA, SWIGLUOAI_DEFAULT_BETA, SWIGLUOAI_DEFAULT_LIMIT)
            params = {key: d if params[key] is None else params[key] for key, d in zip(params, defaults)}
        for m in ms:
            for skewed in (False, True):
                cg = torch.Generator().manual_seed(m)
                if skewed:
                    probs = torch.tensor([0.6, 0.3] + [0.1 / 3] * 3 + [0.0] * (e - 5))
                    logits = torch.log(probs + 1e-12) + 0.01 * torch.rand(m, e, generator=cg)
                else:
                    logits = torch.rand(m, e, generator=cg)
                ids = logits.topk(k, dim=1).indices.to(torch.int32).cuda()
                w = torch.rand(m, k, generator=cg)
                w = (w / w.sum(1, keepdim=True)).cuda()
                x = (torch.randn(m, h, generator=cg) * 0.5).to(torch.bfloat16).cuda()
                out = torch.full((m, h), float("nan"), dtype=torch.bfloat16, device="cuda")
                layer(x, w, ids, out=out)
                ref = moe_reference(x, *w_ref, w, ids, f["activation"], **params)[0]
                err = relative_error(out, ref)
                print(f"{name} M={m} {'skewed' if skewed else 'uniform'} plan: {layer.resolve(m).describe()} "
                      f"rel err {err:.3e} finite {bool(torch.isfinite(out).all())}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: python -m benchmarks.check_layer BUNDLE PROBLEM[,PROBLEM...] M[,M...]")
    check(sys.argv[1], sys.argv[2].split(","), [int(v) for v in sys.argv[3].split(",")])
