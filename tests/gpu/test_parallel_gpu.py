"""Tensor- and expert-parallel MoE on W H200s of one host (one process per GPU, NCCL).

W = every GPU of the host, up to 4 (the TP shards specs/parallel.yaml builds).  Bundle:
specs/parallel.yaml (CUTEAOT_PARALLEL_BUNDLE to override).  For Qwen3-30B-A3B and gpt-oss-120b
shapes at M in {1, 8, 64, 1024}, TP=W and EP=W outputs (local fused layer + all-reduce) must
equal the single-GPU layer with the full weights within bf16 tolerance, and a CUDA graph
captured per rank must replay what eager computed.  Skipped with fewer than 2 GPUs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


MAX_WORLD = 4  # the largest TP shard count of specs/parallel.yaml


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs of one host")
def test_tp_and_ep_equal_one_gpu():
    from benchmarks.parallel import run

    path = Path(os.environ.get("CUTEAOT_PARALLEL_BUNDLE", ROOT / "generated" / "parallel"))
    if not (path / "manifest.json").is_file():
        pytest.fail(f"{path} is not built: run `cuteaot build specs/parallel.yaml` first")
    world = min(torch.cuda.device_count(), MAX_WORLD)
    rows = run(str(path), world, timing=False, watchdog=420)
    assert len(rows) == world * 2 * 4
    for r in rows:
        what = f"{r['model']} M={r['M']} rank {r['rank']} of {world}"
        assert r["tp_rel_err"] <= 1e-2, f"{what}: TP rel err {r['tp_rel_err']:.2e}"
        assert r["ep_rel_err"] <= 1e-2, f"{what}: EP rel err {r['ep_rel_err']:.2e}"
        assert r["tp_graph_vs_eager"] <= 5e-3 and r["ep_graph_vs_eager"] <= 5e-3, what
    print(f"\nworst TP={world} / EP={world} rel err vs one GPU:", max(r["tp_rel_err"] for r in rows),
          max(r["ep_rel_err"] for r in rows))
