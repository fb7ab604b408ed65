"""Spec -> specializations (deduplicated, canonical order) and the resolution table."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

from cuteaot.runtime.keys import KernelKey
from cuteaot.runtime.kernels import route_pack_specs
from cuteaot.runtime.kernels.route_pack import IdsDType
from cuteaot.runtime.kernels.probe import probe_specs

from .spec import BundleSpec


@dataclass(frozen=True, order=True)
class Job:
    """One kernel to compile: a key for one architecture."""

    arch: str
    canonical: str
    key: KernelKey

    @classmethod
    def of(cls, key: KernelKey, arch: str) -> "Job":
        return cls(arch, key.canonical, key)


def problem_kernels(spec: BundleSpec):
    """Yield (problem, dtype, fast_math, {role: KernelKey}) for every problem variant."""
    for problem in spec.moe:
        for dtype in problem.dtypes:
            for fast_math in problem.fast_math:
                roles = {
                    "activation": problem.activation_spec(dtype, fast_math).key(),
                    "topk_sum": problem.topk_sum_spec(dtype).key(),
                }
                if problem.gemm or problem.fused:
                    # MoeLayer (and GEMM users) sum with the ids, skipping routes dropped for their id
                    roles.update({f"topk_sum+masked_{ids.value}": problem.topk_sum_spec(dtype, ids).key()
                                  for ids in IdsDType})
                yield problem, dtype, fast_math, roles


def gemm_keys(spec: BundleSpec, step: Optional[Callable[[str], None]] = None) -> dict[str, set[KernelKey]]:
    """GEMM kernels per architecture: the plans of every token count 1..max bucket on each target.

    Plans depend on the device profile (SM count, shared memory), so a GEMM key
    is compiled only for the architecture of the profiles that plan it.  Only a
    handful of distinct plans exist per shape (route block size and tile change
    at a few thresholds), so enumerating every M is cheap per M, but linear in
    the largest bucket: `step(label)` is told of each (problem, profile) first.
    """
    by_arch: dict[str, set[KernelKey]] = {}
    for profile in spec.targets:
        keys = by_arch.setdefault(profile.arch, set())
        for problem in spec.moe:
            if not problem.gemm:
                continue
            if step:
                step(f"gemm {problem.name} on {profile.name}, 1..{problem.tokens[-1]} tokens")
            for dtype in problem.dtypes:
                seen_plans = set()
                for m in range(1, problem.tokens[-1] + 1):
                    specs = problem.gemm_specs(m, dtype, profile)
                    for s in specs.values():
                        if s not in seen_plans:
                            seen_plans.add(s)
                            keys.add(s.key())
    return by_arch


def fused_keys(spec: BundleSpec, step: Optional[Callable[[str], None]] = None) -> dict[str, set[KernelKey]]:
    """Fused MoE kernels per architecture: every variant's plans for 1..max bucket tokens on each target."""
    by_arch: dict[str, set[KernelKey]] = {}
    for profile in spec.targets:
        keys = by_arch.setdefault(profile.arch, set())
        for problem in spec.moe:
            if step and problem.fused:
                step(f"fused {problem.name} on {profile.name}, 1..{problem.tokens[-1]} tokens")
            for dtype in problem.dtypes:
                for fast_math in problem.fast_math:
                    if not problem.fused:
                        continue
                    seen = set()
                    for m in range(1, problem.tokens[-1] + 1):
                        for s in problem.fused_specs(m, dtype, fast_math, profile).values():
                            if s not in seen:
                                seen.add(s)
                                keys.add(s.key())
    return by_arch


def kernel_keys(spec: BundleSpec) -> list[KernelKey]:
    """Architecture-independent kernels (element-wise, route packing, test-only probes)."""
    keys = {key for *_, roles in problem_kernels(spec) for key in roles.values()}
    if any(p.gemm or p.fused for p in spec.moe):
        keys |= {s.key() for s in route_pack_specs()}
    if spec.probes:
        keys |= {s.key() for s in probe_specs()}
    return sorted(keys, key=lambda k: k.canonical)


def jobs(spec: BundleSpec, progress: Optional[Callable[[str], None]] = None) -> list[Job]:
    """Every kernel to compile; `progress(line)` hears "planning <bundle>: problem i/n ..." per planned problem."""
    archs = sorted({t.arch for t in spec.targets})
    common = {Job.of(key, arch) for key in kernel_keys(spec) for arch in archs}
    total = len(spec.targets) * sum(bool(p.gemm) + bool(p.fused) for p in spec.moe)
    count = itertools.count(1)

    def announce(what: str) -> None:
        progress(f"planning {spec.bundle}: problem {next(count)}/{total} {what}")

    step = announce if progress else None
    planned = {Job.of(key, arch) for arch, keys in gemm_keys(spec, step).items() for key in keys}
    planned |= {Job.of(key, arch) for arch, keys in fused_keys(spec, step).items() for key in keys}
    return sorted(common | planned)


def resolution_table(spec: BundleSpec) -> list[dict]:
    """Rows mapping (device profile, problem, dtype, fast_math, token bucket) to kernel keys by role."""
    rows = []
    for profile in spec.targets:
        for problem, dtype, fast_math, roles in problem_kernels(spec):
            for tokens in problem.tokens:
                kernels = {role: key.digest for role, key in roles.items()}
                if problem.gemm:
                    kernels.update({role: s.key().digest for role, s in problem.gemm_specs(tokens, dtype, profile).items()})
                kernels.update({role: s.key().digest
                                for role, s in problem.fused_specs(tokens, dtype, fast_math, profile).items()})
                rows.append(
                    {
                        "profile": profile.name,
                        "problem": problem.name,
                        "dtype": dtype.value,
                        "fast_math": fast_math,
                        "tokens": tokens,
                        "kernels": kernels,
                    }
                )
    return rows
