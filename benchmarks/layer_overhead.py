"""Host cost of one MoE layer call (issue 14): eager `MoeLayer.__call__`, a bound call
(`MoeLayer.bind`), and the same kernel launches issued bare with cuda-python.

The bare reference is exactly the launches the layer issues (recorded by `bind`), each with its
pre-packed `void**` through the driver call the runtime uses for it: `cuLaunchKernelEx` with a prebuilt
programmatic-launch configuration for kernels that wait for their predecessors (PDL on), else
`cuLaunchKernel`: what any caller has to pay.  Host time per call,
median of interleaved rounds (benchmarks/common.host_us_per_call); small M, where the GPU keeps
up and the host is the bottleneck.

    python -m benchmarks.layer_overhead [--bundle generated/moe-models] [--json out.json] [--steps]

--steps also times the parts of an eager M = 1 call on their own (the argument checks, the stream
lookup, the resolution, the launch sequence, the prepared launch alone): where the host time goes.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from cuda.bindings import driver

from benchmarks.common import host_us_per_call
from benchmarks.gemm import random_packed
from cuteaot.runtime import load_bundle
from cuteaot.runtime.bundle import _launch_config, launch_mode
from cuteaot.runtime.moe import MoeLayer

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B


def qwen3_layer(bundle_path: str) -> MoeLayer:
    """A Qwen3-30B-A3B layer of the bundle on random packed weights; pins this process to one core (less
    migration noise in host timings)."""
    layer = MoeLayer(load_bundle(bundle_path), random_packed(EXPERTS, 2 * INTER, HIDDEN),
                     random_packed(EXPERTS, HIDDEN, INTER), top_k=TOP_K)
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    return layer


def bound_call(layer: MoeLayer, m: int):
    """((x, router weights, ids, out) of an m-token call on the GPU, the layer's bound call on them)."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, HIDDEN, generator=g).to(torch.bfloat16).cuda()
    ids = torch.rand(m, EXPERTS, generator=g).topk(TOP_K, dim=1).indices.to(torch.int32).cuda()
    w = torch.softmax(torch.randn(m, TOP_K, generator=g), 1).cuda()
    out = torch.empty(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
    return (x, w, ids, out), layer.bind(x, w, ids, out)


def recorded_launch(r, stream: int) -> tuple:
    """(function, grid, block, smem, `void**` address, launch configuration or None) of a bound call's recorded
    launch `r`: what the driver call the runtime uses for it takes (`cuLaunchKernelEx` with the attributes the
    runtime launches the kernel with, where it has any; else `cuLaunchKernel`)."""
    config = None
    mode = launch_mode(r.kernel)
    if mode:
        config = _launch_config(r.kernel, bool(mode & 1), bool(mode & 2))
        config.gridDimX, config.hStream = r.grid_x, stream
    return r.kernel.function, r.grid_x, r.kernel.block, r.kernel.smem, r.buffer.address, config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="generated/moe-models")
    ap.add_argument("--json")
    ap.add_argument("--steps", action="store_true", help="also time the parts of an eager M = 1 call")
    args = ap.parse_args()
    layer = qwen3_layer(args.bundle)
    rows = []
    for m in (1, 8, 64):
        (x, w, ids, out), bound = bound_call(layer, m)
        stream = bound.stream
        recorded = [recorded_launch(r, stream) for r in bound.launches]

        def bare():
            for fn, grid, (bx, by, bz), smem, address, config in recorded:
                if config is not None:
                    driver.cuLaunchKernelEx(config, fn, address, 0)
                else:
                    driver.cuLaunchKernel(fn, grid, 1, 1, bx, by, bz, smem, stream, address, 0)

        host = host_us_per_call({
            "eager MoeLayer.__call__": lambda: layer(x, w, ids, out=out),
            "bound call (MoeLayer.bind)": bound,
            "bare launches, the same driver calls": bare,
        }, calls=1000, reps=11)
        base = host["bare launches, the same driver calls"]
        row = {"M": m, "launches": len(recorded), **host,
               "eager_vs_bare": host["eager MoeLayer.__call__"] / base,
               "bound_vs_bare": host["bound call (MoeLayer.bind)"] / base}
        rows.append(row)
        print(f"M={m:3d} {len(recorded)} launches | eager {host['eager MoeLayer.__call__']:6.2f} us "
              f"({row['eager_vs_bare']:.2f}x) | bound {host['bound call (MoeLayer.bind)']:6.2f} us "
              f"({row['bound_vs_bare']:.2f}x) | bare {base:6.2f} us", flush=True)
    steps = _steps(layer) if args.steps else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, "steps_m1": steps}, f, indent=1)


def _steps(layer: MoeLayer) -> dict:
    """Host µs of each part of an eager M = 1 call, timed alone (private methods: a diagnostic)."""
    from cuteaot.runtime.bundle import current_stream_handle

    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    ids = torch.arange(TOP_K, dtype=torch.int32, device="cuda").view(1, TOP_K)
    w = torch.full((1, TOP_K), 1.0 / TOP_K, device="cuda")
    out = torch.empty(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    stream = current_stream_handle(layer.device_index)
    ws = layer.workspace(stream)
    r = layer.resolve(1)
    prepared = layer._prepared_fused(r.kernels["fused"], ws)
    values = (x.data_ptr(), out.data_ptr(), ids.data_ptr(), ids.data_ptr(), ids.data_ptr(), w.data_ptr(),
              ws.c_tmp_address, 0, 1)
    host = host_us_per_call({
        "eager call": lambda: layer(x, w, ids, out=out),
        "torch.compiler.is_compiling": torch.compiler.is_compiling,
        "_check (4 tensors)": lambda: layer._check(x, w, ids, out, None, None),
        "current_stream_handle": lambda: current_stream_handle(layer.device_index),
        "resolve": lambda: layer.resolve(1),
        "_launch (the launch sequence)": lambda: layer._launch(1, x, w, ids, out, None, None, ws, stream),
        "prepared launch alone": lambda: prepared.launch(r.launch.grid_x, stream, *values),
    }, calls=1000, reps=7)
    for name, us in host.items():
        print(f"  {name:32s} {us:6.2f} us", flush=True)
    return host


if __name__ == "__main__":
    main()
