"""Enumerations shared by specs, codegen and the runtime."""

from __future__ import annotations

from enum import Enum

import torch


class DType(str, Enum):
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def torch(self) -> torch.dtype:
        return torch.bfloat16 if self is DType.BF16 else torch.float16

    @property
    def itemsize(self) -> int:
        return 2

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> "DType | None":
        return {torch.bfloat16: cls.BF16, torch.float16: cls.FP16}.get(dtype)


class Activation(str, Enum):
    SILU = "silu"  # SwiGLU: silu(gate) * up, gate half first
    SWIGLUOAI = "swigluoai"  # gpt-oss: clamp, gate * sigmoid(alpha * gate) * (up + beta)
    RELU2 = "relu2"  # non-gated: relu(x) ** 2

    @property
    def is_gated(self) -> bool:
        return self is not Activation.RELU2

    def fc1_width(self, intermediate_size: int) -> int:
        return fc1_width(intermediate_size, self.is_gated)


def fc1_width(intermediate_size: int, gated: bool) -> int:
    """FC1's output width: gate and up halves (2I) for gated activations, I for relu2."""
    return intermediate_size * (2 if gated else 1)


# gpt-oss defaults for swigluoai (alpha 1.702, beta 1.0 added to up, clamp limit 7.0).
SWIGLUOAI_DEFAULT_ALPHA = 1.702
SWIGLUOAI_DEFAULT_BETA = 1.0
SWIGLUOAI_DEFAULT_LIMIT = 7.0
