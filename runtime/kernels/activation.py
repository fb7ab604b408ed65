"""MoE activation between FC1 and FC2: SwiGLU (`silu`), gpt-oss `swigluoai`, `relu2`.

    fc1: (rows, 2*I) for gated activations — gate half [:, :I], up half [:, I:]
         (rows, I)   for relu2
    out: (rows, I)

    silu:       out = silu(min(g, L)) * clamp(u, -L, L)        (L only if a limit is set)
    swigluoai:  g, u clamped as above; out = g * sigmoid(alpha * g) * (u + beta)
    relu2:      out = max(x, 0) ** 2

All arithmetic is float32; silu rounds silu(g) and u to the element type before
the product (as the seed does), swigluoai rounds once.  fast_math (the default)
takes the approximate exp and division (ex2.approx, div.approx: a few ulp of
float32 before the rounding to the element type).  Rows are a runtime argument,
so one kernel serves every token count.  The same math runs in FC1's gated
epilogue where the layer's GEMMs are separate launches (GemmSpec epilogue silu /
swigluoai).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..abi import Pointee, Signature, i32, ptr
from ..bundle import Bundle, registered_bundle
from ..errors import BadInputError
from ..keys import SpecKey
from ..tensors import INT32_MAX, check_rank, check_tensor
from ..types import (
    SWIGLUOAI_DEFAULT_ALPHA,
    SWIGLUOAI_DEFAULT_BETA,
    SWIGLUOAI_DEFAULT_LIMIT,
    Activation,
    DType,
)
from .rowwise import RowwisePlan

VECTOR = 8  # elements per thread: one 16-byte load per operand


@dataclass(frozen=True)
class ActivationSpec(SpecKey):
    """Compile-time facts of one activation kernel; one validity check for every caller."""

    FAMILY = "moe_activation"
    VERSION = 1
    SIGNATURE = Signature(
        (
            ptr("fc1", Pointee.ELEM, "(rows, 2I) gated / (rows, I) relu2, dtype, row-major, 16B aligned"),
            ptr("out", Pointee.ELEM, "(rows, I) dtype, row-major, 16B aligned"),
            i32("rows", "number of rows to process, 0 <= rows < 2^31"),
        )
    )
    CONSTANT_FACTS = {"vector": VECTOR}

    activation: Activation
    dtype: DType
    intermediate_size: int
    fast_math: bool = True
    swiglu_alpha: Optional[float] = None  # swigluoai only
    swiglu_beta: Optional[float] = None  # swigluoai only
    swiglu_limit: Optional[float] = None  # silu or swigluoai

    @classmethod
    def create(
        cls,
        activation: Activation | str,
        dtype: DType | str,
        intermediate_size: int,
        *,
        fast_math: bool = True,
        swiglu_alpha: float | None = None,
        swiglu_beta: float | None = None,
        swiglu_limit: float | None = None,
    ) -> "ActivationSpec":
        """Build a spec, filling the swigluoai defaults (gpt-oss: alpha 1.702, beta 1, limit 7)."""
        try:
            act = Activation(activation)
        except ValueError:
            raise BadInputError(
                f"activation must be one of {[a.value for a in Activation]}, got {activation!r}"
            ) from None
        try:
            dt = DType(dtype)
        except ValueError:
            raise BadInputError(f"dtype must be one of {[d.value for d in DType]}, got {dtype!r}") from None
        if act is Activation.RELU2:
            fast_math = False  # relu2 has no transcendental: one kernel serves both settings
        if act is Activation.SWIGLUOAI:
            swiglu_alpha = SWIGLUOAI_DEFAULT_ALPHA if swiglu_alpha is None else swiglu_alpha
            swiglu_beta = SWIGLUOAI_DEFAULT_BETA if swiglu_beta is None else swiglu_beta
            swiglu_limit = SWIGLUOAI_DEFAULT_LIMIT if swiglu_limit is None else swiglu_limit
        as_float = lambda v: None if v is None else float(v)  # noqa: E731
        return cls(
            act, dt, intermediate_size, bool(fast_math),
            as_float(swiglu_alpha), as_float(swiglu_beta), as_float(swiglu_limit),
        )

    def __post_init__(self) -> None:
        if not isinstance(self.intermediate_size, int) or self.intermediate_size <= 0:
            raise BadInputError(f"intermediate_size must be a positive int, got {self.intermediate_size!r}")
        if self.intermediate_size % VECTOR:
            raise BadInputError(
                f"intermediate_size must be a multiple of {VECTOR} (16-byte vectors), got {self.intermediate_size}"
            )
        if self.activation is not Activation.SWIGLUOAI and (
            self.swiglu_alpha is not None or self.swiglu_beta is not None
        ):
            raise BadInputError(f"swiglu_alpha/swiglu_beta apply to swigluoai only, not {self.activation.value}")
        if self.activation is Activation.RELU2 and self.swiglu_limit is not None:
            raise BadInputError("swiglu_limit applies to gated activations (silu, swigluoai), not relu2")
        if self.swiglu_limit is not None and not (math.isfinite(self.swiglu_limit) and self.swiglu_limit > 0):
            raise BadInputError(f"swiglu_limit must be a positive finite number, got {self.swiglu_limit}")
        for name in ("swiglu_alpha", "swiglu_beta"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise BadInputError(f"{name} must be finite, got {value}")

    @property
    def input_width(self) -> int:
        return self.activation.fc1_width(self.intermediate_size)

    def check_shapes(self, x: torch.Tensor, out: torch.Tensor) -> int:
        """Shape-only checks (also used by the fake op); returns rows."""
        check_rank(x, "fc1", 2, f"(rows, {self.input_width})")
        rows = x.shape[0]
        if x.shape[1] != self.input_width:
            raise BadInputError(f"fc1 must have {self.input_width} columns for {self.activation.value}, got {x.shape[1]}")
        if rows > INT32_MAX:
            raise BadInputError(f"fc1 has {rows} rows; at most {INT32_MAX} are supported")
        check_rank(out, "out", 2, f"({rows}, {self.intermediate_size})")
        if tuple(out.shape) != (rows, self.intermediate_size):
            raise BadInputError(f"out must have shape {(rows, self.intermediate_size)}, got {tuple(out.shape)}")
        return rows


class _ActivationPlan(RowwisePlan):
    src_name = "fc1"

    def __init__(self, bundle: Bundle, spec: ActivationSpec):
        self.in_tail, self.out_width = (spec.input_width,), spec.intermediate_size
        super().__init__(bundle, spec, VECTOR)

    def _launch(self, grid: int, stream: int, src: int, out: int, rows: int, extra: dict) -> None:
        self.kernel.launch(grid, stream, fc1=src, out=out, rows=rows)

    def explain(self, x: torch.Tensor, out: torch.Tensor) -> None:
        spec = self.spec
        rows = spec.check_shapes(x, out)
        check_tensor(x, "fc1", dtype=self.dtype, shape=(rows, spec.input_width), device=self.device)
        check_tensor(out, "out", dtype=self.dtype, shape=(rows, spec.intermediate_size), device=self.device)


def spec_for_call(dtype: torch.dtype, width: int, activation: str, fast_math: bool, alpha, beta, limit) -> ActivationSpec:
    """The spec a call with an FC1 tensor of this dtype and column count asks for."""
    dt = DType.from_torch(dtype)
    if dt is None:
        raise BadInputError(f"fc1 must be bfloat16 or float16, got {dtype}")
    try:
        act = Activation(activation)
    except ValueError:
        raise BadInputError(f"activation must be one of {[a.value for a in Activation]}, got {activation!r}") from None
    if act.is_gated and width % 2:
        raise BadInputError(f"fc1 has {width} columns; {act.value} needs [gate | up] halves of equal width")
    return ActivationSpec.create(
        act, dt, width // 2 if act.is_gated else width,
        fast_math=fast_math, swiglu_alpha=alpha, swiglu_beta=beta, swiglu_limit=limit,
    )


def _new_plan(bundle: Bundle, cache_key: tuple) -> _ActivationPlan:
    """Resolve a call signature seen for the first time (its launch plan, cached by the caller)."""
    _, dtype, width, activation, fast_math, alpha, beta, limit = cache_key
    return _ActivationPlan(bundle, spec_for_call(dtype, width, activation, fast_math, alpha, beta, limit))


def moe_activation(
    bundle: Bundle,
    fc1: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    activation: str = "silu",
    fast_math: bool = True,
    swiglu_alpha: float | None = None,
    swiglu_beta: float | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Apply the MoE activation to FC1 output rows; returns `out` (allocated if None).

    fc1: (rows, 2I) for silu/swigluoai (gate half first), (rows, I) for relu2; bf16/fp16, on the
    bundle's device, contiguous, 16-byte aligned.  Launches on torch's current stream; CUDA-graph
    capturable when `out` is given.
    """
    if torch.compiler.is_compiling():
        if out is None:
            out = _empty_out(fc1, activation)
        torch.ops.cuteaot.moe_activation(fc1, out, bundle.id, activation, fast_math, swiglu_alpha, swiglu_beta, swiglu_limit)
        return out
    if not isinstance(fc1, torch.Tensor) or fc1.dim() != 2:
        check_rank(fc1, "fc1", 2, "(rows, columns)")
    shape = fc1.shape
    cache_key = ("moe_activation", fc1.dtype, shape[1], activation, fast_math, swiglu_alpha, swiglu_beta, swiglu_limit)
    plan = bundle.plans.rowwise.get(cache_key, lambda: _new_plan(bundle, cache_key))
    if out is None:
        out = torch.empty((shape[0], plan.out_width), dtype=fc1.dtype, device=fc1.device)
    plan(fc1, shape, out)
    return out


