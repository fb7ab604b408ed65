"""Spec -> specializations (deduplicated, canonical order) and the resolution table."""

from __future__ import annotations

from dataclasses import dataclass

from cuteaot.runtime.keys import KernelKey

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
                yield problem, dtype, fast_math, {
                    "activation": problem.activation_spec(dtype, fast_math).key(),
                    "topk_sum": problem.topk_sum_spec(dtype).key(),
                }


def kernel_keys(spec: BundleSpec) -> list[KernelKey]:
    keys = {key for *_, roles in problem_kernels(spec) for key in roles.values()}
    return sorted(keys, key=lambda k: k.canonical)


def jobs(spec: BundleSpec) -> list[Job]:
    archs = sorted({t.arch for t in spec.targets})
    return sorted(Job.of(key, arch) for key in kernel_keys(spec) for arch in archs)


def resolution_table(spec: BundleSpec) -> list[dict]:
    """Rows mapping (device profile, problem, dtype, fast_math, token bucket) to kernel keys by role."""
    rows = []
    for profile in spec.targets:
        for problem, dtype, fast_math, roles in problem_kernels(spec):
            for tokens in problem.tokens:
                rows.append(
                    {
                        "profile": profile.name,
                        "problem": problem.name,
                        "dtype": dtype.value,
                        "fast_math": fast_math,
                        "tokens": tokens,
                        "kernels": {role: key.digest for role, key in roles.items()},
                    }
                )
    return rows
