"""Layers whose kernels wait on each other (grid barriers, split-K turns) run on two streams at once without
hanging: the runtime launches them as cooperative grids (benchmarks/concurrent_barriers.py; with plain
launches the same load hung on an H100 after 130 rounds).  Run in a child process: a hang fails the test
by its timeout instead of stopping the session."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.gpu


def _probe(bundle, trials: int, *extra: str, timeout: float) -> None:
    """The probe's child in the runtime's default mode (cooperative grids once streams are reserved) on
    tiny-fused-silu at M 1, 2, 8, 64: it must finish `trials` rounds and match the one-stream results."""
    cmd = [sys.executable, "-m", "benchmarks.concurrent_barriers", "--child", "default", "--bundle", str(bundle),
           "--problem", "tiny-fused-silu", "--m", "1,2,8,64", "--trials", str(trials), "--calls", "4", *extra]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"two streams of grid-barrier layers hung ({' '.join(extra) or 'eager'}): {exc.stdout!r}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip().endswith(f"default: done {trials} rounds")


def test_layers_on_two_streams_at_once_do_not_hang(fused_bundle_dir):
    _probe(fused_bundle_dir, 200, timeout=90)


def test_graphs_of_layers_replayed_on_two_streams_do_not_hang(fused_bundle_dir):
    """CUDA graphs of the layer captured on each stream after reserve() (a graph keeps the launch attributes in
    effect at capture), replayed on both streams as an engine with two overlapped batches does: no hang, and
    each stream's outputs (poisoned after capture) equal the one-stream result.  With plain launches the
    same replay hung on an H100 after 360 and 520 rounds (two runs); cooperative ones finished 1000."""
    _probe(fused_bundle_dir, 1000, "--graphs", timeout=100)
