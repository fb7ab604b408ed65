"""Timing helpers for the GPU benchmarks (medians, CUDA events, measured ceilings)."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time
import zlib
from pathlib import Path
from typing import Callable

import torch

FLUSH_BYTES = 256 << 20  # the L2 flush: several times the H200's L2 (peers.py's default)


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
    # The warm-up runs on a side stream: it must not start while work queued on the caller's stream
    # (an eager call of the same layer, say) still runs, since streams without a reservation share
    # a layer's workspace (split-K locks included).
    stream.wait_stream(torch.cuda.current_stream())
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


def capture_or_eager(fn: Callable[[], object]) -> tuple[Callable[[], object], str | None]:
    """(a callable that replays `fn` from a one-call CUDA graph, None), or (fn itself, why capture failed).
    The warm-up and the capture run on a side stream that first waits for the current one."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            fn()
    except Exception as exc:  # noqa: BLE001 - some peers cannot be captured: timed eagerly, and said so
        torch.cuda.synchronize()
        return fn, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay, None


def cold_us(runners: dict[str, Callable[[], object]], flush: Callable[[], object], samples: int) -> dict:
    """Device µs of each runner (a graph replay from `capture_or_eager`, or an eager call) with a cold L2,
    runners interleaved sample by sample in a rotating order: per sample and runner, the flush (untimed),
    a CUDA event, the runner, an event.  Nothing is subtracted from the interval, and the flush takes
    far longer than a launch, so the runner's host work is done before the GPU gets to it.  Returns
    name -> {"us": median, "p10", "p90", "samples"}."""
    names = list(runners)
    events = {n: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(samples)] for n in names}
    torch.cuda.synchronize()
    for i in range(samples):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            start, stop = events[name][i]
            flush()
            start.record()
            runners[name]()
            stop.record()
    torch.cuda.synchronize()
    out = {}
    for name in names:
        times = sorted(a.elapsed_time(b) * 1e3 for a, b in events[name])
        out[name] = {"us": statistics.median(times), "p10": times[len(times) // 10],
                     "p90": times[min(len(times) - 1, (9 * len(times)) // 10)], "samples": len(times)}
    return out


class FlushedTimer:
    """Layer timing as the peer benchmark does it, for same-process comparisons (benchmarks/mxfp4.py,
    nf3.py, compare_layer.py): each call captured in a one-call CUDA graph, then per sample an L2 flush,
    a CUDA event, the replay and an event, the calls interleaved sample by sample (clock drift hits all
    alike; `cold_us`); the median over `rounds` * SAMPLES_PER_ROUND samples is reported.  The flush
    reads a buffer: clean lines leave L2 for free, no write-back lands in the timed call."""

    SAMPLES_PER_ROUND = 10

    def __init__(self, nbytes: int = FLUSH_BYTES):
        warm = torch.empty(1 << 28, dtype=torch.bfloat16, device="cuda")
        for _ in range(50):  # bring the clocks up before the first timing
            warm.normal_()
        del warm
        self._buffer = torch.zeros(nbytes // 4, dtype=torch.int32, device="cuda")
        self.flush = self._buffer.sum

    def us(self, calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
        runners = {}
        for name, fn in calls.items():
            runners[name], failed = capture_or_eager(fn)
            if failed:
                raise RuntimeError(f"{name}: CUDA-graph capture failed ({failed})")
        found = cold_us(runners, self.flush, max(rounds * self.SAMPLES_PER_ROUND, 20))
        return {name: found[name]["us"] for name in calls}


def routing_generator(model: str, m: int, device: str = "cuda") -> torch.Generator:
    """The generator of one (model, M)'s routing: the same tokens and experts whichever other M a run
    measures, and in every tool that uses it."""
    return torch.Generator(device=device).manual_seed(zlib.crc32(f"{model}:{m}".encode()))


def uniform_routing(m: int, hidden: int, experts: int, top_k: int, g: torch.Generator):
    """(x bf16 (m, hidden), router weights (m, top_k), int32 ids (m, top_k)): uniform top-k, on g's device."""
    x = torch.randn(m, hidden, generator=g, device=g.device).to(torch.bfloat16)
    ids = torch.rand(m, experts, generator=g, device=g.device).topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(m, top_k, generator=g, device=g.device), dim=1)
    return x, weights, ids


def skewed_routing(m: int, hidden: int, experts: int, top_k: int, g: torch.Generator):
    """As uniform_routing, but most routes on five experts: each token draws its top_k distinct experts
    without replacement (Gumbel top-k) from a distribution that gives the first five 0.45, 0.2, 0.1,
    0.075 and 0.075 and spreads 0.1 over the rest, so that at any top_k a few experts get many route
    blocks and many get one part-filled block."""
    x, weights, _ = uniform_routing(m, hidden, experts, top_k, g)
    crowd = torch.tensor([0.45, 0.2, 0.1, 0.075, 0.075])[:experts]
    rest = experts - crowd.numel()
    probs = torch.cat((crowd, torch.full((rest,), 0.1 / max(rest, 1)))) if rest else crowd
    u = torch.rand(m, experts, generator=g, device=g.device).clamp_min(1e-30)
    keys = probs.to(g.device).log() - (-u.log()).log()  # log p + Gumbel noise: top-k = a draw without replacement
    return x, weights, keys.topk(top_k, dim=1).indices.to(torch.int32)


def run_layers(layers: dict, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *,
               references: dict | None = None, eager: bool | None = None, timer: "FlushedTimer | None" = None,
               rounds: int = 3) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
    """Every named MoE layer on one routing, into its own NaN-poisoned output: eagerly when `eager`
    (default: when `references` is given), checked against `references` (name -> a callable returning
    the float32 reference output; 'rel_err', None when not finite), and timed when `timer` is given
    ('us', the timer's median over `rounds` interleaved rounds).  Returns (fields by name, outputs)."""
    from tests.reference.moe_elementwise import relative_error

    m, hidden = x.shape[0], x.shape[1]
    outs = {n: torch.full((m, hidden), float("nan"), dtype=x.dtype, device=x.device) for n in layers}
    found: dict[str, dict] = {n: {} for n in layers}
    if eager is None:
        eager = references is not None
    if eager:
        for n, layer in layers.items():
            layer(x, weights, ids, out=outs[n])
    for n, reference in (references or {}).items():
        err = relative_error(outs[n], reference())
        found[n]["rel_err"] = err if math.isfinite(err) else None
    if timer is not None:
        calls = {n: (lambda layer=layer, out=outs[n]: layer(x, weights, ids, out=out)) for n, layer in layers.items()}
        for n, us in timer.us(calls, rounds).items():
            found[n]["us"] = us
    return found, outs


def compare_formats(bundle, models: list[str], ms: list[int], check_m: int, rounds: int, build: Callable, *,
                    floors: bool, device: str = "cuda") -> list[dict]:
    """The model x M loop of the same-process layer comparisons (benchmarks/mxfp4.py, nf3.py, modelopt.py).

    build(bundle, model, generator) -> ((H, E, top_k), {impl: (layer, reference, expert_bytes)}):
    `reference(x, weights, ids)` gives the float32 output, checked at `check_m` (outputs poisoned);
    every M of `ms` is timed (FlushedTimer).  With `floors`, each row also carries the weight bytes the
    routing touches (distinct routed experts x expert_bytes) and that many bytes at the measured copy
    bandwidth (`floor_us`).  One generator per model (seeded by its name's length) draws the weights, one
    per (model, M) the routing (`routing_generator`), so two runs see the same problems."""
    timer = FlushedTimer() if ms else None
    bandwidth = hbm_copy_bandwidth() if floors else None
    rows = []
    for name in models:
        g = torch.Generator(device=device).manual_seed(len(name))
        (hidden, experts, top_k), layers = build(bundle, name, g)
        for m in sorted(set(ms) | {check_m}):
            x, w, ids = uniform_routing(m, hidden, experts, top_k, routing_generator(name, m, device))
            references = None
            if m == check_m:
                references = {impl: (lambda ref=ref: ref(x, w, ids)) for impl, (_, ref, _) in layers.items()}
            found, _ = run_layers({impl: entry[0] for impl, entry in layers.items()}, x, w, ids,
                                  references=references, timer=timer if m in ms else None, rounds=rounds)
            routed = int(ids.unique().numel())
            for impl, (layer, _, expert_bytes) in layers.items():
                row = {"model": name, "M": m, "impl": impl, "plan": layer.resolve(m).describe()}
                if bandwidth is not None:
                    row.update(experts=routed, weight_bytes=routed * expert_bytes,
                               floor_us=routed * expert_bytes / bandwidth * 1e6)
                row.update(found[impl])
                rows.append(row)
                us = f"{row['us']:9.1f} us" if "us" in row else " " * 12
                floor = f" (floor {row['floor_us']:6.1f})" if "us" in row and "floor_us" in row else ""
                err = f" rel_err {row['rel_err']:.2e}" if row.get("rel_err") is not None else ""
                print(f"{name:14s} M={m:5d} {impl:11s} {us}{floor}{err}  {row['plan']}", flush=True)
        del layers
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def layer_benchmark_main(argv, *, doc: str, name: str, models: dict, run: Callable, table: Callable,
                         defaults: dict) -> int:
    """The command line of a same-process layer comparison (benchmarks/mxfp4.py, nf3.py): --bundle,
    --models, --m, --check-m, --rounds (defaults from `defaults`), --commit, --json.  Runs
    run(bundle, models, ms, check_m, rounds) -> rows, prints table(rows), writes the rows; exit
    status 1 when a checked output is off the reference by more than 1e-2."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=defaults["bundle"])
    p.add_argument("--models", default=",".join(models), type=comma_list())
    p.add_argument("--m", default=defaults["m"], type=comma_list(int))
    p.add_argument("--check-m", type=int, default=defaults["check_m"])
    p.add_argument("--rounds", type=int, default=defaults["rounds"])
    p.add_argument("--commit", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    unknown = [m for m in args.models if m not in models]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {sorted(models)}")
    from cuteaot.runtime import load_bundle

    rows = run(load_bundle(args.bundle), args.models, args.m, args.check_m, args.rounds)
    print(table(rows))
    write_results(args.json, name, args.commit, doc, rows)
    return 1 if any(r.get("rel_err") is not None and r["rel_err"] > 1e-2 for r in rows) else 0


def comma_list(cast=str) -> Callable[[str], list]:
    """argparse type: "a,b" -> [cast(a), cast(b)] (empty items dropped)."""
    return lambda text: [cast(v) for v in text.split(",") if v]


def write_results(path: str | None, name: str, commit: str | None, method: str, rows: list[dict]) -> Path:
    """Rows as docs/results/<name>-<date>.json (or `path`) with date, commit, GPU (None for a CPU-only
    measurement, with the host's CPU count) and method."""
    today = datetime.date.today().isoformat()
    out = Path(path or Path(__file__).resolve().parents[1] / "docs" / "results" / f"{name}-{today}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    out.write_text(json.dumps({"date": today, "commit": commit, "gpu": gpu, "cpus": os.cpu_count(),
                               "method": method, "rows": rows}, indent=1))
    return out

