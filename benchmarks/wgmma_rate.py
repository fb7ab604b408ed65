"""How fast the H200's tensor cores take m64n128k16 wgmma from two one-warpgroup CTAs an SM, with A in registers
(the large-M loop's form) or in shared memory, alone or with integer work between the MMAs (issue 13).

The large-M GEMMs issue ~25-40 integer instructions (the NVFP4 decode, addresses) per 16-k row between their
register-A wgmma, and ncu puts a fifth of their main loop's stalls on "dispatch" of those instructions.  This
probe takes the data out: every row issues two m64n128k16 on constant operands (B: 16 KiB of zeros in the
128B-swizzle layout; A: constant registers, or a 16 KiB zero tile in shared memory), after ALU_CHAIN_STEPS steps
of four independent integer chains (shift / xor / multiply-add, ~3 SASS a step; `build` counts them), then waits
until `--in-flight` groups are left running.  It answers two questions: does the register operand cost tensor
throughput that the shared one does not, and how many integer instructions a row fit beside the MMAs.

    # builder (CuTeDSL): one cubin per variant, and their launch facts
    python -m benchmarks.wgmma_rate build --out generated/wgmma-rate [--in-flight 1,2]
    # GPU (torch + cuda-python only): every variant timed with CUDA events, TFLOP/s printed and written
    python -m benchmarks.wgmma_rate run --dir generated/wgmma-rate --json rate.json [--per-sm 1]

`--per-sm 1` launches one CTA an SM instead: whether a warpgroup alone keeps the tensor cores busy, or the loop
needs its SM's second CTA in its main loop to reach the rate.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

GRID_PER_SM = 2
THREADS = 128
ROWS = 4  # 16-k rows per loop iteration (one 64-deep stage)
TILE_BYTES = 16384  # B: 128 rows x 128 B; A (shared form): 128 weight rows x 64 k bf16
SMEM_BYTES = 2 * TILE_BYTES + 1024
ALU_CHAIN_STEPS = (0, 8, 16, 32)  # chain steps a row: ~3 integer SASS each (0, 24, 48, 96 a row)
FLOPS_PER_ITER_CTA = ROWS * 2 * (2 * 64 * 128 * 16)


def _symbol_name(mode: str, alu: int, in_flight: int) -> str:
    return f"wgmma_rate_{mode}_{alu}_g{in_flight}"


def variants(in_flight: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """(A operand form, chain steps a row, wgmma groups left running after each row's) of a build."""
    return [(mode, alu, g) for g in in_flight for mode in ("rs", "ss") for alu in ALU_CHAIN_STEPS]


def build(out: Path, in_flight: tuple[int, ...]) -> None:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_ptr
    from cutlass.cutlass_dsl import Int32

    from .wgmma_rate_kernel import Rate

    out.mkdir(parents=True, exist_ok=True)
    facts = []
    for mode, alu, groups in variants(in_flight):
        kernel = Rate(mode, alu, groups)
        ptr = make_ptr(cutlass.Float32, 16, cute.AddressSpace.gmem, assumed_align=16)
        with tempfile.TemporaryDirectory() as dump:
            compiled = cute.compile(kernel, ptr, Int32(1), make_fake_stream(),
                                    options=f"--gpu-arch sm_90a --keep-cubin --dump-dir {dump}")
        symbol = list(compiled.kernel_info)[0]
        name = _symbol_name(mode, alu, groups)
        (out / f"{name}.cubin").write_bytes(compiled.artifacts.CUBIN)
        integer = _integer_sass(out / f"{name}.cubin")
        facts.append({"mode": mode, "alu": alu, "in_flight": groups, "file": f"{name}.cubin", "symbol": symbol,
                      "integer_sass": integer})
        print(f"built {name}: {integer} integer SASS instructions", flush=True)
    (out / "variants.json").write_text(json.dumps({"grid_per_sm": GRID_PER_SM, "threads": THREADS,
                                                   "smem": SMEM_BYTES, "variants": facts}, indent=1))


def _integer_sass(cubin: Path) -> int:
    """Integer-pipe SASS instructions in the cubin (the chains; a few address and loop instructions besides)."""
    import subprocess

    from cuteaot.codegen.resources import cuobjdump_path

    sass = subprocess.run([cuobjdump_path(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in sass.splitlines() if any(f" {op}" in line for op in ("LOP3", "SHF", "IMAD", "IADD3", "LEA")))


def run(directory: Path, iters: int, reps: int, json_path: str | None, per_sm: int | None = None) -> None:
    import torch
    from cuda.bindings import driver

    from cuteaot.runtime.abi import ArgBuffer, Pointee, Signature, i32, ptr
    from cuteaot.runtime.bundle import check_cu

    from .common import device_us

    signature = Signature((ptr("out", Pointee.I32, "two words a thread"), i32("iters", "loop iterations a CTA")))
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the primary context
    meta = json.loads((directory / "variants.json").read_text())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * (per_sm or meta["grid_per_sm"])
    out = torch.zeros(2 * grid * meta["threads"], dtype=torch.int32, device="cuda")
    rows = []
    base = {(v["mode"], v["in_flight"]): v["integer_sass"] for v in meta["variants"] if v["alu"] == 0}  # no chains
    for v in meta["variants"]:
        module = check_cu(driver.cuModuleLoadData((directory / v["file"]).read_bytes()), "cuModuleLoadData")
        fn = check_cu(driver.cuModuleGetFunction(module, v["symbol"].encode()), "cuModuleGetFunction")
        check_cu(driver.cuFuncSetAttribute(fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           meta["smem"]), "cuFuncSetAttribute")
        buffer = ArgBuffer(signature)  # kept alive: `params` points into it
        params = buffer.set(out=out.data_ptr(), iters=iters)

        def launch():  # on the current stream: device_us captures the launches into a graph on its own
            check_cu(driver.cuLaunchKernel(fn, grid, 1, 1, meta["threads"], 1, 1, meta["smem"],
                                           torch.cuda.current_stream().cuda_stream, params, 0), "cuLaunchKernel")

        us = device_us(launch, iters=4, reps=reps)  # graph replays of 4 launches timed with CUDA events, median
        tflops = grid * iters * FLOPS_PER_ITER_CTA / (us * 1e-6) / 1e12
        per_row = (v["integer_sass"] - base[(v["mode"], v["in_flight"])]) / ROWS
        rows.append({"mode": v["mode"], "alu": v["alu"], "in_flight": v["in_flight"], "integer_sass_per_row": per_row,
                     "us": us, "tflops": tflops})
        print(f"{v['mode']} groups in flight {v['in_flight']} (~{per_row:.0f} integer SASS a row): {us:9.1f} us  "
              f"{tflops:6.1f} TFLOP/s", flush=True)
    print("\n| A operand | wgmma groups in flight | integer SASS a 16-k row (two m64n128k16) | TFLOP/s |\n"
          "| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {'registers' if r['mode'] == 'rs' else 'shared memory'} | {r['in_flight']} | "
              f"{r['integer_sass_per_row']:.0f} | {r['tflops']:.0f} |")
    if json_path:
        Path(json_path).write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "iters": iters, "grid": grid,
                                               "ctas_per_sm": grid // sms,
                                               "rows": rows}, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--in-flight", default="1", help="comma list of wgmma groups left running after a row's (1, 2)")
    r = sub.add_parser("run")
    r.add_argument("--dir", type=Path, required=True)
    r.add_argument("--iters", type=int, default=2000)
    r.add_argument("--reps", type=int, default=11)
    r.add_argument("--json", default=None)
    r.add_argument("--per-sm", type=int, default=None,
                   help="CTAs an SM (default: the build's, 2); 1 asks whether one warpgroup alone keeps the tensor "
                        "cores busy")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args.out, tuple(int(g) for g in args.in_flight.split(",")))
    else:
        run(args.dir, args.iters, args.reps, args.json, args.per_sm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
