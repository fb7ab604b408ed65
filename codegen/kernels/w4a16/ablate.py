"""Measurement switch of the W4A16 GEMM tiles (benchmarks/scripts/ablate_tile.sh, issues 13 and 14).

Parts of the tile taken out of both main loops (mma.sync, mainloop.py; warpgroup MMA, wgmma.py), to time in
place what each one costs the layer:

    copy      the stages are never filled from global memory (their copy groups are still committed)
    sync      a stage is used without waiting for its copies or for the CTA barrier
    fence     the warpgroup-MMA loop waits and syncs as shipped but leaves out the proxy fence that hands a stage to
              the tensor cores (what that fence costs; `sync` takes it out with the wait and barrier)
    decode    no weight or scale words are loaded from shared memory; the weight fragments are constants
              (packed and NF3 layouts; the stored layout keeps its decode)
    epilogue  no output is staged or stored; the accumulators feed one never-taken store, so no MMA is dead

Any part out makes the outputs wrong.  Read while compiling and not a key fact: set it only to build a
separate bundle for that study, never a served one (tests/test_ablate.py checks that it is empty here).

TRACE (benchmarks/tile_trace.py) leaves the tiles whole and records when each part of every warpgroup-MMA tile
runs: thread 0 of a CTA stores (%smid, %nsmid) and then (%globaltimer, %clock64) at the tile's start, once its
routes are staged (the main loop's prologue follows), after the main loop and after the store, into record
n (its n-th scheduled tile) of its CTA in c_tmp from TRACE_OFFSET on.  Launches whose tiles multiply by the
router weight (FC2, or FC1 where the layer applies it to the input) write the second half of the records.  The
benchmark gives the layer a c_tmp that large; like ABLATE, off in the tree (the test checks it).
"""

from __future__ import annotations

ABLATE: frozenset[str] = frozenset()
PARTS = frozenset({"copy", "sync", "fence", "decode", "epilogue"})
TRACE = False
TRACE_OFFSET = 64 << 20  # bytes into c_tmp: past the split-K partials of any traced launch
TRACE_CTAS = 1024  # CTA records a phase
TRACE_TILES = 128  # tile records a CTA (later tiles are not recorded)
TRACE_SLOTS = 5  # 16-byte slots a tile record: (smid, nsmid), then (globaltimer, clock64) at the four points
CONSTANT_FRAGMENT = 0x3C003C00  # "decode": every weight register of both loops holds the bf16 pair (2^-7, 2^-7)


def active() -> frozenset[str]:
    """The parts taken out of the tiles compiled now (empty for every served bundle)."""
    assert ABLATE <= PARTS, f"ABLATE: unknown parts {sorted(ABLATE - PARTS)}"
    return ABLATE
