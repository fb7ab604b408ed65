"""Compile one specialization for one architecture with CuTeDSL; no GPU needed.

Returns the cubin and the facts the manifest records about it: the kernel
symbol (read from the compiled object, never predicted), the PTX parameters
checked against the declared signature, block dims from `.reqntid`, shared
memory, registers and stack.  The kernel's Python parameter names are checked
against the declaration before compiling (abi.check_parameter_names): the PTX
names its parameters by position only.  A kernel whose wgmma ptxas serialized
(resources.wgmma_serialized) is refused: it would be correct and slow.
"""

from __future__ import annotations

import re
import tempfile
import time
from dataclasses import dataclass

import cutlass.cute as cute

from cuteaot.runtime.errors import BuildError
from cuteaot.runtime.keys import KernelKey
from cuteaot.runtime.kernels import FAMILIES

from .abi import check_parameter_names
from .kernels import activation, probe, route_pack, topk_sum
from .kernels.w4a16.device import build_fused, build_gemm
from .ptx import check_abi, parse_entry
from .resources import read_resources, wgmma_serialized

# family -> function(spec) returning (kernel object, fake arguments for cute.compile)
BUILDERS = {
    "moe_activation": activation.build,
    "moe_topk_sum": topk_sum.build,
    "moe_route_pack": route_pack.build,
    "w4a16_moe_gemm": build_gemm,
    "w4a16_fused_moe": build_fused,
    "intrinsic_probe": probe.build,
}
# Dynamic shared memory per family (bytes) where it is a constant; a spec with a
# `dynamic_smem_bytes` property (the GEMM) states its own.
DYNAMIC_SMEM = {"moe_activation": 0, "moe_topk_sum": 0, "moe_route_pack": route_pack.SMEM_BYTES, "intrinsic_probe": 0}


@dataclass(frozen=True)
class CompiledKernel:
    cubin: bytes
    record: dict  # manifest fields except file / sha256 / bytes


def _compiler_version(ptx: str) -> str:
    m = re.search(r"Cuda compilation tools, release ([\d.]+), (V[\d.]+)", ptx)
    return f"{m[1]} {m[2]}" if m else "unknown"


def compile_kernel(key: KernelKey, arch: str) -> CompiledKernel:
    spec_cls = FAMILIES.get(key.family)
    if spec_cls is None or key.family not in BUILDERS:
        raise BuildError(f"no codegen for kernel family {key.family!r}")
    spec = spec_cls.from_facts(key.facts)
    if spec.key() != key:
        raise BuildError(f"{key.describe()} is not a current {key.family} key (version {spec_cls.VERSION})")
    kernel_obj, fake_args = BUILDERS[key.family](spec)
    what = f"{key.describe()} on {arch}"
    check_parameter_names(kernel_obj, spec.SIGNATURE, what)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:
        compiled = cute.compile(
            kernel_obj, *fake_args, options=f"--gpu-arch {arch} --keep-cubin --keep-ptx --dump-dir {dump}"
        )
    seconds = time.perf_counter() - start
    ptx, cubin = compiled.artifacts.PTX, compiled.artifacts.CUBIN
    if not ptx or not cubin:
        raise BuildError(f"CuTeDSL returned no PTX/cubin for {key.describe()} on {arch}")
    symbols = list(compiled.kernel_info)
    if len(symbols) != 1:
        raise BuildError(f"{key.describe()}: expected exactly one device kernel, CuTeDSL produced {symbols}")
    symbol = symbols[0]
    entry = parse_entry(ptx, symbol)
    check_abi(entry, spec.SIGNATURE, what)
    if entry.reqntid is None:
        raise BuildError(f"{symbol}: PTX has no .reqntid; the launch block would be unknown")
    if wgmma_serialized(ptx, cubin):
        raise BuildError(
            f"{what}: ptxas serialized the kernel's wgmma (its PTX keeps groups in flight, its SASS waits for every "
            "group as soon as it is issued), so the main loop would run one MMA at a time. Usually too many registers "
            "live across the MMAs or a wgmma in divergent code: change the kernel or the planner's choice for it."
        )
    res = read_resources(cubin, symbol)
    return CompiledKernel(
        cubin=cubin,
        record={
            "key": key.digest,
            "family": key.family,
            "version": key.version,
            "facts": dict(key.facts),
            "arch": arch,
            "symbol": symbol,
            "params": spec.SIGNATURE.to_json(),
            "block": list(entry.reqntid),
            "dynamic_smem_bytes": getattr(spec, "dynamic_smem_bytes", None) or DYNAMIC_SMEM[key.family],
            "static_smem_bytes": res.static_smem_bytes,
            "registers": res.registers,
            "stack_bytes": res.stack_bytes,
            "local_bytes": res.local_bytes,
            "min_blocks_per_sm": entry.minnctapersm,
            "compiler": _compiler_version(ptx),
            # its PTX waits for the grids before it: the runtime may launch it programmatically (PDL)
            "waits_for_prior_grids": "griddepcontrol.wait" in ptx,
            "compile_seconds": round(seconds, 3),
        },
    )
