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
