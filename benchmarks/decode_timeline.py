"""Where a decode layer call's time goes, read from the fused kernel's own clocks (issue 14).

Build a bundle whose fused kernels record their timeline (`codegen/kernels/w4a16/fused.py`, TIMELINE: read
while compiling, so it is set in the source for that one build), then run this on the GPU:

    sed -i 's/^TIMELINE = False$/TIMELINE = True/' codegen/kernels/w4a16/fused.py
    python -m cuteaot.codegen.cli build specs/bench-decode.yaml --out generated/timeline --targets h200
    git checkout codegen/kernels/w4a16/fused.py
    python -m benchmarks.decode_timeline --bundle generated/timeline/bench-decode --m 1,2

For every layer of the bundle and M whose plan is decode with whole tiles (their c_tmp is free for the records),
each rep runs (L2 flush, zero the records, call) eagerly and reads every CTA's record: %globaltimer (ns, one
clock for all SMs) and %clock64 (this SM's cycles) at entry (0), after the prior-grid wait (1), FC1's tile
with its routes read (2), its first stage in shared memory (3), its main loop done (4), stored (5), after the
grid barrier (6), the same four for FC2's tile (7-10) and exit (11), and the SM it ran on (slot 12: %smid).
Printed per layer and M: where the CTAs ran (how many SMs hold the CTAs with an FC1 / FC2 tile, at most how
many of them one SM holds), each event's
time after the earliest CTA's entry (median over reps of the median and the max over CTAs), the SM clock the
two timers give, and the layer's graph-replayed time (`FlushedTimer`, as every layer benchmark) beside the
kernel's span, whose difference is the launch.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.common import FlushedTimer, comma_list, uniform_routing
from benchmarks.compare_layer import random_layers

EVENTS = ("entry", "waited", "fc1 routes", "fc1 stage0", "fc1 loop", "fc1 stored", "barrier", "fc2 routes",
          "fc2 stage0", "fc2 loop", "fc2 stored", "exit")
RECORD_WORDS = 32  # int64 words a CTA's record spans (256 bytes: 16 slots of two clocks)
SM_SLOT = 12  # codegen/kernels/w4a16/fused.SM_SLOT: (%smid, %nsmid)


def _records(layer, grid: int) -> torch.Tensor:
    """(grid, 16, 2) int64 view of the records in the layer's workspace (c_tmp)."""
    c_tmp = layer.workspace().c_tmp
    return c_tmp.view(torch.int64)[: grid * RECORD_WORDS].view(grid, 16, 2)


def _placement(r: torch.Tensor) -> dict:
    """Per phase (every CTA; those that ran an FC1 tile; an FC2 tile): CTAs, distinct SMs, the most on one SM;
    and the SM of the grid's first 8 CTAs."""
    sm = r[:, SM_SLOT, 0]
    out = {"sms_total": int(r[0, SM_SLOT, 1]), "first_ctas_sm": sm[:8].tolist()}
    for phase, mask in (("all", torch.ones_like(sm, dtype=torch.bool)), ("fc1", r[:, 4, 0] != 0),
                        ("fc2", r[:, 9, 0] != 0)):
        counts = torch.bincount(sm[mask]) if mask.any() else torch.zeros(1, dtype=torch.int64)
        out[phase] = {"ctas": int(mask.sum()), "sms": int((counts > 0).sum()), "max_per_sm": int(counts.max())}
    return out


def timeline(layer, m: int, x, w, ids, flush, reps: int) -> dict:
    resolved = layer.resolve(m)
    grid = resolved.launch.grid_x
    out = torch.empty_like(x)
    per_event = {e: {"median": [], "max": [], "ctas": []} for e in EVENTS}
    clocks, placement = [], []
    for _ in range(reps):
        flush()
        records = _records(layer, grid)
        records.zero_()
        layer(x, w, ids, out=out)
        torch.cuda.synchronize()
        r = records.cpu()
        start = int(r[:, 0, 0].min())
        for i, name in enumerate(EVENTS):
            seen = r[:, i, 0] != 0  # CTAs without a tile in a phase record nothing for it
            t = (r[seen, i, 0] - start).double() / 1e3
            per_event[name]["ctas"].append(int(seen.sum()))
            per_event[name]["median"].append(float(t.median()) if len(t) else float("nan"))
            per_event[name]["max"].append(float(t.max()) if len(t) else float("nan"))
        placement.append(_placement(r))
        span = (r[:, 11, 0] - r[:, 0, 0]).double()
        ok = span > 0
        clocks.append(float(((r[ok, 11, 1] - r[ok, 0, 1]).double() / span[ok]).median()))  # cycles per ns
    return {"grid": grid, "plan": resolved.describe(), "sm_ghz": statistics.median(clocks), "placement": placement[0],
            "placement_repeats": all(p == placement[0] for p in placement),
            "events": {e: {k: statistics.median(v[k]) for k in ("median", "max", "ctas")}
                       for e, v in per_event.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--models", type=comma_list(), default=None)
    ap.add_argument("--m", type=comma_list(int), default=[1, 2])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from cuteaot.runtime import load_bundle

    bundle = load_bundle(args.bundle)
    timer = FlushedTimer()
    rows = []
    for name, f, layer, g in random_layers(bundle, args.models):
        for m in args.m:
            resolved = layer.resolve(m)
            spec = resolved.kernels.get("fused")
            if not (resolved.decode and spec is not None and spec.spec.whole_tiles_m8):
                print(f"{name} M={m}: {resolved.describe()} (no whole-tile decode plan: skipped)")
                continue
            x, w, ids = uniform_routing(m, f["hidden_size"], f["num_experts"], f["top_k"], g)
            row = timeline(layer, m, x, w, ids, timer.flush, args.reps)
            out = torch.empty_like(x)
            row.update(model=name, M=m, layer_us=timer.us({"layer": lambda: layer(x, w, ids, out=out)}, 3)["layer"])
            rows.append(row)
            ev = row["events"]
            print(f"\n{name} M={m}  {row['plan']}  grid {row['grid']}  SM {row['sm_ghz']:.2f} GHz  "
                  f"layer (graph) {row['layer_us']:.1f} us  kernel span (max exit) {ev['exit']['max']:.1f} us")
            pl = row["placement"]
            print("placement" + ("" if row["placement_repeats"] else " (first rep; it changed between reps)") + ": "
                  + ", ".join(f"{k} {pl[k]['ctas']} CTAs on {pl[k]['sms']} SMs (at most {pl[k]['max_per_sm']} an SM)"
                              for k in ("all", "fc1", "fc2")) + f"; CTAs 0-7 on SMs {pl['first_ctas_sm']}")
            print("| event | CTAs | median us | max us |\n| --- | ---: | ---: | ---: |")
            for e in EVENTS:
                print(f"| {e} | {ev[e]['ctas']} | {ev[e]['median']:.2f} | {ev[e]['max']:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
