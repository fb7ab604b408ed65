"""Timing helpers for the GPU benchmarks (medians, CUDA events, measured ceilings)."""

from __future__ import annotations

import statistics
import time

import torch


def host_us_per_call(fns: dict, calls: int = 2000, reps: int = 15) -> dict:
    """Host wall time per call for each named callable: rounds interleave the callables
    (so drift of the host hits all alike) and the median over rounds is reported.
    The GPU keeps up with these tiny kernels, so this is the host's launch cost."""
    for fn in fns.values():
        for _ in range(500):
            fn()
    torch.cuda.synchronize()
    samples: dict = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(v) for name, v in samples.items()}


def device_us(calls, iters: int = 20, reps: int = 11) -> float:
    """Median over reps of device time per call: `iters` calls captured in one CUDA graph,
    replays timed with CUDA events (no host launch cost in the number).  `calls` is one
    callable or a list that the graph rotates through (distinct input buffers, so that
    large problems are not served from L2)."""
    calls = calls if isinstance(calls, list) else [calls]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(iters):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / iters * 1e3)
    return statistics.median(samples)


def hbm_copy_bandwidth(gib: float = 4.0) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (bytes read + written)."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    samples = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            dst.copy_(src)
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 5 * 1e3)
    us = statistics.median(samples)
    return 2 * n * 2 / (us * 1e-6)
