"""Small helpers shared by the CuTeDSL kernel modules."""

from __future__ import annotations

import cutlass

from cuteaot.runtime.types import DType


def cutlass_dtype(dtype: DType):
    return {DType.BF16: cutlass.BFloat16, DType.FP16: cutlass.Float16}[dtype]
