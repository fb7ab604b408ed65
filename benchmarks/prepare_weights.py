"""Weight preparation cost: seconds and peak memory to pack one MoE layer, on the CPU or a GPU.

Random checkpoint tensors of a model's layer shape (ModelOpt NVFP4, gpt-oss's MXFP4 for `mxfp4`, or
`quantize_nf3`'s output for `nf3`; values do not change the work) are packed by the runtime's `prepare_*` functions,
as `load_moe_layer` does after reading them; the median of `--reps` runs is reported with the peak
memory above the inputs (CPU: the process's max RSS, so each format runs in its own process; GPU:
`torch.cuda.max_memory_allocated`). Runs anywhere the runtime imports (no bundle, no GPU needed).

    python -m benchmarks.prepare_weights [--models qwen3-30b-a3b,gpt-oss-120b] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

# (hidden, intermediate, experts) of the layers in specs/moe-models.yaml and the default bundle
MODELS = {
    "qwen3-30b-a3b": (2048, 768, 128),
    "gpt-oss-120b": (2880, 2880, 128),
    "glm-4.5-air": (4096, 1408, 128),
    "mixtral-8x7b": (4096, 14336, 8),
}
FORMATS = ("nvfp4", "mxfp4", "nf3")


def _inputs(fmt: str, hidden: int, inter: int, experts: int, device: str) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    if fmt == "mxfp4":
        def mx(n, k):
            return (torch.randint(0, 256, (experts, n, k // 32, 16), dtype=torch.uint8, generator=g).to(device),
                    torch.randint(118, 134, (experts, n, k // 32), dtype=torch.uint8, generator=g).to(device))
        return {"w13": mx(2 * inter, hidden), "w2": mx(hidden, inter)}
    if fmt == "nf3":
        def nf3(n, k):
            return (torch.randint(0, 8, (experts, n, k), dtype=torch.uint8, generator=g).to(device),
                    (torch.rand(experts, n, k // 32, generator=g) + 0.5).to(torch.float8_e4m3fn).to(device),
                    (torch.rand(experts, generator=g) + 0.5).to(device))
        return {"w13": nf3(2 * inter, hidden), "w2": nf3(hidden, inter)}

    def nv(n, k, scale_2):
        return (torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, generator=g).to(device),
                (torch.rand(experts, n, k // 16, generator=g) + 0.5).to(torch.float8_e4m3fn).to(device),
                scale_2.to(device))
    return {"w13": nv(2 * inter, hidden, torch.rand(experts, 2, generator=g) + 0.5),
            "w2": nv(hidden, inter, torch.rand(experts, generator=g) + 0.5)}


def measure(model: str, fmt: str, device: str, reps: int) -> dict:
    """One (model, format): median seconds of W13 and W2, and peak bytes above the inputs."""
    import resource

    import torch

    from cuteaot.runtime import (
        prepare_w2, prepare_w2_mxfp4, prepare_w2_nf3, prepare_w13, prepare_w13_mxfp4, prepare_w13_nf3,
    )

    hidden, inter, experts = MODELS[model]
    tensors = _inputs(fmt, hidden, inter, experts, device)
    p13, p2 = {"nvfp4": (prepare_w13, prepare_w2), "mxfp4": (prepare_w13_mxfp4, prepare_w2_mxfp4),
               "nf3": (prepare_w13_nf3, prepare_w2_nf3)}[fmt]
    dtype = () if fmt == "nf3" else ("bf16",)  # NF3 serves bf16 only and takes no dtype
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times: dict = {"w13": [], "w2": []}
    for _ in range(reps):
        for name, prepare in (("w13", p13), ("w2", p2)):
            start = time.perf_counter()
            packed = prepare(*tensors[name], *dtype)
            if cuda:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            del packed
    peak = (torch.cuda.max_memory_allocated() if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - base
    input_bytes = sum(t.numel() * t.element_size() for ts in tensors.values() for t in ts)
    return {"model": model, "format": fmt, "device": device, "w13_s": statistics.median(times["w13"]),
            "w2_s": statistics.median(times["w2"]), "peak_above_inputs_bytes": peak, "input_bytes": input_bytes,
            "reps": reps}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-120b")
    parser.add_argument("--formats", default="nvfp4,mxfp4")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child process: model:format
    args = parser.parse_args(argv)
    if args.one:
        model, fmt = args.one.split(":")
        print(json.dumps(measure(model, fmt, args.device, args.reps)))
        return
    rows = []
    for model in args.models.split(","):
        if model not in MODELS:
            raise SystemExit(f"unknown model {model!r}; known: {', '.join(MODELS)}")
        for fmt in args.formats.split(","):
            if fmt not in FORMATS:
                raise SystemExit(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
            # a process each: max RSS never goes down, so a run would otherwise inherit its predecessor's
            child = subprocess.run([sys.executable, "-m", "benchmarks.prepare_weights", "--one", f"{model}:{fmt}",
                                    "--device", args.device, "--reps", str(args.reps)],
                                   check=True, capture_output=True, text=True)
            rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
    print("| model | format | device | W13 s | W2 s | inputs MiB | peak above inputs MiB |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['format']} | {r['device']} | {r['w13_s']:.2f} | {r['w2_s']:.2f} | "
              f"{r['input_bytes'] / 2**20:.0f} | {r['peak_above_inputs_bytes'] / 2**20:.0f} |")
    if args.json:
        from .common import write_results

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        write_results(args.json, "prepare-weights", commit or None,
                      f"runtime prepare_* on random tensors of each layer's shape, bf16, median of {args.reps}, "
                      "peak = max RSS (CPU) or max_memory_allocated (GPU) above the inputs, a process per format", rows)


if __name__ == "__main__":
    main()
