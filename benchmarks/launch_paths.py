"""Host cost of issuing one already-packed kernel launch, by driver-call path (issue 14).

The runtime issues each launch through cuda-python (`driver.cuLaunchKernel` / `cuLaunchKernelEx`).  This
times, for the launches a Qwen3-30B-A3B layer issues at M = 1 and 8 (recorded by `MoeLayer.bind`), the
same driver entry points called three ways: through cuda-python, through ctypes on libcuda with declared
argument types, and (for reference) an empty Python call.  Host µs per launch, median of interleaved
rounds (benchmarks/common.host_us_per_call).

    python -m benchmarks.launch_paths [--bundle generated/moe-models] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch
from cuda.bindings import driver

from benchmarks.common import host_us_per_call
from benchmarks.layer_overhead import bound_call, qwen3_layer, recorded_launch
from cuteaot.runtime.bundle import launch_mode


def libcuda_entry_points():
    lib = ctypes.CDLL("libcuda.so.1")
    plain = lib.cuLaunchKernel
    plain.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    plain.restype = ctypes.c_int
    ex = lib.cuLaunchKernelEx
    ex.argtypes = [ctypes.c_void_p] * 4
    ex.restype = ctypes.c_int
    return plain, ex


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="generated/moe-models")
    ap.add_argument("--json")
    args = ap.parse_args()
    layer = qwen3_layer(args.bundle)
    c_plain, c_ex = libcuda_entry_points()
    rows = []
    for m in (1, 8):
        _, bound = bound_call(layer, m)
        stream = bound.stream
        for r in bound.launches:
            fn, grid, (bx, by, bz), smem, address, config = recorded_launch(r, stream)
            fn_handle = int(fn)
            if config is not None:
                config_ptr = config.getPtr()

                def cuda_python(config=config, fn=fn, address=address):
                    driver.cuLaunchKernelEx(config, fn, address, 0)

                def via_ctypes(config_ptr=config_ptr, fn_handle=fn_handle, address=address):
                    c_ex(config_ptr, fn_handle, address, None)
            else:
                def cuda_python(fn=fn, grid=grid, bx=bx, by=by, bz=bz, smem=smem, address=address):
                    driver.cuLaunchKernel(fn, grid, 1, 1, bx, by, bz, smem, stream, address, 0)

                def via_ctypes(fn_handle=fn_handle, grid=grid, bx=bx, by=by, bz=bz, smem=smem, address=address):
                    c_plain(fn_handle, grid, 1, 1, bx, by, bz, smem, stream, address, None)
            host = host_us_per_call({
                "cuda-python": cuda_python,
                "ctypes libcuda": via_ctypes,
                "empty python call": lambda: None,
            }, calls=1000, reps=11)  # fewer calls than the launch queue holds: host time, not device time
            row = {"M": m, "kernel": r.kernel.record.symbol[:60], "mode": launch_mode(r.kernel), **host}
            rows.append(row)
            print(f"M={m} mode={row['mode']} {row['kernel']}: cuda-python {host['cuda-python']:.2f} us, "
                  f"ctypes {host['ctypes libcuda']:.2f} us, empty call {host['empty python call']:.2f} us", flush=True)
    torch.cuda.synchronize()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
