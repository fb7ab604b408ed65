"""When do the two CTAs of an SM run their main loops?  Large-M GEMM tiles read from their own clocks (issue 13).

The warpgroup-MMA tiles run one warpgroup a CTA, two CTAs an SM.  A tile is a prologue (routes read and staged),
the main loop (first stages copied, then the MMAs) and an epilogue (stores); the tensor cores idle wherever
neither CTA of the SM is in its main loop.  A bundle built with `codegen/kernels/w4a16/ablate.py` TRACE records
four clocks per tile (read while compiling, so it is set in the source for that one build):

    sed -i 's/^TRACE = False$/TRACE = True/' codegen/kernels/w4a16/ablate.py
    python benchmarks/scripts/splice_kernels.py generated/moe-models generated/trace-full \\
        --where mainloop="'wgmma'" moe_block_size=128 --patch generated/trace -j 2
    git checkout codegen/kernels/w4a16/ablate.py
    python -m benchmarks.tile_trace --bundle generated/trace-full/moe-models --models qwen3-30b-a3b --m 4096

(on the GPU machine, copy `generated/moe-models` and the patch over it, as for any spliced bundle).  The layer's
c_tmp is swapped for one that holds the records past `ablate.TRACE_OFFSET`; each rep flushes L2, zeroes them
and calls the layer eagerly.  Printed per launch (FC1 and FC2): its span and the SMs' clock, the
share of the SMs' time (each SM's clock64 from its first tile's start to its last tile's end) with 0, 1 and 2
CTAs in a main loop; each CTA's time in prologue, main loop, epilogue and between tiles; and how far apart the
two CTAs of an SM start the same tile number, as a share of the median tile (0: in lockstep, 0.5: alternating).
Outputs are those of the shipped kernels (the trace only adds thread 0's stores).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from benchmarks.common import FlushedTimer, comma_list, uniform_routing
from benchmarks.compare_layer import random_layers
from cuteaot.codegen.kernels.w4a16 import ablate  # the switch module imports nothing (no CuTeDSL)

PHASES = ("fc1", "fc2")


def record_phases(facts: dict) -> tuple[str, str]:
    """The GEMMs whose records fill the first and the second half: the second is the launch whose tiles multiply
    by the router weight (`ablate.TRACE`), FC2 unless the layer applies it to FC1's input."""
    return ("fc2", "fc1") if facts.get("router_weight_on_input") else PHASES


