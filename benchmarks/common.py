"""Timing helpers for the GPU benchmarks (medians, CUDA events, measured ceilings)."""

from __future__ import annotations

import statistics
import time

import torch


def host_us_per_call(fn, calls: int = 2000, reps: int = 7) -> float:
    """Median over reps of host wall time per call (the GPU keeps up with tiny kernels)."""
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def device_us(fn, iters: int = 50, reps: int = 11) -> float:
    """Median over reps of device time per call, CUDA events around `iters` back-to-back calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / iters * 1e3)
    return statistics.median(samples)


def hbm_copy_bandwidth(gib: float = 4.0) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (bytes read + written)."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = device_us(lambda: dst.copy_(src), iters=5, reps=7)
    return 2 * n * 2 / (us * 1e-6)
