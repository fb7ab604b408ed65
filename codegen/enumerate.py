"""Spec -> the kernels to compile (deduplicated, canonical order) and the resolution table.

The planned kernels are exactly those the resolution table names (codegen/table.py plans
every token count once); the architecture-independent helpers (activation, top-k sum,
route packing, test probes) are added for every target arch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from cuteaot.runtime.keys import KernelKey
from cuteaot.runtime.kernels import route_pack_specs
from cuteaot.runtime.kernels.probe import probe_specs
from cuteaot.runtime.kernels.route_pack import IdsDType

from .spec import BundleSpec
from .table import PlannedBundle, plan_bundle


@dataclass(frozen=True, order=True)
class Job:
    """One kernel to compile: a key for one architecture."""

    arch: str
    canonical: str
    key: KernelKey

    @classmethod
    def of(cls, key: KernelKey, arch: str) -> "Job":
        return cls(arch, key.canonical, key)


def helper_kernels(spec: BundleSpec) -> dict[str, KernelKey]:
    """Architecture-independent kernels by role: element-wise, route packing, test-only probes."""
    roles: dict[str, KernelKey] = {}
    for problem in spec.moe:
        for dtype in problem.dtypes:
            for fast_math in problem.fast_math:
                key = problem.activation_spec(dtype, fast_math).key()
                roles[f"activation {key.digest[:12]}"] = key
            key = problem.topk_sum_spec(dtype).key()
            roles[f"topk_sum {key.digest[:12]}"] = key
            if problem.gemm or problem.fused:
                # MoeLayer (and GEMM users) sum with the ids, skipping routes dropped for their id
                for ids in IdsDType:
                    key = problem.topk_sum_spec(dtype, ids).key()
                    roles[f"topk_sum+masked_{ids.value} {key.digest[:12]}"] = key
                    if any(expert_map for _, expert_map, _ in problem.fused):  # a HybridMoeLayer's later parts add
                        key = problem.topk_sum_spec(dtype, ids, accumulate=True).key()
                        roles[f"topk_sum+masked_{ids.value}+accumulate {key.digest[:12]}"] = key
    if any(p.gemm or p.fused for p in spec.moe):
        roles.update({f"route_pack {s.key().digest[:12]}": s.key() for s in route_pack_specs()})
    if spec.probes:
        roles.update({f"probe {s.key().digest[:12]}": s.key() for s in probe_specs()})
    return roles


def kernel_keys(spec: BundleSpec) -> list[KernelKey]:
    """The architecture-independent kernels, in canonical order."""
    return sorted(set(helper_kernels(spec).values()), key=lambda k: k.canonical)


def jobs_of(spec: BundleSpec, planned: PlannedBundle) -> list[Job]:
    """Every kernel to compile: the helpers for each target arch plus every kernel the table names."""
    archs = sorted({t.arch for t in spec.targets})
    common = {Job.of(key, arch) for key in kernel_keys(spec) for arch in archs}
    named = {Job.of(key, arch) for arch, keys in planned.keys.items() for key in keys}
    return sorted(common | named)


def jobs(spec: BundleSpec, progress: Optional[Callable[[str], None]] = None) -> list[Job]:
    """Every kernel to compile; `progress(line)` hears "planning <bundle>: problem i/n ..." per planned problem."""
    return jobs_of(spec, plan_bundle(spec, progress))
