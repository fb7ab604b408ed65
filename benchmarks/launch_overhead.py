"""Host cost per launch through the runtime vs a bare cuda-python cuLaunchKernel of
the same cubin vs an equivalent torch op; plus device time of the activation and
top-k sum at serving sizes against the HBM roofline and torch.  Needs a GPU and
the bundle `generated/qwen3-30b-a3b` (`make kernels`).

    python benchmarks/launch_overhead.py [--bundle generated/qwen3-30b-a3b] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess

import torch
import torch.nn.functional as F
from cuda.bindings import driver

from benchmarks.common import device_us, hbm_copy_bandwidth, host_us_per_call
from cuteaot.runtime import load_bundle, moe_activation, moe_topk_sum
from cuteaot.runtime.bundle import _launch_config
from cuteaot.runtime.kernels import ActivationSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="generated/qwen3-30b-a3b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bundle = load_bundle(args.bundle)
    H, I, K = 2048, 768, 8
    dt = torch.bfloat16
    results: dict = {"gpu": torch.cuda.get_device_name(), "bundle": args.bundle}

    # ---- host cost per launch (1 token: the kernel is tiny, the host is the bottleneck)
    x = torch.randn(K, 2 * I, device="cuda", dtype=dt)
    out = torch.empty(K, I, device="cuda", dtype=dt)
    spec = ActivationSpec.create("silu", "bf16", I)
    kernel = bundle.kernel(spec.key())
    fn, block = kernel.function, kernel.block
    grid = ((K * I // 8 + block[0] - 1) // block[0], 1, 1)  # 8 elements per thread
    stream = torch.cuda.current_stream().cuda_stream
    slots = (ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int32())
    argv = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.pointer(s), ctypes.c_void_p) for s in slots])
    addr = ctypes.addressof(argv)

    def bare_prepacked():
        slots[0].value, slots[1].value, slots[2].value = x.data_ptr(), out.data_ptr(), K
        driver.cuLaunchKernel(fn, grid[0], 1, 1, *block, 0, stream, addr, 0)

    config = _launch_config(kernel, programmatic=True, cooperative=False)  # what the runtime launches a kernel that waits for its predecessors with
    config.gridDimX, config.hStream = grid[0], stream

    def bare_programmatic():
        slots[0].value, slots[1].value, slots[2].value = x.data_ptr(), out.data_ptr(), K
        driver.cuLaunchKernelEx(config, fn, addr, 0)

    def bare_tuple():
        driver.cuLaunchKernel(
            fn, grid[0], 1, 1, *block, 0, stream,
            ((x.data_ptr(), out.data_ptr(), K), (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)), 0,
        )

    def runtime_call():
        moe_activation(bundle, x, out)

    def torch_op():
        torch.mul(F.silu(x[:, :I]), x[:, I:], out=out)

    def custom_op():
        torch.ops.cuteaot.moe_activation(x, out, bundle.id, "silu", True, None, None, None)

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})  # one core: less migration noise
    host = host_us_per_call({
        "bare cuLaunchKernel (pre-packed void**)": bare_prepacked,
        "bare cuLaunchKernel (args tuple)": bare_tuple,
        "bare cuLaunchKernelEx (pre-packed, programmatic launch)": bare_programmatic,
        "cuteaot moe_activation": runtime_call,
        "torch.ops.cuteaot.moe_activation (custom op)": custom_op,
        "torch silu(gate) * up (2 kernels)": torch_op,
    })
    results["host_us_per_launch"] = host

    # ---- device time at serving sizes vs roofline
    bw = hbm_copy_bandwidth()
    results["hbm_copy_bandwidth_TBps"] = bw / 1e12
    rows_device = []
    for tokens in (1, 64, 1024, 16384):
        rows = tokens * K
        sets = 20 if tokens <= 1024 else 2  # rotate buffers: >= 2x the 60 MB L2 from 1024 tokens up
        xs = [torch.randn(rows, 2 * I, device="cuda", dtype=dt) for _ in range(sets)]
        oa = [torch.empty(rows, I, device="cuda", dtype=dt) for _ in range(sets)]
        fc2 = [torch.randn(tokens, K, H, device="cuda", dtype=dt) for _ in range(sets)]
        os_ = [torch.empty(tokens, H, device="cuda", dtype=dt) for _ in range(sets)]
        act_bytes = rows * 3 * I * 2
        sum_bytes = tokens * (K + 1) * H * 2
        r = range(sets)
        rows_device.append({
            "tokens": tokens,
            "activation_us": device_us([lambda i=i: moe_activation(bundle, xs[i], oa[i]) for i in r]),
            "activation_roofline_us": act_bytes / bw * 1e6,
            "activation_torch_us": device_us(
                [lambda i=i: torch.mul(F.silu(xs[i][:, :I]), xs[i][:, I:], out=oa[i]) for i in r]),
            "topk_sum_us": device_us([lambda i=i: moe_topk_sum(bundle, fc2[i], os_[i]) for i in r]),
            "topk_sum_roofline_us": sum_bytes / bw * 1e6,
            "topk_sum_torch_us": device_us([lambda i=i: torch.sum(fc2[i], dim=1, out=os_[i]) for i in r]),
        })
    results["device"] = rows_device
    results["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()

    print(f"\n## launch overhead ({results['gpu']}), host µs per launch, median of 15 interleaved rounds × 2000 calls")
    base = host["bare cuLaunchKernel (pre-packed void**)"]
    for name, us in host.items():
        print(f"| {name} | {us:.2f} | {us / base:.2f}× |")
    print(f"\n## device time, Qwen3-30B-A3B shapes (H {H}, I {I}, top {K}); HBM copy {bw / 1e12:.2f} TB/s")
    print("| tokens | act µs | act roofline µs | torch act µs | sum µs | sum roofline µs | torch sum µs |")
    for r in rows_device:
        print(f"| {r['tokens']} | {r['activation_us']:.1f} | {r['activation_roofline_us']:.1f} | {r['activation_torch_us']:.1f}"
              f" | {r['topk_sum_us']:.1f} | {r['topk_sum_roofline_us']:.1f} | {r['topk_sum_torch_us']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
