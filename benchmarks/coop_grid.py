"""What a cooperative launch costs, by grid size (the concurrent-streams mode of `MoeLayer.reserve`).

A persistent kernel that meets at grid barriers reads its grid size at run time, so any grid whose CTAs are
all resident is correct.  The planner sizes decode grids to the larger GEMM's tiles (gpt-oss-120b M = 1:
180 CTAs on 132 SMs); launched cooperatively such a grid cost +5.5 µs on the H200 (twenty-sixth session).
This times each layer call plain and cooperative at the planned grid and with the grid-barrier kernels
launched on other grids (e.g. the SM count), CUDA-graph replay with a cold L2 (benchmarks.common.FlushedTimer),
and compares every output with the plain planned call's.

    python -m benchmarks.coop_grid [--bundle generated/moe-models] [--cases gpt-oss-120b:1,...] [--grids 132,264]
"""

from __future__ import annotations

import argparse
import json

import torch

import cuteaot.runtime.bundle as bundle_module
from benchmarks.common import FlushedTimer
from benchmarks.concurrent_barriers import _layer_and_inputs
from cuteaot.runtime import set_cooperative_launch

_GRID = {"x": None}  # the grid of every grid-barrier launch; None: as planned
_launch = bundle_module._cu_launch


def _sized_launch(kernel, grid_x: int, stream: int, params: int) -> None:
    grid = _GRID["x"]
    _launch(kernel, grid if grid is not None and kernel.waits_on_grid else grid_x, stream, params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default="generated/moe-models")
    ap.add_argument("--cases", default="gpt-oss-120b:1,gpt-oss-120b:2,nemotron-3-nano:1,nemotron-3-nano:2,"
                    "qwen3-30b-a3b:1,qwen3-30b-a3b:8")
    ap.add_argument("--grids", default="132,264", help="grids to launch the grid-barrier kernels with instead of "
                    "the planned one (0: the SM count)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    bundle_module._cu_launch = _sized_launch
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grids = [int(g) or sms for g in args.grids.split(",")]
    timer = FlushedTimer()
    cases: dict[str, list[int]] = {}
    for case in args.cases.split(","):
        problem, m = case.split(":")
        cases.setdefault(problem, []).append(int(m))
    rows = []
    for problem, ms in cases.items():
        layer, inputs = _layer_and_inputs(args.bundle, problem, ms)
        for m in ms:
            planned = layer.resolve(m)
            grid = planned.launch.grid_x
            modes = {"plain": (False, None), "coop": (True, None)}
            for other in grids:
                if other != grid:
                    modes[f"coop-{other}"] = (True, other)
                    modes[f"plain-{other}"] = (False, other)
            outs, calls = {}, {}
            for name, (cooperative, grid_x) in modes.items():
                outs[name] = out = torch.full_like(inputs[m][0], float("nan"))

                def call(out=out, cooperative=cooperative, grid_x=grid_x, m=m):
                    previous = set_cooperative_launch(cooperative)
                    _GRID["x"] = grid_x
                    try:
                        layer(*inputs[m], out=out)
                    finally:
                        _GRID["x"] = None
                        set_cooperative_launch(previous)

                calls[name] = call
            us = timer.us(calls, args.rounds)
            ref = outs["plain"].float()
            diffs = {name: float((o.float() - ref).norm() / ref.norm()) for name, o in outs.items()}
            row = dict(problem=problem, m=m, grid=grid, plan=planned.describe(),
                       us={k: round(v, 2) for k, v in us.items()}, diff_vs_plain=diffs)
            rows.append(row)
            print(f"{problem} M={m} grid {grid}: " + ", ".join(f"{k} {v:.2f}" for k, v in us.items())
                  + " us; max diff vs plain " + f"{max(diffs.values()):.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "sms": sms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
