"""The build refuses a wgmma kernel that ptxas serialized (codegen/resources.wgmma_serialized): the PTX keeps
groups in flight, the SASS waits for each one as soon as it is issued, and the loop would run one MMA at a time."""

from __future__ import annotations

import pytest

from cuteaot.codegen import resources
from cuteaot.runtime.errors import BuildError
from tests.conftest import ROOT

PIPELINED_PTX = "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 ...;\nwgmma.wait_group.sync.aligned 2;\n"


def test_serialized_means_groups_kept_in_flight_by_the_ptx_but_by_no_sass_wait(monkeypatch):
    sass = {"pipelined": "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR16], R24, gsb0 ;\n"
                         "WARPGROUP.DEPBAR.LE gsb0, 0x2 ;\nWARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
            "serialized": "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR16], R24, gsb0 ;\nWARPGROUP.DEPBAR.LE gsb0, 0x0 ;"}
    monkeypatch.setattr(resources, "read_sass", lambda cubin: sass[cubin.decode()])
    assert not resources.wgmma_serialized(PIPELINED_PTX, b"pipelined")
    assert resources.wgmma_serialized(PIPELINED_PTX, b"serialized")
    # a kernel that drains after every group (wait_group 0 only) asks for nothing in flight: no SASS is read
    assert not resources.wgmma_serialized("wgmma.wait_group.sync.aligned 0;", b"not read")
    assert not resources.wgmma_serialized("mma.sync.aligned.m16n8k16 ...;", b"not read")


def test_a_kernel_ptxas_serialized_is_refused_when_compiled(monkeypatch):
    pytest.importorskip("cutlass", reason="compiling needs CuTeDSL (cuteaot[codegen])")
    from cuteaot.codegen.compile import compile_kernel
    from cuteaot.codegen.kernels.w4a16 import wgmma
    from cuteaot.codegen.spec import load_spec
    from cuteaot.runtime.devices import PROFILES
    from cuteaot.runtime.types import DType

    problem = next(p for p in load_spec(ROOT / "specs" / "tiny-gemm.yaml").moe if p.name == "tiny-gemm-silu")
    spec = problem.gemm_specs(4096, DType.BF16, PROFILES["h200"])["fc2_gemm"]
    assert spec.mainloop.value == "wgmma"
    # three groups in flight (four fragment sets live across the MMAs): ptxas 13 serializes every wgmma
    monkeypatch.setattr(wgmma, "GROUPS_IN_FLIGHT", 3)
    with pytest.raises(BuildError, match="ptxas serialized the kernel's wgmma"):
        compile_kernel(spec.key(), "sm_90a")
