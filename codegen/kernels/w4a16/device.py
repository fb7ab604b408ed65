"""The W4A16 family's device code as the compile driver sees it: spec -> (kernel object, fake arguments).

gemm.py (scheduler, the mma.sync loop via mainloop.py and epilogue.py) <- wgmma.py (the sm_90a
warpgroup-MMA loop, and `gemm_kernel`, which picks between them) <- fused.py (both GEMM phases in
one persistent kernel) <- this module: no import cycles.
"""

from __future__ import annotations

from cuteaot.runtime.kernels.w4a16.fused_spec import FusedSpec
from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec

from ..common import fake_arguments
from .fused import W4A16FusedMoeKernel
from .wgmma import gemm_kernel


def build_gemm(spec: GemmSpec):
    return gemm_kernel(spec), fake_arguments(spec)


def build_fused(spec: FusedSpec):
    return W4A16FusedMoeKernel(spec), fake_arguments(spec)
