"""Layers whose CTAs wait on each other, on two streams at once: plain against cooperative launches.

    python -m benchmarks.concurrent_barriers --bundle generated/moe-models --problem qwen3-30b-a3b

The fused kernel's grid barrier and the GEMMs' split-K turns need every CTA of the grid resident at once.
On an idle GPU the grid fits (the planner sizes it so); beside another stream's work it may not: a
grid that starts while the SMs are partly held can leave part of its CTAs spinning at the barrier
while the rest wait for SMs that another spinning grid holds.  Two parts:

* hang: per launch mode, a child process runs `--trials` rounds of two streams (one of high priority)
  that each queue a matmul of random size and then `--calls` layer calls, the two streams' layers
  drained at random moments against each other; the child is killed after `--timeout` s.  Prints how
  many rounds completed, and "HUNG" where the child did not finish.  With `--graphs` the layer calls
  are CUDA graphs captured on each stream after `reserve()` and replayed there (as an engine with two
  overlapped batches replays its graphs): a graph keeps the launch attributes it was captured with.
* cost: the layer's µs with each launch mode, with and without programmatic dependent launch
  (CUDA-graph replay, L2 flushed, interleaved rounds) at `--m-cost`, and the relative difference of
  the outputs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch

# the hang test's: (cooperative,), PDL as configured; "default" leaves the runtime's setting as it is
MODES = {"plain": (False,), "cooperative": (True,), "default": (None,)}
# the cost part's: (cooperative, programmatic); PDL off shows what a cooperative grid gives up of it
COST_MODES = {"plain": (False, True), "cooperative": (True, True), "plain-nopdl": (False, False),
              "cooperative-nopdl": (True, False)}


def _layer_and_inputs(bundle_path: str, problem: str, ms: list[int]):
    from benchmarks.common import uniform_routing
    from benchmarks.compare_layer import _layer, _prepared, _problems, layer_dtype, random_layer_weights
    from cuteaot.runtime import load_bundle

    bundle = load_bundle(bundle_path)
    facts = _problems(bundle)[problem]
    g = torch.Generator(device="cuda").manual_seed(5)
    layer = _layer(bundle, facts, *_prepared(facts, *random_layer_weights(facts, g), "nvfp4"))
    inputs = {}
    for m in ms:
        x, w, ids = uniform_routing(m, facts["hidden_size"], facts["num_experts"], facts["top_k"], g)
        inputs[m] = (x.to(layer_dtype(facts)), w, ids)
    return layer, inputs


def child(args) -> None:
    """One launch mode's hang test; prints a line per 10 rounds."""
    from cuteaot.runtime import set_cooperative_launch

    if MODES[args.child][0] is not None:
        set_cooperative_launch(MODES[args.child][0])
    layer, inputs = _layer_and_inputs(args.bundle, args.problem.split(",")[0], args.m)
    want = {m: layer(*inputs[m]) for m in args.m}  # one stream at a time
    streams = [torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)]  # low, high
    layer.reserve(streams)
    rng = random.Random(1)
    mats = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for n in (2048, 3072, 4096, 6144)]
    outs = {(s, m): torch.full_like(inputs[m][0], float("nan")) for s in range(2) for m in args.m}
    graphs = _graphs(layer, inputs, outs, streams) if args.graphs else None
    for out in outs.values():  # poisoned after the graphs' warm-up calls: only the rounds may write them
        out.fill_(float("nan"))
    written = set()
    torch.cuda.synchronize()
    for trial in range(args.trials):
        for s, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                a = rng.choice(mats)
                torch.mm(a, a)  # holds SMs for a while; the layers queue behind it
                for _ in range(args.calls):
                    m = rng.choice(args.m)
                    if graphs is None:
                        layer(*inputs[m], out=outs[(s, m)])
                    else:
                        graphs[(s, m)].replay()
                    written.add((s, m))
        if rng.random() < 0.5:
            streams[rng.randrange(2)].synchronize()
        if trial % 10 == 9:
            torch.cuda.synchronize()
            print(f"{args.child}: {trial + 1} rounds", flush=True)
    torch.cuda.synchronize()
    for s, m in written:  # each stream's last call of each M, against the one-stream result
        out = outs[(s, m)]
        err = float((out.float() - want[m].float()).norm() / want[m].float().norm())
        if not err < 1e-2:
            print(f"{args.child}: stream {s} M={m} differs from the one-stream result by {err:.3e}", flush=True)
            raise SystemExit(3)
    print(f"{args.child}: done {args.trials} rounds", flush=True)


