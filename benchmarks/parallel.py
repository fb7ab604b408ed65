"""Multi-GPU MoE (one process per GPU, NCCL): TP=W and EP=W against one GPU, checked and timed.

    python -m benchmarks.parallel [--world W] [--bundle generated/parallel] [--json out.json] [--check-only]

W defaults to every GPU of the host (at least 2); the bundle must hold the TP=W shards.

Every rank draws the same full NVFP4 weights (same seed, same GPU model) and the same inputs,
prepares its shard (runtime/parallel.py) and runs ParallelMoeLayer (local fused layer +
all-reduce).  Checks: the TP=W and EP=W outputs against the single-GPU layer with the full
weights (relative error), CUDA-graph replay against eager per rank.  Timing: median device
time per layer call of graph replays (benchmarks/common.py), all-reduce included; TP=1 is the
single-GPU layer on rank 0.  tests/gpu/test_parallel_gpu.py runs the check part.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

MODELS = {  # name: (hidden, intermediate, experts, top_k, activation)
    "qwen3-30b-a3b": (2048, 768, 128, 8, "silu"),
    "gpt-oss-120b": (2880, 2880, 128, 4, "swigluoai"),
}
MS = (1, 8, 64, 1024)


def worker(rank: int, world: int, init_file: str, bundle_path: str, out_file: str, timing: bool,
           models: list[str], ms: list[int], watchdog: float) -> None:
    import faulthandler

    import torch.distributed as dist

    if watchdog:  # a hung collective or kernel prints every thread's stack and ends the rank
        faulthandler.dump_traceback_later(watchdog, exit=True)

    def say(*what):
        print(f"[rank {rank}]", *what, flush=True)

    from benchmarks.common import device_us
    from cuteaot.runtime import load_bundle, prepare_w2, prepare_w13
    from cuteaot.runtime.moe import MoeLayer
    from cuteaot.runtime.parallel import ModelOptTensors, ParallelMoeLayer, ep_partition, ep_select, tp_shard_w2, tp_shard_w13
    from tests.reference.nvfp4 import random_nvfp4

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=device)
    say("process group up")
    bundle = load_bundle(bundle_path, device)
    results = []
    for model in models:
        h, i, e, k, act = MODELS[model]
        w13 = ModelOptTensors(*random_nvfp4(e, 2 * i, h, torch.Generator(device=device).manual_seed(1)))
        w2 = ModelOptTensors(*random_nvfp4(e, h, i, torch.Generator(device=device).manual_seed(2)))
        full = MoeLayer(bundle, prepare_w13(*w13, "bf16"), prepare_w2(*w2, "bf16"), top_k=k, activation=act)
        tp = ParallelMoeLayer(bundle, prepare_w13(*tp_shard_w13(w13, rank, world, activation=act), "bf16"),
                              prepare_w2(*tp_shard_w2(w2, rank, world), "bf16"), top_k=k, activation=act,
                              shard=(rank, world))
        expert_map, local = ep_partition(e, rank, world, device)
        ep = ParallelMoeLayer(bundle, prepare_w13(*ep_select(w13, local), "bf16"),
                              prepare_w2(*ep_select(w2, local), "bf16"), top_k=k, activation=act,
                              expert_map=expert_map, shard=(rank, world))
        del w13, w2
        say(model, "layers ready")
        for m in ms:
            g = torch.Generator(device=device).manual_seed(100 + m)
            x = torch.randn(m, h, generator=g, device=device).to(torch.bfloat16)
            ids = torch.rand(m, e, generator=g, device=device).topk(k, dim=1).indices.to(torch.int32)
            w = torch.softmax(torch.randn(m, k, generator=g, device=device), 1)
            ref = full(x, w, ids).float()
            row = {"model": model, "M": m, "rank": rank, "world": world}
            for name, layer in (("tp", tp), ("ep", ep)):
                say(model, m, name, "eager")
                out = layer(x, w, ids).clone()
                row[f"{name}_rel_err"] = float((out.float() - ref).norm() / ref.norm())
                # graph capture per rank: the local kernels and the NCCL all-reduce in one graph
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream())
                static = torch.empty_like(out)
                with torch.cuda.stream(stream):
                    layer(x, w, ids, out=static)
                torch.cuda.current_stream().wait_stream(stream)
                say(model, m, name, "capture")
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    layer(x, w, ids, out=static)
                static.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                row[f"{name}_graph_vs_eager"] = float((static.float() - out.float()).norm() / out.float().norm())
                if timing:
                    row[f"{name}_us"] = device_us(lambda layer=layer, o=static: layer(x, w, ids, out=o))
            if timing:
                tp1_out = torch.empty_like(x)
                row["tp1_us"] = device_us(lambda layer=full, o=tp1_out: layer(x, w, ids, out=o))
            results.append(row)
            dist.barrier()
        del full, tp, ep
        torch.cuda.empty_cache()
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump(results, f)
    torch.cuda.synchronize()
    say("done")
    # destroy_process_group() hangs on the H200 host while CUDA graphs that captured NCCL kernels
    # are still alive (seen with NCCL 2.28.9); the rank's work is finished and written, so leave.
    os._exit(0)


def run(bundle_path: str, world: int = 2, timing: bool = True, models=None, ms=MS, watchdog: float = 0) -> list[dict]:
    """Spawn `world` ranks; returns every rank's rows."""
    import torch.multiprocessing as mp

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "rows")
        mp.spawn(worker, args=(world, init_file, bundle_path, out_file, timing, list(models or MODELS), list(ms),
                               watchdog), nprocs=world, join=True)
        rows = []
        for rank in range(world):
            with open(f"{out_file}.{rank}") as f:
                rows += json.load(f)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="generated/parallel")
    ap.add_argument("--json")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ms", nargs="+", type=int, default=list(MS))
    ap.add_argument("--watchdog", type=float, default=0, help="seconds after which a rank dumps stacks and exits")
    ap.add_argument("--world", type=int, default=torch.cuda.device_count(), help="GPUs (default: all)")
    args = ap.parse_args()
    if not 2 <= args.world <= torch.cuda.device_count():
        sys.exit(f"needs 2 <= --world <= {torch.cuda.device_count()} GPUs, got {args.world}")
    w = args.world
    rows = run(args.bundle, w, not args.check_only, args.models, args.ms, args.watchdog)
    print(f"{'model':14s} {'M':>5s} {'TP1 us':>8s} {f'TP{w} us':>8s} {f'EP{w} us':>8s}  TP err    EP err    graph/eager")
    for r in (r for r in rows if r["rank"] == 0):
        print(f"{r['model']:14s} {r['M']:5d} {r.get('tp1_us', float('nan')):8.1f} {r.get('tp_us', float('nan')):8.1f} "
              f"{r.get('ep_us', float('nan')):8.1f}  {r['tp_rel_err']:.1e}   {r['ep_rel_err']:.1e}   "
              f"{max(r['tp_graph_vs_eager'], r['ep_graph_vs_eager']):.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
