"""Tensor- and expert-parallel MoE on two H200s (one process per GPU, NCCL).

Bundle: specs/parallel.yaml (CUTEAOT_PARALLEL_BUNDLE to override).  For Qwen3-30B-A3B and
gpt-oss-120b shapes at M in {1, 8, 64, 1024}, TP=2 and EP=2 outputs (local fused layer +
all-reduce) must equal the single-GPU layer with the full weights within bf16 tolerance, and a
CUDA graph captured per rank must replay what eager computed.  Skipped with fewer than 2 GPUs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs of one host")
def test_tp2_and_ep2_equal_one_gpu():
    from benchmarks.parallel import run

    path = Path(os.environ.get("CUTEAOT_PARALLEL_BUNDLE", ROOT / "generated" / "parallel"))
    if not (path / "manifest.json").is_file():
        pytest.fail(f"{path} is not built: run `cuteaot build specs/parallel.yaml` first")
    rows = run(str(path), 2, timing=False, watchdog=420)
    assert len(rows) == 2 * 2 * 4
    for r in rows:
        what = f"{r['model']} M={r['M']} rank {r['rank']}"
        assert r["tp2_rel_err"] <= 1e-2, f"{what}: TP=2 rel err {r['tp2_rel_err']:.2e}"
        assert r["ep2_rel_err"] <= 1e-2, f"{what}: EP=2 rel err {r['ep2_rel_err']:.2e}"
        assert r["tp2_graph_vs_eager"] <= 5e-3 and r["ep2_graph_vs_eager"] <= 5e-3, what
    print("\nworst TP=2 / EP=2 rel err vs one GPU:", max(r["tp2_rel_err"] for r in rows),
          max(r["ep2_rel_err"] for r in rows))
