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

    @classmethod
    def parse(cls, value: object) -> "DType | None":
        """A DType from any usual spelling: DType, "bf16" / "fp16", Hugging Face's "bfloat16" / "float16"
        (config.json's torch_dtype), "torch.bfloat16", or a torch dtype; None for anything else."""
        if isinstance(value, torch.dtype):
            return cls.from_torch(value)
        if not isinstance(value, str):
            return None
        return _DTYPE_NAMES.get(value.lower().removeprefix("torch."))


_DTYPE_NAMES = {"bf16": DType.BF16, "bfloat16": DType.BF16, "fp16": DType.FP16, "float16": DType.FP16,
                "half": DType.FP16}


class Activation(str, Enum):
    SILU = "silu"  # SwiGLU: silu(gate) * up, gate half first
    SWIGLUOAI = "swigluoai"  # gpt-oss: clamp, gate * sigmoid(alpha * gate) * (up + beta)
    RELU2 = "relu2"  # non-gated: relu(x) ** 2

    @property
    def is_gated(self) -> bool:
        return self is not Activation.RELU2

    def fc1_width(self, intermediate_size: int) -> int:
        return fc1_width(intermediate_size, self.is_gated)


class WeightFormat(str, Enum):
    """How a layer's expert weights are stored for the kernels (a layer fact and a key fact)."""

    NVFP4 = "nvfp4"  # e2m1 codes, e4m3 scale per 16 k, the "packed" layout (MXFP4 is packed into it)
    NF3 = "nf3"  # 3-bit codebook codes, e4m3 scale per 32 k, the "nf3" layout; bf16 only
    # NVFP4 read as ModelOpt stores it (the "modelopt" layout, no repacking): W13's gate rows first
    # (w13), or its up rows first (w31)
    MODELOPT = "modelopt"
    MODELOPT_W31 = "modelopt_w31"

    @property
    def layout(self) -> str:
        return {WeightFormat.NVFP4: "packed", WeightFormat.NF3: "nf3"}.get(self, "modelopt")

    @property
    def scale_format(self) -> str:
        return "e4m3_k32" if self is WeightFormat.NF3 else "e4m3_k16"

    @property
    def up_first(self) -> bool:
        """W13 stores its up rows before its gate rows (the kernels then read it rotated by I)."""
        return self is WeightFormat.MODELOPT_W31


def fc1_width(intermediate_size: int, gated: bool) -> int:
    """FC1's output width: gate and up halves (2I) for gated activations, I for relu2."""
    return intermediate_size * (2 if gated else 1)


# gpt-oss defaults for swigluoai (alpha 1.702, beta 1.0 added to up, clamp limit 7.0).
SWIGLUOAI_DEFAULT_ALPHA = 1.702
SWIGLUOAI_DEFAULT_BETA = 1.0
SWIGLUOAI_DEFAULT_LIMIT = 7.0
