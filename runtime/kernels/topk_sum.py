"""Top-k combine after FC2: sum each token's top_k routed rows.

    fc2: (M, top_k, H)  FC2 output per route (router weights already applied), row-major
    out: (M, H)         out[m, :] = sum_k fc2[m, k, :]   (float32 accumulation)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..abi import Param, ParamKind, Signature
from ..bundle import Bundle, registered_bundle
from ..errors import BadInputError
from ..keys import KernelKey
from ..tensors import INT32_MAX, check_rank, check_tensor
from ..types import DType
from .rowwise import RowwisePlan

VECTOR = 8  # elements per thread: one 16-byte load per route
MAX_TOP_K = 32  # the route loop is unrolled


@dataclass(frozen=True)
class TopKSumSpec:
    FAMILY = "moe_topk_sum"
    VERSION = 1
    SIGNATURE = Signature(
        (
            Param("fc2", ParamKind.PTR, "(M, top_k, H) dtype, row-major, 16B aligned"),
            Param("out", ParamKind.PTR, "(M, H) dtype, row-major, 16B aligned"),
            Param("tokens", ParamKind.I32, "M, 0 <= M < 2^31"),
        )
    )

    dtype: DType
    top_k: int
    hidden_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType(self.dtype))
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= MAX_TOP_K:
            raise BadInputError(f"top_k must be an int in [1, {MAX_TOP_K}], got {self.top_k!r}")
        if not isinstance(self.hidden_size, int) or self.hidden_size <= 0 or self.hidden_size % VECTOR:
            raise BadInputError(
                f"hidden_size must be a positive multiple of {VECTOR} (16-byte vectors), got {self.hidden_size!r}"
            )

    def key(self) -> KernelKey:
        return KernelKey(
            self.FAMILY,
            self.VERSION,
            {"dtype": self.dtype.value, "top_k": self.top_k, "hidden_size": self.hidden_size, "vector": VECTOR},
        )

    @classmethod
    def from_facts(cls, facts: dict) -> "TopKSumSpec":
        return cls(DType(facts["dtype"]), facts["top_k"], facts["hidden_size"])

    def check_shapes(self, fc2: torch.Tensor, out: torch.Tensor) -> int:
        check_rank(fc2, "fc2", 3, "(tokens, top_k, hidden)")
        tokens = fc2.shape[0]
        if tokens > INT32_MAX:
            raise BadInputError(f"fc2 has {tokens} tokens; at most {INT32_MAX} are supported")
        check_rank(out, "out", 2, f"({tokens}, {self.hidden_size})")
        if tuple(out.shape) != (tokens, self.hidden_size):
            raise BadInputError(f"out must have shape {(tokens, self.hidden_size)}, got {tuple(out.shape)}")
        return tokens


def spec_for_call(fc2: torch.Tensor) -> TopKSumSpec:
    check_rank(fc2, "fc2", 3, "(tokens, top_k, hidden)")
    dt = DType.from_torch(fc2.dtype)
    if dt is None:
        raise BadInputError(f"fc2 must be bfloat16 or float16, got {fc2.dtype}")
    return TopKSumSpec(dt, fc2.shape[1], fc2.shape[2])


class _TopKSumPlan(RowwisePlan):
    def __init__(self, bundle: Bundle, spec: TopKSumSpec):
        self.in_tail, self.out_width = (spec.top_k, spec.hidden_size), spec.hidden_size
        super().__init__(bundle, spec, VECTOR)

    def explain(self, fc2: torch.Tensor, out: torch.Tensor) -> None:
        spec = self.spec
        tokens = spec.check_shapes(fc2, out)
        check_tensor(fc2, "fc2", dtype=self.dtype, shape=(tokens, spec.top_k, spec.hidden_size), device=self.device)
        check_tensor(out, "out", dtype=self.dtype, shape=(tokens, spec.hidden_size), device=self.device)


def moe_topk_sum(bundle: Bundle, fc2: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum the top_k routed rows of each token: (M, top_k, H) -> (M, H); returns `out`."""
    if torch.compiler.is_compiling():
        if out is None:
            out = fc2.new_empty((fc2.shape[0], fc2.shape[2]))
        torch.ops.cuteaot.moe_topk_sum(fc2, out, bundle.id)
        return out
    if not isinstance(fc2, torch.Tensor) or fc2.dim() != 3:
        check_rank(fc2, "fc2", 3, "(tokens, top_k, hidden)")
    shape = fc2.shape
    cache_key = ("moe_topk_sum", fc2.dtype, shape[1], shape[2])
    plan = bundle.plans.get(cache_key)
    if plan is None:
        plan = bundle.plans[cache_key] = _TopKSumPlan(bundle, spec_for_call(fc2))
    if out is None:
        out = torch.empty((shape[0], shape[2]), dtype=fc2.dtype, device=fc2.device)
    plan(fc2, shape, out)
    return out


@torch.library.custom_op("cuteaot::moe_topk_sum", mutates_args=("out",))
def _moe_topk_sum_op(fc2: torch.Tensor, out: torch.Tensor, bundle_id: str) -> None:
    moe_topk_sum(registered_bundle(bundle_id), fc2, out)


@_moe_topk_sum_op.register_fake
def _moe_topk_sum_fake(fc2, out, bundle_id) -> None:
    spec_for_call(fc2).check_shapes(fc2, out)
    if out.dtype != fc2.dtype:
        raise BadInputError(f"out must have dtype {fc2.dtype}, got {out.dtype}")
