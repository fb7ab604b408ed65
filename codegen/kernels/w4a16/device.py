"""The W4A16 family's device code as the compile driver sees it: spec -> (kernel object, fake arguments).

gemm.py (scheduler, the mma.sync loop via mainloop.py and epilogue.py) <- wgmma.py (the sm_90a
warpgroup-MMA loop, and `gemm_kernel`, which picks between them) <- fused.py (both GEMM phases in
one persistent kernel), micro.py (the barrier-free small-M layer) <- this module: no import cycles.
"""

from __future__ import annotations

from cuteaot.runtime.kernels.w4a16.fused_spec import FusedSpec
from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

from ..common import fake_arguments
from .fused import W4A16FusedMoeKernel
from .micro import W4A16MicroMoeKernel
from .wgmma import gemm_kernel


def build_gemm(spec: GemmSpec):
    return gemm_kernel(spec), fake_arguments(spec)


def build_fused(spec: FusedSpec):
    kernel = W4A16MicroMoeKernel(spec) if spec.micro else W4A16FusedMoeKernel(spec)
    return kernel, fake_arguments(spec)
