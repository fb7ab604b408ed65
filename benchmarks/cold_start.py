"""Cold start: seconds from process start to ready-to-serve, beside the build's compile seconds.

A fresh Python process (timed from before it is spawned) imports the runtime, loads the
bundle (manifest, sha256 of every cubin, cuLibraryLoadData), builds one MoeLayer per problem
of the bundle (zero weights of the right shapes: reading a checkpoint is not ours to time),
resolves every token bucket (occupancy checks included) and runs one M = 1 call per layer.
The build-side figure is the sum of CuTeDSL compile seconds the manifest records for the
same kernels (what a serving process would pay per start if it compiled them JIT).

    python -m benchmarks.cold_start --bundle generated/moe-models [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
t = {"spawned": time.time()}
import torch
from cuteaot.runtime import load_bundle
from cuteaot.runtime.moe import MoeLayer
from cuteaot.runtime.types import DType
from cuteaot.runtime.weights import PackedNvfp4, stored_dims
torch.cuda.init(); torch.empty(1, device="cuda")
t["imported"] = time.time()
bundle = load_bundle(sys.argv[1])
t["loaded"] = time.time()
SHAPES = json.loads(sys.argv[2])

def zeros(e, n, k):
    ns, ks = stored_dims(n, k)
    return PackedNvfp4(torch.zeros(e, ks // 16, 2 * ns, dtype=torch.int32, device="cuda"),
                       torch.zeros(e, ks // 16, ns, dtype=torch.uint8, device="cuda"),
                       torch.ones(e, device="cuda"), e, n, k, DType.BF16)

layers = []
for name, (h, i, e, k, act, buckets) in SHAPES.items():
    n1 = 2 * i if act != "relu2" else i
    layer = MoeLayer(bundle, zeros(e, n1, h), zeros(e, h, i), top_k=k, activation=act, max_tokens=max(buckets))
    for m in buckets:
        layer.resolve(m)
    layers.append((layer, h, e, k))
t["resolved"] = time.time()
for layer, h, e, k in layers:
    x = torch.zeros(1, h, dtype=torch.bfloat16, device="cuda")
    layer(x, torch.full((1, k), 1.0 / k, device="cuda"), torch.arange(k, dtype=torch.int32, device="cuda")[None])
torch.cuda.synchronize()
t["served"] = time.time()
print(json.dumps(t))
"""


def problems(manifest: dict, profile: str) -> dict:
    """name -> (H, I, E, top_k, activation, token buckets) from the fused kernels the rows name."""
    by_digest = {k["key"]: k for k in manifest["kernels"]}
    out = {}
    for row in manifest["resolution"]:
        if row["profile"] != profile or "fused" not in row["kernels"]:
            continue
        f = by_digest[row["kernels"]["fused"]]["facts"]
        entry = out.setdefault(row["problem"], [f["hidden_size"], f["intermediate_size"], None, f["top_k"],
                                                f["activation"], []])
        entry[5].append(row["tokens"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="generated/moe-models")
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--experts", default="{}", help='JSON {problem: experts} (default 128, gpt-oss-20b 32, mixtral 8)')
    ap.add_argument("--json")
    args = ap.parse_args()
    manifest = json.load(open(f"{args.bundle}/manifest.json"))
    shapes = problems(manifest, args.profile)
    experts = {"gpt-oss-20b": 32, "mixtral-8x7b": 8, **json.loads(args.experts)}
    for name, entry in shapes.items():
        entry[2] = experts.get(name, 128)
    arch = next(t["arch"] for t in manifest["targets"] if t["name"] == args.profile)
    compile_s = sum(k["compile_seconds"] for k in manifest["kernels"] if k["arch"] == arch)
    kernels = sum(1 for k in manifest["kernels"] if k["arch"] == arch)
    runs = []
    for _ in range(3):
        start = time.time()
        done = subprocess.run([sys.executable, "-c", CHILD, args.bundle, json.dumps(shapes)], check=True,
                              capture_output=True, text=True)
        t = json.loads(done.stdout.strip().splitlines()[-1])
        runs.append({k: v - start for k, v in t.items()})
    best = min(runs, key=lambda r: r["served"])
    print(f"{args.bundle}: {kernels} kernels for {arch}, {len(shapes)} problems")
    print("process start -> " + ", ".join(f"{k} {v:.2f} s" for k, v in best.items()) + " (best of 3)")
    print(f"CuTeDSL compile time of the same kernels on the build machine: {compile_s:.1f} s (serial sum)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "kernels": kernels, "arch": arch, "compile_seconds": compile_s,
                       "problems": shapes}, f, indent=1)


if __name__ == "__main__":
    main()
