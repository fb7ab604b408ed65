"""The shared layer-run helper of the GPU benchmarks (benchmarks/common.run_layers), on the CPU with stand-in
layers: poisoned outputs, the eager calls, the reference check (timing needs the GPU and is not run here); the
stall-sample summary of an Nsight source page (benchmarks/stall_regions) on a synthetic page."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks.common import run_layers, skewed_routing, uniform_routing
from benchmarks.compare_layer import _prepared, layer_dtype, random_layer_weights, reference_params
from benchmarks.stall_regions import main as stall_regions_main
from benchmarks.stall_regions import parse_span, read_page, span_shares
from cuteaot.runtime.types import SWIGLUOAI_DEFAULT_ALPHA, SWIGLUOAI_DEFAULT_BETA, SWIGLUOAI_DEFAULT_LIMIT


def _scaled(factor):
    def layer(x, weights, ids, *, out):
        out.copy_(x * factor)
    return layer


def _idle(x, weights, ids, *, out):  # writes nothing: its output stays poisoned
    pass


def test_run_layers_checks_each_output_against_its_reference():
    x = torch.randn(5, 8).to(torch.bfloat16)
    w, ids = torch.rand(5, 2), torch.zeros(5, 2, dtype=torch.int32)
    layers = {"right": _scaled(2.0), "wrong": _scaled(3.0), "idle": _idle}
    reference = lambda: x.float() * 2  # noqa: E731
    found, outs = run_layers(layers, x, w, ids, references={n: reference for n in layers})
    assert found["right"]["rel_err"] == 0.0
    assert abs(found["wrong"]["rel_err"] - 0.5) < 1e-2  # 3x in bf16 against 2x
    assert found["idle"]["rel_err"] is None and outs["idle"].isnan().all()  # NaN: not finite
    assert all("us" not in f for f in found.values())  # no timer, no timing


def test_run_layers_eager_without_references_and_nothing_by_default():
    x = torch.randn(3, 4).to(torch.bfloat16)
    w, ids = torch.rand(3, 1), torch.zeros(3, 1, dtype=torch.int32)
    found, outs = run_layers({"a": _scaled(1.0)}, x, w, ids, eager=True)
    assert found == {"a": {}} and torch.equal(outs["a"], x)
    _, outs = run_layers({"a": _scaled(1.0)}, x, w, ids)
    assert outs["a"].isnan().all()  # neither eager nor timed: the poisoned buffer


def test_compare_formats_checks_every_layer_at_check_m(capsys):
    """The model x M loop of the format comparisons, with stand-in layers on the CPU (no timing)."""
    from benchmarks.common import compare_formats

    class Plan:
        def describe(self):
            return "stand-in plan"

    class Layer:
        def __init__(self, factor):
            self.factor = factor

        def __call__(self, x, weights, ids, *, out):
            out.copy_(x * self.factor)

        def resolve(self, m):
            return Plan()

    def build(bundle, name, g):
        reference = lambda x, w, ids: x.float() * 2  # noqa: E731
        return (8, 4, 2), {"right": (Layer(2.0), reference, None), "wrong": (Layer(3.0), reference, None)}

    rows = compare_formats(None, ["a", "bb"], [], 5, 1, build, floors=False, device="cpu")
    assert [(r["model"], r["M"], r["impl"]) for r in rows] == [
        ("a", 5, "right"), ("a", 5, "wrong"), ("bb", 5, "right"), ("bb", 5, "wrong")]
    assert all(r["plan"] == "stand-in plan" and "us" not in r and "floor_us" not in r for r in rows)
    assert [r["rel_err"] == 0.0 for r in rows] == [True, False, True, False]
    assert "stand-in plan" in capsys.readouterr().out


@pytest.mark.parametrize("top_k", [2, 8])
def test_skewed_routing_crowds_five_experts_and_keeps_the_conventions(top_k):
    g = torch.Generator().manual_seed(3)
    x, w, ids = skewed_routing(1000, 16, 64, top_k, g)
    ux, uw, uids = uniform_routing(1000, 16, 64, top_k, torch.Generator().manual_seed(3))
    assert (x.shape, w.shape, ids.shape, ids.dtype) == (ux.shape, uw.shape, uids.shape, uids.dtype)
    assert all(len(set(row)) == top_k for row in ids.tolist())  # distinct experts per token
    counts = torch.bincount(ids.flatten().long(), minlength=64)
    rest = counts[5:]
    assert counts[0] > 700 and counts[:5].sum() > 0.75 * 1000 * min(5, top_k)  # the five crowded experts: most routes
    assert 0 < rest.max() < 100 and (rest > 0).sum() > 40  # the others get a few routes each, not none
    if top_k == 8:
        assert (counts[:5] > 900).all()  # nearly every token picks all five


def test_reference_params_fill_swigluoai_defaults_only():
    oai = reference_params({"activation": "swigluoai", "swiglu_limit": 5.0})
    assert oai == {"alpha": SWIGLUOAI_DEFAULT_ALPHA, "beta": SWIGLUOAI_DEFAULT_BETA, "limit": 5.0}
    assert SWIGLUOAI_DEFAULT_LIMIT != 5.0
    assert reference_params({"activation": "silu"}) == {"alpha": None, "beta": None, "limit": None}


@pytest.mark.parametrize("dtype, weights", [("fp16", "nvfp4"), ("fp16", "modelopt"), ("bf16", "nvfp4"),
                                            ("bf16", "nf3")])
def test_ab_and_check_tools_prepare_a_layer_in_its_own_dtype(dtype, weights):
    """compare_layer / check_layer build each problem's weights and inputs in the problem's dtype (an fp16
    problem prepared as bf16 is refused by the fp16 bundle's kernels)."""
    facts = {"hidden_size": 64, "intermediate_size": 64, "num_experts": 2, "activation": "silu", "dtype": dtype}
    q13, q2 = random_layer_weights(facts, torch.Generator().manual_seed(0), weights)
    w13, w2 = _prepared(facts, q13, q2, weights)
    assert w13.dtype.value == w2.dtype.value == dtype
    assert layer_dtype(facts) == w13.dtype.torch
    assert layer_dtype({"activation": "silu"}) == torch.bfloat16  # facts of bundles that predate the dtype fact


def test_build_variant_sets_planner_constants_before_the_build(monkeypatch):
    import importlib.util
    from pathlib import Path

    import pytest

    from cuteaot.codegen.kernels.w4a16 import planning

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "scripts" / "build_variant.py"
    spec = importlib.util.spec_from_file_location("build_variant", path)
    build_variant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_variant)
    monkeypatch.setattr(planning, "WGMMA_WIDE_MIN_ROUTES", planning.WGMMA_WIDE_MIN_ROUTES)  # restored after
    build_variant.apply(["planning.WGMMA_WIDE_MIN_ROUTES=999"])
    assert planning.WGMMA_WIDE_MIN_ROUTES == 999
    for bad, message in (("planning.NO_SUCH_CONSTANT=1", "has no constant"), ("planning.STAGES", "module.NAME=VALUE"),
                         ("planning.WGMMA_WIDE_MIN_ROUTES=routes", "must be a Python literal")):
        with pytest.raises(SystemExit, match=message):
            build_variant.apply([bad])
    # a variant's plan fingerprint differs from the plain build's (else a copy of that build reads up to date)
    build = importlib.import_module("cuteaot.codegen.build")

    plain = build.plan_fingerprint()
    monkeypatch.setattr(build, "plan_fingerprint", build.plan_fingerprint)  # restored after
    build_variant.fingerprint_with([])
    assert build.plan_fingerprint() == plain
    build_variant.fingerprint_with(["planning.WGMMA_WIDE_MIN_ROUTES=999"])
    assert build.plan_fingerprint() not in (plain, None)


