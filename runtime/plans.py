"""Launch plans a bundle resolves once and reuses: typed caches, one per kind of plan.

A plan is host-side state only (a loaded kernel, its checked co-residency, an argument
buffer): building one never allocates device memory, so a plan first needed during CUDA-graph
capture is safe to build there.  Device memory lives in `runtime/workspace.py`.
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, TypeVar

P = TypeVar("P")


class PlanCache(Generic[P]):
    """Plans of one kind, by the facts of the call that needed them."""

    def __init__(self, kind: str):
        self.kind = kind
        self._plans: dict[Hashable, P] = {}

    def get(self, facts: Hashable, build: Callable[[], P]) -> P:
        """The plan for these facts, built by `build()` the first time."""
        found = self._plans.get(facts)
        if found is None:
            found = self._plans[facts] = build()
        return found

    def __len__(self) -> int:
        return len(self._plans)

    def __repr__(self) -> str:
        return f"PlanCache({self.kind!r}, {len(self)} plans)"


class BundlePlans:
    """Every plan cache of a bundle (`Bundle.plans`)."""

    def __init__(self):
        self.kernels = PlanCache("persistent kernel")  # table digest -> PersistentLaunch (co-residency checked)
        self.gemm_calls = PlanCache("grouped GEMM call")  # call facts -> (Launch, PersistentLaunch)
        self.rowwise = PlanCache("row-wise kernel")  # activation / top-k sum facts -> launch plan
        self.route_pack = PlanCache("route packing")  # ids dtype -> launch plan

    def __len__(self) -> int:
        return len(self.kernels) + len(self.gemm_calls) + len(self.rowwise) + len(self.route_pack)