def _graphs(layer, inputs, outs, streams) -> dict:
    """{(stream index, M): a CUDA graph of one layer call writing outs[(s, M)]}, each captured on its stream
    (so it runs with that stream's reserved workspace), after an eager warm-up call there."""
    graphs = {}
    for s, stream in enumerate(streams):
        for m, args in inputs.items():
            with torch.cuda.stream(stream):
                layer(*args, out=outs[(s, m)])
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                layer(*args, out=outs[(s, m)])
            graphs[(s, m)] = graph
    torch.cuda.synchronize()
    return graphs


def hang_test(args) -> dict:
    results = {}
    for mode in ("plain", "cooperative"):
        cmd = [sys.executable, "-m", "benchmarks.concurrent_barriers", "--child", mode, "--bundle", args.bundle,
               "--problem", args.problem.split(",")[0], "--m", ",".join(map(str, args.m)), "--trials", str(args.trials),
               "--calls", str(args.calls)] + (["--graphs"] if args.graphs else [])
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = done.stdout.strip().splitlines()
            status = lines[-1] if done.returncode == 0 and lines else f"rc {done.returncode}: {done.stderr[-400:]}"
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            lines = out.strip().splitlines()
            status = f"HUNG after {lines[-1] if lines else '0 rounds'}"
        results[mode] = dict(status=status, seconds=round(time.perf_counter() - start, 1))
        print(f"hang test, {mode}: {status} ({results[mode]['seconds']} s)", flush=True)
    return results


def cost(args) -> list[dict]:
    from benchmarks.common import FlushedTimer

    timer = FlushedTimer()
    rows = []
    for problem in args.problem.split(","):
        rows += _cost_of(problem, args, timer)
    return rows


def _cost_of(problem: str, args, timer) -> list[dict]:
    from cuteaot.runtime import set_cooperative_launch, set_programmatic_launch
    from tests.reference.moe_elementwise import relative_error

    layer, inputs = _layer_and_inputs(args.bundle, problem, args.m_cost)
    rows = []
    for m in args.m_cost:
        outs, calls = {}, {}
        for mode, (cooperative, programmatic) in COST_MODES.items():
            out = torch.empty_like(inputs[m][0])
            outs[mode] = out

            def call(out=out, cooperative=cooperative, programmatic=programmatic, m=m):
                # a graph keeps the attributes it was captured with
                previous = set_cooperative_launch(cooperative), set_programmatic_launch(programmatic)
                try:
                    layer(*inputs[m], out=out)
                finally:
                    set_cooperative_launch(previous[0])
                    set_programmatic_launch(previous[1])

            calls[mode] = call
        us = timer.us(calls, args.rounds)
        diff = relative_error(outs["cooperative"].float(), outs["plain"].float())
        row = dict(problem=problem, m=m, plan=layer.resolve(min(m, layer.max_tokens)).describe(),
                   **{f"{mode}_us": round(v, 2) for mode, v in us.items()},
                   ratio=round(us["cooperative"] / us["plain"], 4), rel_diff=float(diff))
        rows.append(row)
        print(f"{problem} M={m}: " + ", ".join(f"{mode} {v:.2f}" for mode, v in us.items())
              + f" us; cooperative/plain x{row['ratio']}; outputs differ by {diff:.2e}; plan {row['plan']}",
              flush=True)
    return rows


def main(argv=None) -> int:
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default="generated/moe-models")
    ap.add_argument("--problem", default="qwen3-30b-a3b", help="layer problem(s) of the bundle, comma-separated "
                    "(the hang test takes the first)")
    ap.add_argument("--m", type=ints, default=[1, 2, 8], help="token counts of the hang test's calls")
    ap.add_argument("--m-cost", type=ints, default=[1, 8, 64, 1024, 4096])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--graphs", action="store_true", help="the hang test replays CUDA graphs of the layer calls")
    ap.add_argument("--skip", choices=["hang", "cost"])
    ap.add_argument("--json")
    ap.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    result = dict(gpu=torch.cuda.get_device_name(), problem=args.problem)
    if args.skip != "hang":
        result["hang"] = hang_test(args)
    if args.skip != "cost":
        result["cost"] = cost(args)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