def _source_page(path, rows):
    """An ncu source page CSV as `ncu --page source --csv` prints it: kernel line, header, one row a SASS line."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_wait", "stall_long_sb", "stall_barrier"]
    lines = ['"kernel"', ",".join(f'"{h}"' for h in header)]
    for i, (source, samples, executed, wait, long_sb, barrier) in enumerate(rows):
        lines.append(",".join(f'"{v}"' for v in (hex(16 * i), source, samples, executed, wait, long_sb, barrier)))
    path.write_text("\n".join(lines) + "\n")


def test_stall_spans_split_the_samples_into_named_ranges_and_the_rest(tmp_path):
    page = tmp_path / "page.csv"
    _source_page(page, [("LDG.E R1, [R2.64]", 40, 8, 10, 30, 0), ("BAR.SYNC 0x0", 10, 8, 0, 0, 10),
                        ("HGMMA.64x128x16.F32.BF16 R8, R4, gdesc[UR4], R8", 30, 64, 20, 0, 0),
                        ("EXIT", 20, 8, 5, 0, 0)])
    rows = read_page(str(page))
    spans = span_shares(rows, [parse_span("tile start=0-1"), parse_span("loop=2-2")])
    assert [(g["name"], round(g["share"], 6)) for g in spans] == [("tile start", 50.0), ("loop", 30.0), ("other", 20.0)]
    assert spans[0]["stalls"] == {"long_sb": 60.0, "wait": 20.0, "barrier": 20.0}  # % of the span's own samples
    assert spans[1]["stalls"] == {"wait": 100.0 * 20 / 30}
    with pytest.raises(ValueError, match="overlaps"):
        span_shares(rows, [parse_span("a=0-2"), parse_span("b=2-3")])
    for bad in ("0-1", "a=1", "a=2-1", "a=x-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_span(bad)
    summary = tmp_path / "summary.json"
    assert stall_regions_main([str(page), "--span", "tile start=0-1", "--json", str(summary)]) == 0
    assert [g["name"] for g in json.loads(summary.read_text())["spans"]] == ["tile start", "other"]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf3"])
def test_prepare_weights_times_both_projections_of_a_layer(fmt, monkeypatch):
    """benchmarks/prepare_weights.py packs W13 and W2 of the model's shape (here a small one) and reports
    their times and the inputs' bytes: NVFP4 codes + e4m3 scales + global scales, MXFP4 blocks + scales, or
    NF3 codes (a byte each) + scales + global scales."""
    from benchmarks import prepare_weights

    monkeypatch.setitem(prepare_weights.MODELS, "small", (128, 64, 3))
    row = prepare_weights.measure("small", fmt, "cpu", reps=1)
    assert row["w13_s"] > 0 and row["w2_s"] > 0 and row["peak_above_inputs_bytes"] >= 0
    weights = 3 * (2 * 64 * 128 + 128 * 64)
    codes = weights if fmt == "nf3" else weights // 2
    scales = weights // (16 if fmt == "nvfp4" else 32)
    global_scales = {"nvfp4": 3 * 4 * 3, "mxfp4": 0, "nf3": 3 * 4 * 2}[fmt]
    assert row["input_bytes"] == codes + scales + global_scales


def _imports_of(path):
    """(module, name, line) of every `from X import name` in a benchmark tool, function-level ones included."""
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            module = ("benchmarks." if node.level else "") + node.module
            if module.startswith(("benchmarks", "cuteaot", "tests")):
                for alias in node.names:
                    yield module, alias.name, node.lineno


def test_every_name_a_benchmark_tool_imports_from_the_project_exists():
    """The GPU tools import most of their helpers inside functions (they run on a machine without CuTeDSL), so a
    name removed from a sibling module surfaces only there, after a device call: wgmma_rate still imported
    peers.eager_us for ten sessions after it was removed.  Checked here statically, on every tool."""
    import importlib
    from pathlib import Path

    missing = []
    for path in sorted(Path(__file__).resolve().parents[1].joinpath("benchmarks").glob("*.py")):
        for module, name, line in _imports_of(path):
            if module.startswith("cuteaot.codegen") or name == "*":
                continue  # CuTeDSL modules import cutlass (there on the builder, not needed to check names)
            target = importlib.import_module(module)
            if not hasattr(target, name):
                try:  # a submodule imported by name
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"{path.name}:{line}: {module}.{name}")
    assert not missing, missing


def test_tile_trace_tells_lockstep_from_alternating_main_loops():
    from benchmarks.tile_trace import analyse, record_phases
    from cuteaot.codegen.kernels.w4a16 import ablate

    r = torch.zeros(ablate.TRACE_CTAS, ablate.TRACE_TILES, ablate.TRACE_SLOTS, 2, dtype=torch.int64)
    # tiles of 100 cycles (prologue 10, main loop 70, epilogue 20); SM 0's two CTAs together, SM 1's half a tile
    # apart
    for cta, offset in ((0, 0), (1, 0), (2, 0), (3, 50)):
        for i in range(10):
            t0 = 1000 + 100 * i + offset
            r[cta, i, 0, 0] = cta // 2
            for point, t in enumerate((t0, t0 + 10, t0 + 80, t0 + 100)):
                r[cta, i, point + 1] = torch.tensor([t, 2 * t])  # (ns, cycles): SMs at 2 GHz
    lockstep = analyse(r[:2])
    assert lockstep["sms"] == 1 and lockstep["tiles"] == 20 and lockstep["offset_per_tile"] == 0.0
    assert lockstep["sm_ghz"] == 2.0 and lockstep["span_us"] == 1.0 and lockstep["median_tile_cycles"] == 200
    assert lockstep["sm_time_with_loops"]["0"] == pytest.approx(0.3) and lockstep["sm_time_with_loops"]["1"] == 0
    assert lockstep["cta_time"] == {"prologue": 0.1, "main loop": 0.7, "epilogue": 0.2, "between tiles": 0.0}
    alternating = analyse(r[2:4])  # no main loop only before CTA 3's first and after CTA 3's last
    assert alternating["sm_time_with_loops"]["0"] == pytest.approx(30 / 1050) and alternating["offset_per_tile"] == 0.5
    r[3, 0] = 0  # a tile the CTA skipped (its expert out of range) has no record; the SM is read from the next
    assert analyse(r[2:4])["tiles"] == 19 and analyse(r[2:4])["sms"] == 1
    assert analyse(torch.zeros_like(r)) == {}
    # the second half of the records is the launch that multiplies by the router weight
    assert record_phases({"router_weight_on_input": False}) == ("fc1", "fc2")
    assert record_phases({"router_weight_on_input": True}) == ("fc2", "fc1")