def _traced_workspace(layer, m: int) -> torch.Tensor:
    """Give the layer's workspace a c_tmp with room for the records; return the records' int64 view
    (phase, CTA, tile, slot, 2)."""
    ws = layer.workspace()
    used = layer.resolve(m).launch.sizes.get("c_tmp_floats", 0)  # what an m-token call's partials take
    assert used * 4 <= ablate.TRACE_OFFSET, "the split-K partials would reach the records"
    record_bytes = 2 * ablate.TRACE_CTAS * ablate.TRACE_TILES * 16 * ablate.TRACE_SLOTS
    floats = max(ws.c_tmp.numel(), (ablate.TRACE_OFFSET + record_bytes) // 4)
    c_tmp = torch.zeros(floats, dtype=torch.float32, device=ws.c_tmp.device)
    ws.c_tmp, ws.c_tmp_address = c_tmp, c_tmp.data_ptr()
    layer._prepared.clear()  # fused launches packed the old address
    return c_tmp[ablate.TRACE_OFFSET // 4:].view(torch.int64).view(
        2, ablate.TRACE_CTAS, ablate.TRACE_TILES, ablate.TRACE_SLOTS, 2)


def _levels(intervals: list[tuple[int, int]], start: int, stop: int) -> list[int]:
    """Time in [start, stop) during which 0, 1, 2 (or more) of `intervals` are open."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    out = [0, 0, 0]
    level, at = 0, start
    for t, step in events:
        out[min(level, 2)] += t - at
        level, at = level + step, t
    out[min(level, 2)] += stop - at
    return out


def analyse(r: torch.Tensor) -> dict:
    """One launch's records (CTA, tile, slot, 2) -> per-level shares, per-part shares, CTA offsets."""
    by_sm: dict[int, list[list[tuple[int, int, int, int]]]] = {}
    spans = []
    for records in r.tolist():
        recorded = [rec for rec in records if rec[1][1] != 0]
        if recorded:
            tiles = [tuple(slot[1] for slot in rec[1:]) for rec in recorded]
            by_sm.setdefault(recorded[0][0][0], []).append(tiles)
            # %globaltimer (ns, one clock for the GPU) and the SM's clock at the CTA's first start, last end
            spans.append((recorded[0][1][0], recorded[-1][4][0], recorded[0][1][1], recorded[-1][4][1]))
    if not by_sm:
        return {}
    levels = [0, 0, 0]
    parts = {"prologue": 0, "main loop": 0, "epilogue": 0, "between tiles": 0}
    offsets, tile_cycles, ctas_per_sm = [], [], []
    for ctas in by_sm.values():
        ctas_per_sm.append(len(ctas))
        start = min(t[0][0] for t in ctas)
        stop = max(t[-1][3] for t in ctas)
        for i, v in enumerate(_levels([(t[1], t[2]) for tiles in ctas for t in tiles], start, stop)):
            levels[i] += v
        for tiles in ctas:
            for j, (t0, t1, t2, t3) in enumerate(tiles):
                parts["prologue"] += t1 - t0
                parts["main loop"] += t2 - t1
                parts["epilogue"] += t3 - t2
                tile_cycles.append(t3 - t0)
                if j:
                    parts["between tiles"] += t0 - tiles[j - 1][3]
        if len(ctas) == 2:
            a, b = ctas
            offsets += [abs(a[j][1] - b[j][1]) for j in range(1, min(len(a), len(b)))]  # tile 0 starts together
    tile = statistics.median(tile_cycles)
    shares = sorted(o / tile for o in offsets)
    total = sum(parts.values())
    span = sum(levels)
    return {
        "span_us": (max(b for _, b, _, _ in spans) - min(a for a, _, _, _ in spans)) / 1e3,
        "sm_ghz": statistics.median((d - c) / (b - a) for a, b, c, d in spans if b > a),
        "sms": len(by_sm), "ctas_per_sm": sorted(set(ctas_per_sm)), "tiles": len(tile_cycles),
        "median_tile_cycles": tile,
        "sm_time_with_loops": {str(i): levels[i] / span for i in range(3)},
        "cta_time": {k: v / total for k, v in parts.items()},
        "offset_per_tile": statistics.median(shares) if shares else None,
        "offset_quartiles": (shares[len(shares) // 4], shares[3 * len(shares) // 4]) if shares else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--models", type=comma_list(), default=None)
    ap.add_argument("--m", type=comma_list(int), default=[4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from cuteaot.runtime import load_bundle

    bundle = load_bundle(args.bundle)
    flush = FlushedTimer().flush
    rows = []
    for name, f, layer, g in random_layers(bundle, args.models):
        for m in args.m:
            x, w, ids = uniform_routing(m, f["hidden_size"], f["num_experts"], f["top_k"], g)
            out = torch.empty_like(x)
            records = _traced_workspace(layer, m)  # before any call: a traced launch writes past a plain c_tmp
            layer(x, w, ids, out=out)
            reps = []
            for _ in range(args.reps):
                flush()
                records.zero_()
                layer(x, w, ids, out=out)
                torch.cuda.synchronize()
                r = records.cpu()
                reps.append({phase: analyse(r[i]) for i, phase in enumerate(record_phases(f))})
            row = {"model": name, "M": m, "plan": layer.resolve(m).describe(), "reps": reps}
            rows.append(row)
            print(f"\n{name} M={m}  {row['plan']}")
            for phase in PHASES:
                for i, rep in enumerate(reps):
                    a = rep[phase]
                    if not a:
                        continue
                    lv = a["sm_time_with_loops"]
                    ct = a["cta_time"]
                    print(f"  {phase} rep {i}: {a['span_us']:.1f} us from the first tile's start to the last's end, "
                          f"SMs at {a['sm_ghz']:.2f} GHz; {a['sms']} SMs x {a['ctas_per_sm']} CTAs, {a['tiles']} tiles, "
                          f"median tile {a['median_tile_cycles'] / 1e3:.1f} kcycles; SM time with 0 / 1 / 2 main "
                          f"loops {lv['0']:.3f} / {lv['1']:.3f} / {lv['2']:.3f}; CTA time prologue "
                          f"{ct['prologue']:.3f}, loop {ct['main loop']:.3f}, epilogue {ct['epilogue']:.3f}, "
                          f"between {ct['between tiles']:.3f}; start offset / tile median "
                          f"{a['offset_per_tile'] if a['offset_per_tile'] is None else round(a['offset_per_tile'], 3)}"
                          f" (quartiles {a['offset_quartiles']})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
