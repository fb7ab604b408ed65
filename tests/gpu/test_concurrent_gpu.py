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


def test_layers_on_two_streams_at_once_do_not_hang(fused_bundle_dir):
    bundle = fused_bundle_dir
    cmd = [sys.executable, "-m", "benchmarks.concurrent_barriers", "--child", "default", "--bundle", str(bundle),
           "--problem", "tiny-fused-silu", "--m", "1,2,8,64", "--trials", "200", "--calls", "4"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"two streams of grid-barrier layers hung: {exc.stdout!r}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip().endswith("default: done 200 rounds")


def test_graphs_of_layers_replayed_on_two_streams_do_not_hang(fused_bundle_dir):
    """CUDA graphs of the layer captured on each stream after reserve() (a graph keeps the launch attributes in
    effect at capture), replayed on both streams as an engine with two overlapped batches does: no hang, and
    each stream's outputs (poisoned after capture) equal the one-stream result.  With plain launches the
    same replay hung on an H100 after 360 and 520 rounds (two runs); cooperative ones finished 1000."""
    cmd = [sys.executable, "-m", "benchmarks.concurrent_barriers", "--child", "default", "--bundle",
           str(fused_bundle_dir), "--problem", "tiny-fused-silu", "--m", "1,2,8,64", "--trials", "1000", "--calls", "4",
           "--graphs"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"two streams of graph-replayed grid-barrier layers hung: {exc.stdout!r}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip().endswith("default: done 1000 rounds")
