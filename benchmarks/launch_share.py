"""What each launch of a layer call costs inside the call: the bound call's launches issued whole, then
with the route packing left out, then with only the GEMM / fused kernels (the ids do not change between
replays, so the packed routes of the first call stay valid in the workspace).  The differences are what
folding those launches into the main kernel could save at most; `route_pack_share` times the packing
alone, launch included, which overstates it inside a call (PDL overlaps the next launch with it).

    COMMIT=<sha> python -m benchmarks.launch_share [--bundle generated/moe-models] [--models qwen3-30b-a3b,...]
                                                   [--m 8,64,256,1024] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

from benchmarks.common import FlushedTimer, comma_list, uniform_routing
from benchmarks.compare_layer import _layer, _prepared, _problems, random_layer_weights
from cuteaot.runtime.bundle import ZeroFill


def _family(launch) -> str:
    return "memset" if isinstance(launch, ZeroFill) else launch.kernel.record.key.family


def _issuer(launches):
    def issue():
        stream = torch.cuda.current_stream().cuda_stream
        for launch in launches:
            launch.launch(stream)
    return issue


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="generated/moe-models")
    p.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-120b,glm-4.5-air", type=comma_list())
    p.add_argument("--m", default="8,64,256,1024", type=comma_list(int))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    from cuteaot.runtime import load_bundle

    bundle = load_bundle(args.bundle)
    problems = _problems(bundle)
    timer = FlushedTimer()
    rows = []
    print("| model | M | launches | whole µs | without route packing µs | GEMMs only µs | packing share | plan |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for name in args.models:
        f = problems[name]
        g = torch.Generator(device="cuda").manual_seed(len(name))
        layer = _layer(bundle, f, *_prepared(f, *random_layer_weights(f, g), "nvfp4"))
        for m in args.m:
            x, w, ids = uniform_routing(m, f["hidden_size"], f["num_experts"], f["top_k"], g)
            out = torch.empty_like(x)
            bound = layer.bind(x, w, ids, out)
            launches = bound.launches
            families = [_family(launch) for launch in launches]
            bound()
            torch.cuda.synchronize()
            calls = {"whole": _issuer(launches),
                     "no_pack": _issuer([l for l, fam in zip(launches, families) if fam != "moe_route_pack"]),
                     "gemms": _issuer([l for l, fam in zip(launches, families)
                                       if fam in ("w4a16_moe_gemm", "w4a16_fused_moe", "memset")])}
            us = timer.us(calls, args.rounds)
            share = (us["whole"] - us["no_pack"]) / us["whole"]
            row = dict(model=name, m=m, launches=families, plan=layer.resolve(m).describe(), **us)
            rows.append(row)
            print(f"| {name} | {m} | {' '.join(families)} | {us['whole']:.1f} | {us['no_pack']:.1f} | "
                  f"{us['gemms']:.1f} | {share:.1%} | {row['plan']} |", flush=True)
        del layer
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                       "commit": os.environ.get("COMMIT"), "bundle": args.bundle, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
