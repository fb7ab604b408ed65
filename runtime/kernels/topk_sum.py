"""Top-k combine after FC2: sum each token's top_k routed rows.

    fc2: (M, top_k, H)  FC2 output per route (router weights already applied), row-major
    out: (M, H)         out[m, :] = sum_k fc2[m, k, :]   (float32 accumulation)

Masked variant (`topk_ids=`, `num_experts=`): only routes whose expert id is in
[0, num_experts) are summed.  Accumulating variant (`accumulate=True`): out[m, :] += the sum,
in float32 on out's own value (one rounding): how the later parts of a HybridMoeLayer write into
the first part's output.  A route the GEMMs dropped (id -1 for a masked route,
or any out-of-range id) has no FC2 row: its row of `fc2` holds whatever the
workspace held before, so it must not be read.  The ids are read on the device
(int32 or int64, compared at their own width): no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..abi import Pointee, Signature, i32, ptr
from ..bundle import Bundle, registered_bundle
from ..errors import BadInputError
from ..keys import SpecKey
from ..tensors import INT32_MAX, check_apart, check_rank, check_tensor
from ..types import DType
from .route_pack import IdsDType
from .rowwise import RowwisePlan

VECTOR = 8  # elements per thread: one 16-byte load per route
MAX_TOP_K = 32  # the route loop is unrolled


_PLAIN_PARAMS = (
    ptr("fc2", Pointee.ELEM, "(M, top_k, H) dtype, row-major, 16B aligned"),
    ptr("out", Pointee.ELEM, "(M, H) dtype, row-major, 16B aligned"),
    i32("tokens", "M, 0 <= M < 2^31"),
)
_MASK_PARAMS = (
    ptr("topk_ids", Pointee.IDS, "(M, top_k) int32|int64 (ids_dtype) expert per route, contiguous", align=None),
    i32("num_experts", "routes with ids outside [0, num_experts) are not summed"),
)


@dataclass(frozen=True)
class TopKSumSpec(SpecKey):
    FAMILY = "moe_topk_sum"
    VERSION = 1
    PLAIN_SIGNATURE = Signature(_PLAIN_PARAMS)
    MASKED_SIGNATURE = Signature(_PLAIN_PARAMS + _MASK_PARAMS)  # the plain one, then the ids
    CONSTANT_FACTS = {"vector": VECTOR}
    # only the masked / accumulating variants carry these: the plain keys stay as they were
    KEY_OMITS_NONE = frozenset({"ids_dtype", "accumulate"})

    dtype: DType
    top_k: int
    hidden_size: int
    ids_dtype: Optional[IdsDType] = None  # masked variant: the dtype of the topk_ids it reads; None = plain
    accumulate: Optional[bool] = None  # True: add the sum into out's rows instead of overwriting them

    @property
    def SIGNATURE(self) -> Signature:  # noqa: N802 -- the name every family's spec exposes
        return self.PLAIN_SIGNATURE if self.ids_dtype is None else self.MASKED_SIGNATURE

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType(self.dtype))
        if self.ids_dtype is not None:
            object.__setattr__(self, "ids_dtype", IdsDType(self.ids_dtype))
        if self.accumulate not in (None, True):
            raise BadInputError(f"accumulate must be None or True, got {self.accumulate!r}")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= MAX_TOP_K:
            raise BadInputError(f"top_k must be an int in [1, {MAX_TOP_K}], got {self.top_k!r}")
        if not isinstance(self.hidden_size, int) or self.hidden_size <= 0 or self.hidden_size % VECTOR:
            raise BadInputError(
                f"hidden_size must be a positive multiple of {VECTOR} (16-byte vectors), got {self.hidden_size!r}"
            )

    def check_shapes(self, fc2: torch.Tensor, out: torch.Tensor) -> int:
        check_rank(fc2, "fc2", 3, "(tokens, top_k, hidden)")
        tokens = fc2.shape[0]
        if tokens > INT32_MAX:
            raise BadInputError(f"fc2 has {tokens} tokens; at most {INT32_MAX} are supported")
        check_rank(out, "out", 2, f"({tokens}, {self.hidden_size})")
        if tuple(out.shape) != (tokens, self.hidden_size):
            raise BadInputError(f"out must have shape {(tokens, self.hidden_size)}, got {tuple(out.shape)}")
        return tokens


def spec_for_call(fc2: torch.Tensor, topk_ids: torch.Tensor | None = None, accumulate: bool = False) -> TopKSumSpec:
    check_rank(fc2, "fc2", 3, "(tokens, top_k, hidden)")
    dt = DType.from_torch(fc2.dtype)
    if dt is None:
        raise BadInputError(f"fc2 must be bfloat16 or float16, got {fc2.dtype}")
    ids = None if topk_ids is None else IdsDType.from_torch(topk_ids.dtype)
    return TopKSumSpec(dt, fc2.shape[1], fc2.shape[2], ids, True if accumulate else None)


class _TopKSumPlan(RowwisePlan):
    src_name = "fc2"

    def __init__(self, bundle: Bundle, spec: TopKSumSpec):
        self.in_tail, self.out_width = (spec.top_k, spec.hidden_size), spec.hidden_size
        super().__init__(bundle, spec, VECTOR)

    def _launch(self, grid: int, stream: int, src: int, out: int, rows: int, extra: dict) -> None:
        self.kernel.launch(grid, stream, fc2=src, out=out, tokens=rows, **extra)  # extra: the masked variant's ids

    def explain(self, fc2: torch.Tensor, out: torch.Tensor) -> None:
        spec = self.spec
        tokens = spec.check_shapes(fc2, out)
        check_tensor(fc2, "fc2", dtype=self.dtype, shape=(tokens, spec.top_k, spec.hidden_size), device=self.device)
        check_tensor(out, "out", dtype=self.dtype, shape=(tokens, spec.hidden_size), device=self.device)

    def masked(self, fc2: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> None:
        """Launch the masked variant: the plain checks, then the ids' (dtype is part of the plan's key)."""
        shape = fc2.shape
        self.check_ids(fc2, shape, topk_ids, num_experts)
        if isinstance(out, torch.Tensor) and out.is_contiguous():  # (a malformed out: the plain checks name it)
            check_apart(out, "out", topk_ids=topk_ids)
        self(fc2, shape, out, topk_ids=topk_ids.data_ptr(), num_experts=num_experts)

    def check_ids(self, fc2: torch.Tensor, shape: torch.Size, topk_ids, num_experts) -> None:
        """One cheap pass over the ids of the masked variant; the detailed checks explain a failure."""
        if not (
            isinstance(topk_ids, torch.Tensor)
            and topk_ids.shape == shape[:2]
            and topk_ids.get_device() == self.device_index
            and topk_ids.is_contiguous()
            and type(num_experts) is int  # not a bool (True would mask every route but expert 0's)
            and 0 < num_experts <= INT32_MAX
        ):
            self._explain_ids(fc2, topk_ids, num_experts)

    def _explain_ids(self, fc2: torch.Tensor, topk_ids, num_experts) -> None:
        check_rank(fc2, "fc2", 3, "(tokens, top_k, hidden)")
        tokens = fc2.shape[0]
        check_rank(topk_ids, "topk_ids", 2, f"({tokens}, {self.spec.top_k})")
        check_tensor(topk_ids, "topk_ids", dtype=topk_ids.dtype, shape=(tokens, self.spec.top_k), device=self.device)
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or not 0 < num_experts <= INT32_MAX:
            raise BadInputError(f"num_experts must be an int in [1, {INT32_MAX}], got {num_experts!r}")
        raise BadInputError("topk_ids failed validation")  # unreachable unless the two checks disagree


class PreparedTopkSum:
    """The masked top-k sum of fixed FC2 rows (`fc2`, (M, top_k, H)) into an (M, H) output (added to it
    with `accumulate`), checked once when built; a call passes the output and the ids, whose shape, dtype, device and contiguity the
    caller guarantees to be those it was built with (MoeLayer checks them per call)."""

    def __init__(self, bundle: Bundle, fc2: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor,
                 num_experts: int, accumulate: bool = False):
        key = ("moe_topk_sum", fc2.dtype, fc2.shape[1], fc2.shape[2], topk_ids.dtype, bool(accumulate))
        plan = bundle.plans.rowwise.get(key, lambda: _TopKSumPlan(bundle, spec_for_call(fc2, topk_ids, accumulate)))
        plan.explain(fc2, out)  # the checks a call would run, now
        plan.check_ids(fc2, fc2.shape, topk_ids, num_experts)
        rows = fc2.shape[0]
        if not rows:
            raise BadInputError("a prepared top-k sum needs at least one token")
        self._grid = (rows * plan.vectors_per_row + plan.threads - 1) // plan.threads
        self._launch = plan.kernel.prepare(("out", "topk_ids"), fc2=fc2.data_ptr(), tokens=rows,
                                           num_experts=num_experts)

    def __call__(self, out: torch.Tensor, topk_ids: torch.Tensor, stream: int) -> None:
        self._launch.launch(self._grid, stream, out.data_ptr(), topk_ids.data_ptr())


def moe_topk_sum(bundle: Bundle, fc2: torch.Tensor, out: torch.Tensor | None = None, *,
                 topk_ids: torch.Tensor | None = None, num_experts: int | None = None) -> torch.Tensor:
    """Sum the top_k routed rows of each token: (M, top_k, H) -> (M, H); returns `out`.

    With `topk_ids` (M, top_k) int32/int64 and `num_experts`, a route whose id is outside
    [0, num_experts) is skipped (its row is never read): pass them when rows of dropped
    routes were not written, e.g. after a GEMM over packed routes with masked (-1) ids.
    """
    if (topk_ids is None) != (num_experts is None):
        raise BadInputError("topk_ids and num_experts go together (the masked sum); pass both or neither")
    if torch.compiler.is_compiling():
        if out is None:
            out = fc2.new_empty((fc2.shape[0], fc2.shape[2]))
        torch.ops.cuteaot.moe_topk_sum(fc2, out, bundle.id, topk_ids, 0 if num_experts is None else num_experts)
        return out
    if not isinstance(fc2, torch.Tensor) or fc2.dim() != 3:
        check_rank(fc2, "fc2", 3, "(tokens, top_k, hidden)")
    shape = fc2.shape
    ids_dtype = None if topk_ids is None else getattr(topk_ids, "dtype", None)
    cache_key = ("moe_topk_sum", fc2.dtype, shape[1], shape[2], ids_dtype)
    if topk_ids is not None and not isinstance(topk_ids, torch.Tensor):
        raise BadInputError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    plan = bundle.plans.rowwise.get(cache_key, lambda: _TopKSumPlan(bundle, spec_for_call(fc2, topk_ids)))
    if out is None:
        out = torch.empty((shape[0], shape[2]), dtype=fc2.dtype, device=fc2.device)
    if topk_ids is None:
        plan(fc2, shape, out)
    else:
        plan.masked(fc2, out, topk_ids, num_experts)
    return out


@torch.library.custom_op("cuteaot::moe_topk_sum", mutates_args=("out",))
def _moe_topk_sum_op(fc2: torch.Tensor, out: torch.Tensor, bundle_id: str, topk_ids: Optional[torch.Tensor] = None,
                     num_experts: int = 0) -> None:
    moe_topk_sum(registered_bundle(bundle_id), fc2, out, topk_ids=topk_ids,
                 num_experts=None if topk_ids is None else num_experts)


@_moe_topk_sum_op.register_fake
def _moe_topk_sum_fake(fc2, out, bundle_id, topk_ids=None, num_experts=0) -> None:
    spec_for_call(fc2, topk_ids).check_shapes(fc2, out)
    if out.dtype != fc2.dtype:
        raise BadInputError(f"out must have dtype {fc2.dtype}, got {out.dtype}")
    if topk_ids is not None and tuple(topk_ids.shape) != tuple(fc2.shape[:2]):
        raise BadInputError(f"topk_ids must have shape {tuple(fc2.shape[:2])}, got {tuple(topk_ids.shape)}")
