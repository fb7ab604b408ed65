"""The intrinsic probe family: spec key, enumeration, and every probe compiled for sm_90a (no GPU)."""

from __future__ import annotations

import tempfile
import textwrap

import pytest

from cuteaot.codegen.enumerate import jobs
from cuteaot.codegen.spec import load_spec
from cuteaot.runtime import BadInputError, SpecError
from cuteaot.runtime.kernels import FAMILIES
from cuteaot.runtime.kernels.probe import LAYOUTS, Probe, ProbeSpec, ProbeUnit, probe_words
from tests.conftest import ROOT

PROBES_SPEC = ROOT / "specs" / "probes.yaml"

# The instruction each probe exists to test (PTX mnemonic prefix).
INSTRUCTION = {
    Probe.E2M1_BF16: "shr.b32", Probe.E2M1_F16: "shl.b32", Probe.S0E5M3_BF16: "mul.rn.bf16x2",
    Probe.S0E5M3_F16: "mul.rn.f16x2", Probe.E8M0_BF16: "min.u16x2", Probe.E8M0_F16: "max.u16x2",
    Probe.NF3_BF16: "prmt.b32", Probe.E2M1_CODES_BF16: "shl.b32", Probe.E2M1_CODES_F16: "shr.b32",
    Probe.E4M3_PAIR_BF16: "mul.rn.bf16x2", Probe.E4M3_PAIR_F16: "cvt.rn.f16x2.e4m3x2",
    Probe.MMA_BF16: "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    Probe.MMA_F16: "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    Probe.LDMATRIX_X4: "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
    Probe.LDMATRIX_X2: "ldmatrix.sync.aligned.m8n8.x2.shared.b16",
    Probe.MUL_BF16X2: "mul.rn.bf16x2", Probe.MUL_F16X2: "mul.rn.f16x2",
    Probe.PACK_F32: "cvt.rn.f16x2.f32", Probe.UNPACK_PAIRS: "cvt.f32.f16",
    Probe.RED_ADD_V4_BF16X2: "red.global.add.noftz.v4.bf16x2", Probe.RED_ADD_V4_F16X2: "red.global.add.noftz.v4.f16x2",
    Probe.RED_MAX_F32: "red.global.max.s32", Probe.ATOM_ADD_I32: "atom.global.add.s32",
    Probe.CP_ASYNC: "cp.async.cg.shared.global",
}


def test_every_probe_has_a_layout_and_a_registered_family():
    assert set(LAYOUTS) == set(Probe) == set(INSTRUCTION)
    assert FAMILIES[ProbeSpec.FAMILY] is ProbeSpec
    for probe in Probe:
        spec = ProbeSpec(probe.value)
        assert ProbeSpec.from_facts(dict(spec.key().facts)) == spec
    assert probe_words(Probe.MMA_BF16, 3) == (3 * 320, 3 * 128)
    assert probe_words(Probe.ATOM_ADD_I32, 10) == (20, 64 + 10)
    with pytest.raises(BadInputError, match="unknown probe"):
        ProbeSpec("nope")


def test_probes_spec_enumerates_every_probe_once():
    spec = load_spec(PROBES_SPEC)
    assert spec.probes and spec.moe == ()
    found = [(j.arch, j.key) for j in jobs(spec)]
    assert sorted(found, key=lambda t: t[1].canonical) == sorted(
        [("sm_90a", ProbeSpec(p).key()) for p in Probe], key=lambda t: t[1].canonical
    )


def _spec_error(tmp_path, text: str) -> SpecError:
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(text))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return info.value


def test_probes_key_is_validated(tmp_path):
    err = _spec_error(tmp_path, "bundle: p\ntargets: [h200]\nprobes: yes please\n")
    assert err.field == "probes" and err.line == 3 and "true or false" in str(err)
    err = _spec_error(tmp_path, "bundle: p\ntargets: [h200]\nprobes: false\n")
    assert "missing required key(s): moe" in str(err)
    err = _spec_error(tmp_path, "bundle: p\ntargets: [h200]\n")
    assert "missing required key(s): moe" in str(err)


@pytest.mark.build
def test_every_probe_compiles_for_sm90a():
    pytest.importorskip("cutlass", reason="compiling needs CuTeDSL (cuteaot[codegen])")
    import cutlass.cute as cute

    from cuteaot.codegen.compile import compile_kernel
    from cuteaot.codegen.kernels import probe as probe_codegen

    for probe in Probe:
        spec = ProbeSpec(probe)
        record = compile_kernel(spec.key(), "sm_90a").record
        assert record["block"] == [spec.layout.threads, 1, 1], probe
        assert record["dynamic_smem_bytes"] == spec.layout.smem_bytes, probe
        assert record["local_bytes"] == 0 and record["stack_bytes"] == 0, probe
        if spec.layout.unit is ProbeUnit.WARP:
            assert spec.layout.threads == 32
        obj, args = probe_codegen.build(spec)
        with tempfile.TemporaryDirectory() as dump:
            ptx = cute.compile(obj, *args, options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {dump}").artifacts.PTX
        assert INSTRUCTION[probe] in ptx, f"{probe.value}: {INSTRUCTION[probe]} not in its PTX"
