"""PTX `.entry` parsing and the ABI check against declared signatures."""

from __future__ import annotations

import pytest

from cuteaot.codegen.ptx import check_abi, parse_entry
from cuteaot.runtime.abi import ArgBuffer, Param, ParamKind, Signature
from cuteaot.runtime.errors import AbiMismatchError, BuildError
from cuteaot.runtime.kernels import ActivationSpec, TopKSumSpec

PTX = """
.visible .entry k_0(
\t.param .u64 .ptr .global .align 16 k_0_param_0,
\t.param .align 8 .b8 k_0_param_1[8],
\t.param .u32 k_0_param_2
)
.reqntid 128, 1, 1
.minnctapersm 2
{
\tret;
}
"""


def test_parse_entry():
    e = parse_entry(PTX, "k_0")
    assert [(p.size, p.align) for p in e.params] == [(8, 8), (8, 8), (4, 4)]
    assert e.reqntid == (128, 1, 1) and e.minnctapersm == 2 and e.maxntid is None
    with pytest.raises(BuildError):
        parse_entry(PTX, "other")


def test_abi_check_accepts_matching_signature():
    sig = Signature((Param("a", ParamKind.PTR, ""), Param("b", ParamKind.PTR, ""), Param("n", ParamKind.I32, "")))
    check_abi(parse_entry(PTX, "k_0"), sig, "test")


@pytest.mark.parametrize(
    "params, message",
    [
        ((ParamKind.PTR, ParamKind.PTR), "3 parameters in PTX, 2 declared"),
        ((ParamKind.PTR, ParamKind.I32, ParamKind.I32), "param 1 (p1): declared size 4"),
        ((ParamKind.PTR, ParamKind.PTR, ParamKind.PTR), "param 2 (p2): declared size 8"),
    ],
)
def test_abi_check_fails_on_wrong_declaration(params, message):
    sig = Signature(tuple(Param(f"p{i}", k, "") for i, k in enumerate(params)))
    with pytest.raises(AbiMismatchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_abi(parse_entry(PTX, "k_0"), sig, "test")


def test_arg_buffer_layout_follows_alignment():
    import ctypes

    sig = Signature((Param("n", ParamKind.I32, ""), Param("p", ParamKind.PTR, ""), Param("x", ParamKind.F32, "")))
    buf = ArgBuffer(sig)
    address = buf.set(7, 0x1234_5678_9ABC, 0.5)
    ptrs = (ctypes.c_void_p * 3).from_address(address)
    assert ctypes.c_int32.from_address(ptrs[0]).value == 7
    assert ptrs[1] % 8 == 0 and ctypes.c_uint64.from_address(ptrs[1]).value == 0x1234_5678_9ABC
    assert ctypes.c_float.from_address(ptrs[2]).value == 0.5


@pytest.mark.build
def test_real_kernels_match_declarations_and_use_16_byte_access():
    """Compile real kernels (no GPU) and check what the manifest will claim about them."""
    cute = pytest.importorskip("cutlass.cute", reason="needs CuTeDSL (cuteaot[codegen])")

    from cuteaot.codegen.compile import BUILDERS, compile_kernel

    for spec in (ActivationSpec.create("swigluoai", "bf16", 136), TopKSumSpec("fp16", 6, 384)):
        compiled = compile_kernel(spec.key(), "sm_90a")
        assert compiled.record["block"] == [256, 1, 1] and compiled.record["stack_bytes"] == 0
        assert compiled.cubin[:4] == b"\x7fELF"
        obj, args = BUILDERS[spec.FAMILY](spec)
        ptx = cute.compile(obj, *args, options="--gpu-arch sm_90a --keep-ptx --dump-dir /tmp").artifacts.PTX
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx
        entry = parse_entry(ptx, compiled.record["symbol"])
        wrong = Signature(spec.SIGNATURE.params[:2] + (Param("rows", ParamKind.PTR, ""),))
        with pytest.raises(AbiMismatchError):
            check_abi(entry, wrong, "deliberately wrong")


@pytest.mark.build
def test_bounds_checked_kernels_take_and_read_the_expert_count():
    """Kernels that read expert ids from routes declare the bound they check them against, and use it.

    The direct-route GEMM and the fused decode kernel read raw topk_ids; the masked top-k sum reads
    them to skip dropped routes.  Each must match its declared signature (compile_kernel checks the
    PTX .entry) and actually load its last parameter, the expert count.
    """
    cute = pytest.importorskip("cutlass.cute", reason="needs CuTeDSL (cuteaot[codegen])")
    import re

    from cuteaot.codegen.compile import BUILDERS
    from cuteaot.runtime.devices import PROFILES
    from cuteaot.runtime.fused_planning import plan_fused
    from cuteaot.runtime.kernels.fused_spec import FusedSpec
    from cuteaot.runtime.kernels.gemm import gemm_spec_for, plan_for
    from cuteaot.runtime.kernels.gemm_spec import Routes

    h200 = PROFILES["h200"]
    gemm = gemm_spec_for(plan_for(1, 1024, 512, 2, 8, h200), "bf16", 1024, 512, 2, a_per_route=False,
                         mul_topk_weights=False, epilogue="none")
    fused = FusedSpec.for_plan(plan_fused(1, 512, 256, 16, 4, True, h200), "bf16", 512, 256, 16, 4, "silu")
    assert gemm.routes is Routes.DIRECT and fused.decode
    for spec in (gemm, fused, TopKSumSpec("bf16", 4, 512, "int64")):
        assert spec.SIGNATURE.params[-1].name == "num_experts"
        obj, args = BUILDERS[spec.FAMILY](spec)
        compiled = cute.compile(obj, *args, options="--gpu-arch sm_90a --keep-ptx --dump-dir /tmp")
        (symbol,) = list(compiled.kernel_info)
        ptx = compiled.artifacts.PTX
        check_abi(parse_entry(ptx, symbol), spec.SIGNATURE, spec.FAMILY)
        last = len(spec.SIGNATURE.params) - 1
        assert re.search(rf"ld\.param\.\w+\s+%\w+, \[{re.escape(symbol)}_param_{last}\]", ptx), (
            f"{spec.FAMILY}: the expert count is declared but never read"
        )
    # the masked sum compares int64 ids with the sign-extended count at 64 bits (a 32-bit compare
    # would let 2^32 + 3 through as expert 3)
    count = re.search(rf"ld\.param\.\w+\s+(%r\d+), \[{re.escape(symbol)}_param_{last}\]", ptx)[1]
    wide = re.search(rf"cvt\.s64\.s32\s+(%rd\d+), {count};", ptx)[1]
    assert re.search(rf"setp\.\w+\.s64\s+%p\d+, %rd\d+, {wide};", ptx)
