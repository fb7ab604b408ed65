"""The GEMM tiles' ablation switch (codegen/kernels/w4a16/ablate.py; benchmarks/scripts/ablate_tile.sh): off in
the tree, named consistently by the study script, and each part really taken out of both main loops; the tile
trace (benchmarks/tile_trace.py) off in the tree too."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT

SWITCH_SOURCE = ROOT / "codegen" / "kernels" / "w4a16" / "ablate.py"
SCRIPT = ROOT / "benchmarks" / "scripts" / "ablate_tile.sh"
SHIPPED_LINE = "ABLATE: frozenset[str] = frozenset()"


def test_ablate_is_off_in_the_tree_and_the_script_names_known_parts():
    source = SWITCH_SOURCE.read_text()
    assert SHIPPED_LINE in source.splitlines(), "a served bundle must never take a part of the tile out"
    script = SCRIPT.read_text()
    # the script builds through set_ablate.py, which starts only from the shipped line and rewrites exactly that line
    assert "benchmarks/scripts/set_ablate.py \"$parts\" --" in script
    set_ablate = _set_ablate()
    assert set_ablate.SOURCE == SWITCH_SOURCE and set_ablate.SHIPPED == SHIPPED_LINE + "\n"
    default = re.search(r'PARTS=\$\{PARTS:-"([^"]+)"\}', script)
    assert default is not None
    from cuteaot.codegen.kernels.w4a16 import ablate  # no CuTeDSL: the switch module imports nothing

    assert ablate.ABLATE == frozenset() and ablate.active() == frozenset()
    assert "TRACE = False" in source.splitlines() and ablate.TRACE is False  # no tile records in a served bundle
    for parts in default[1].split():
        assert parts == "none" or set(parts.split("+")) <= ablate.PARTS, parts


def _set_ablate():
    import importlib.util

    spec = importlib.util.spec_from_file_location("set_ablate", ROOT / "benchmarks" / "scripts" / "set_ablate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_set_ablate_runs_the_command_with_the_parts_and_restores_the_source(tmp_path, monkeypatch):
    set_ablate = _set_ablate()
    source = tmp_path / "ablate.py"
    shipped = f"x = 1\n{SHIPPED_LINE}\ny = 2\n"
    source.write_text(shipped)
    monkeypatch.setattr(set_ablate, "SOURCE", source)
    seen = tmp_path / "seen"
    copy = ["python3", "-c", f"import shutil; shutil.copy({str(source)!r}, {str(seen)!r})"]
    assert set_ablate.main(["copy+fence", "--", *copy]) == 0
    assert "ABLATE: frozenset[str] = frozenset({'copy', 'fence'})" in seen.read_text().splitlines()
    assert source.read_text() == shipped
    assert set_ablate.main(["none", "--", *copy]) == 0 and seen.read_text() == shipped
    assert set_ablate.main(["decode", "--", "python3", "-c", "raise SystemExit(3)"]) == 3  # the command's status
    assert source.read_text() == shipped  # back after a failing command too
    source.write_text(shipped.replace(SHIPPED_LINE, "ABLATE: frozenset[str] = frozenset({'copy'})"))
    with pytest.raises(SystemExit, match="shipped empty set"):  # never from a source with parts already out
        set_ablate.main(["fence", "--", "true"])
    with pytest.raises(SystemExit):
        set_ablate.main(["fence", "true"])


def _sass_ops(cubin: bytes) -> dict[str, int]:
    from cuteaot.codegen.resources import read_sass

    ops: dict[str, int] = {}
    for m in re.finditer(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", read_sass(cubin)):
        ops[m[1]] = ops.get(m[1], 0) + 1
    return ops


@pytest.mark.parametrize("tokens, mma", [(4096, "HGMMA"), (16, "HMMA")], ids=["wgmma", "mma_sync"])
def test_each_part_taken_out_leaves_its_instructions_out(monkeypatch, tokens, mma):
    pytest.importorskip("cutlass", reason="compiling needs CuTeDSL (cuteaot[codegen])")
    from cuteaot.codegen.compile import compile_kernel
    from cuteaot.codegen.kernels.w4a16 import ablate
    from cuteaot.codegen.kernels.w4a16.wgmma import gemm_kernel
    from cuteaot.codegen.spec import load_spec
    from cuteaot.runtime.devices import PROFILES
    from cuteaot.runtime.types import DType

    problem = next(p for p in load_spec(ROOT / "specs" / "tiny-gemm.yaml").moe if p.name == "tiny-gemm-silu")
    spec = problem.gemm_specs(tokens, DType.BF16, PROFILES["h200"])["fc2_gemm"]
    assert spec.mainloop.value == ("wgmma" if mma == "HGMMA" else "mma_sync")
    monkeypatch.setattr(ablate, "ABLATE", frozenset({"everything"}))
    with pytest.raises(AssertionError, match="unknown parts"):
        gemm_kernel(spec)
    ops = {}
    sets = (frozenset(), ablate.PARTS) + ((frozenset({"fence"}),) if mma == "HGMMA" else ())
    for parts in sets:
        monkeypatch.setattr(ablate, "ABLATE", parts)
        ops[parts] = _sass_ops(compile_kernel(spec.key(), "sm_90a").cubin)
    full, bare = ops[frozenset()], ops[ablate.PARTS]
    assert full["LDGSTS"] > 0 and full["HMUL2"] > 0 and full["BAR"] > bare.get("BAR", 0)
    assert "LDGSTS" not in bare and "HMUL2" not in bare  # copy, decode
    assert bare["STG"] < full["STG"] and "STSM" not in bare  # epilogue (split-K partials are still stored)
    assert bare[mma] == full[mma]  # the MMAs stay
    if mma == "HGMMA":  # fence alone: the wgmma loop's proxy fences go, its waits and barriers stay
        fenceless = ops[frozenset({"fence"})]
        assert full["FENCE"] > fenceless.get("FENCE", 0) and fenceless["BAR"] == full["BAR"]
        assert fenceless["LDGSTS"] == full["LDGSTS"] and fenceless[mma] == full[mma]
