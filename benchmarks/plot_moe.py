"""Plot benchmarks/moe.py results: fused MoE layer latency vs M (log-log), one panel per model.

Lines: cuteaot MoeLayer, the bf16 torch._grouped_mm layer, the HBM/tensor-core roofline of the
NVFP4 layer (all from the JSON of one run); points: the humming-kernels W4A16 figures the
issue quotes (H200, graph replay; measured elsewhere, not in our run).

    python -m benchmarks.plot_moe moe.json docs/moe_latency.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# The reference figures (humming W4A16 NVFP4, FC1 + act + FC2 + combine, H200, graphs), us.
HUMMING = {
    "qwen3-30b-a3b": {1: 33.9, 8: 78.7, 64: 147.0, 4096: 834.0},
    "gpt-oss-120b": {1: 49.6, 8: 173.0, 64: 618.0, 4096: 3113.0},
}


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    models = list(dict.fromkeys(r["model"] for r in data["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in data["rows"] if r["model"] == model]
        ms = [r["M"] for r in rows]
        ax.plot(ms, [r["us"] for r in rows], "o-", label="cuteaot MoeLayer (NVFP4 W4A16, fused)")
        ax.plot(ms, [r["torch_bf16_us"] for r in rows], "s--", label="torch._grouped_mm layer (bf16 weights)")
        ax.plot(ms, [r["roofline_us"] for r in rows], "k:", label="roofline (HBM / tensor core)")
        if model in HUMMING:
            ref = HUMMING[model]
            ax.plot(list(ref), list(ref.values()), "x", ms=9, label="humming W4A16 (issue's figures)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens M")
        ax.set_ylabel("layer time, µs (CUDA-graph replay)")
        ax.set_title(model)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    hbm = data["hbm_Bps"] / 1e12
    fig.suptitle(f"Fused MoE layer on the H200 (HBM copy {hbm:.2f} TB/s measured), routing included")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
