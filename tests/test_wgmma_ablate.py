"""The wgmma tile's ablation switch (codegen/kernels/w4a16/wgmma.py, ABLATE; benchmarks/scripts/ablate_wgmma.sh):
off in the tree, named consistently by the study script, and each part really taken out when it is set."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT

WGMMA_SOURCE = ROOT / "codegen" / "kernels" / "w4a16" / "wgmma.py"
SCRIPT = ROOT / "benchmarks" / "scripts" / "ablate_wgmma.sh"
SHIPPED_LINE = "ABLATE: frozenset[str] = frozenset()"


def test_ablate_is_off_in_the_tree_and_the_script_names_known_parts():
    source = WGMMA_SOURCE.read_text()
    assert SHIPPED_LINE in source.splitlines(), "a served bundle must never take a part of the tile out"
    script = SCRIPT.read_text()
    # the script builds only from the shipped line and rewrites exactly that line
    assert f"SHIPPED='{SHIPPED_LINE}'" in script
    default = re.search(r'PARTS=\$\{PARTS:-"([^"]+)"\}', script)
    assert default is not None
    allowed = set(re.search(r"ABLATABLE = frozenset\(\{([^}]*)\}\)", source)[1].replace('"', "").replace(" ", "").split(","))
    for parts in default[1].split():
        assert parts == "none" or set(parts.split("+")) <= allowed, parts


def _sass_ops(cubin: bytes) -> dict[str, int]:
    from cuteaot.codegen.resources import read_sass

    ops: dict[str, int] = {}
    for m in re.finditer(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", read_sass(cubin)):
        ops[m[1]] = ops.get(m[1], 0) + 1
    return ops


def test_each_part_taken_out_leaves_its_instructions_out(monkeypatch):
    pytest.importorskip("cutlass", reason="compiling needs CuTeDSL (cuteaot[codegen])")
    from cuteaot.codegen.compile import compile_kernel
    from cuteaot.codegen.kernels.w4a16 import wgmma
    from cuteaot.codegen.spec import load_spec
    from cuteaot.runtime.devices import PROFILES
    from cuteaot.runtime.types import DType

    problem = next(p for p in load_spec(ROOT / "specs" / "tiny-gemm.yaml").moe if p.name == "tiny-gemm-silu")
    spec = problem.gemm_specs(4096, DType.BF16, PROFILES["h200"])["fc2_gemm"]
    assert spec.mainloop.value == "wgmma"
    monkeypatch.setattr(wgmma, "ABLATE", frozenset({"everything"}))
    with pytest.raises(AssertionError, match="unknown parts"):
        wgmma.gemm_kernel(spec)
    shipped = {}
    for parts in (frozenset(), wgmma.ABLATABLE):
        monkeypatch.setattr(wgmma, "ABLATE", parts)
        shipped[parts] = _sass_ops(compile_kernel(spec.key(), "sm_90a").cubin)
    full, bare = shipped[frozenset()], shipped[wgmma.ABLATABLE]
    assert full["LDGSTS"] > 0 and full["HMUL2"] > 0 and full["STSM"] > 0 and full["BAR"] > bare.get("BAR", 0)
    assert "LDGSTS" not in bare and "HMUL2" not in bare and "STSM" not in bare  # copy, decode, epilogue
    assert bare["HGMMA"] == full["HGMMA"]  # the MMAs stay