def _empty_out(fc1: torch.Tensor, activation: str) -> torch.Tensor:
    spec = spec_for_call(fc1.dtype, fc1.shape[1], activation, True, None, None, None)
    return fc1.new_empty((fc1.shape[0], spec.intermediate_size))


@torch.library.custom_op("cuteaot::moe_activation", mutates_args=("out",))
def _moe_activation_op(
    fc1: torch.Tensor,
    out: torch.Tensor,
    bundle_id: str,
    activation: str,
    fast_math: bool,
    swiglu_alpha: Optional[float],
    swiglu_beta: Optional[float],
    swiglu_limit: Optional[float],
) -> None:
    moe_activation(
        registered_bundle(bundle_id), fc1, out, activation=activation, fast_math=fast_math,
        swiglu_alpha=swiglu_alpha, swiglu_beta=swiglu_beta, swiglu_limit=swiglu_limit,
    )


@_moe_activation_op.register_fake
def _moe_activation_fake(fc1, out, bundle_id, activation, fast_math, swiglu_alpha, swiglu_beta, swiglu_limit) -> None:
    check_rank(fc1, "fc1", 2, "(rows, columns)")
    spec = spec_for_call(fc1.dtype, fc1.shape[1], activation, fast_math, swiglu_alpha, swiglu_beta, swiglu_limit)
    spec.check_shapes(fc1, out)
    if out.dtype != fc1.dtype:
        raise BadInputError(f"out must have dtype {fc1.dtype}, got {out.dtype}")
