"""The ABI declared once: PTX `.entry` parsing, the build's checks (sizes and names), fake arguments, packing."""

from __future__ import annotations

import pytest

from cuteaot.codegen.ptx import check_abi, parse_entry
from cuteaot.codegen.abi import check_parameter_names
from cuteaot.runtime.abi import ArgBuffer, Param, ParamKind, Pointee, Signature, f32, i32, ptr
from cuteaot.runtime.errors import AbiMismatchError, BuildError, LaunchArgumentError
from cuteaot.runtime.kernels import ActivationSpec, FusedSpec, GemmSpec, ProbeSpec, RoutePackSpec, TopKSumSpec

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
    sig = Signature((ptr("a", Pointee.U8, ""), ptr("b", Pointee.U8, ""), i32("n", "")))
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
    sig = Signature(tuple(Param(f"p{i}", k, "", Pointee.U8 if k is ParamKind.PTR else None) for i, k in enumerate(params)))
    with pytest.raises(AbiMismatchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_abi(parse_entry(PTX, "k_0"), sig, "test")


def _read_back(address: int) -> tuple:
    import ctypes

    ptrs = (ctypes.c_void_p * 3).from_address(address)
    assert ptrs[1] % 8 == 0
    return (ctypes.c_int32.from_address(ptrs[0]).value, ctypes.c_uint64.from_address(ptrs[1]).value,
            ctypes.c_float.from_address(ptrs[2]).value)


def test_arg_buffer_packs_by_name_whatever_the_call_order():
    sig = Signature((i32("n", ""), ptr("p", Pointee.F32, ""), f32("x", "")))
    buf = ArgBuffer(sig)
    assert _read_back(buf.set(n=7, p=0x1234_5678_9ABC, x=0.5)) == (7, 0x1234_5678_9ABC, 0.5)
    assert _read_back(buf.set(x=0.25, p=0xABC, n=-3)) == (-3, 0xABC, 0.25)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"n": 1, "p": 2}, r"missing \['x'\], not declared \[\]"),
        ({"n": 1, "p": 2, "x": 0.5, "y": 3}, r"missing \[\], not declared \['y'\]"),
        ({"n": 1, "q": 2, "x": 0.5}, r"missing \['p'\], not declared \['q'\]"),
    ],
)
def test_arg_buffer_refuses_missing_or_unknown_names(values, message):
    buf = ArgBuffer(Signature((i32("n", ""), ptr("p", Pointee.F32, ""), f32("x", ""))))
    with pytest.raises(LaunchArgumentError, match=message):
        buf.set(**values)


def test_declarations_are_well_formed():
    with pytest.raises(ValueError, match="repeated"):
        Signature((i32("n", ""), i32("n", "")))
    with pytest.raises(ValueError, match="pointee"):
        Param("p", ParamKind.PTR, "")  # a pointer must say what it points to (the fake compile argument)
    with pytest.raises(ValueError, match="pointee"):
        Param("n", ParamKind.I32, "", Pointee.I32)
    with pytest.raises(ValueError, match="power of two"):
        ptr("p", Pointee.U8, "", align=12)


# -- parameter names: the PTX names parameters by position, so swaps are caught on the Python side --


class _Entry:
    """A compile target as the families write them (plain Python: the check reads signatures and source)."""

    def __call__(self, a, w13, w2, tokens, stream):
        self.kernel(a, w13, w2, tokens).launch(stream=stream)

    def kernel(self, a, w13, w2, tokens):
        pass


class _KernelSwapped(_Entry):
    def kernel(self, a, w2, w13, tokens):
        pass


class _LaunchSwapped(_Entry):
    def __call__(self, a, w13, w2, tokens, stream):
        self.kernel(a, w2, w13, tokens).launch(stream=stream)


class _EntrySwapped(_Entry):
    def __call__(self, a, w2, w13, tokens, stream):
        self.kernel(a, w13, w2, tokens).launch(stream=stream)


_DECLARED = Signature((ptr("a", Pointee.ELEM, ""), ptr("w13", Pointee.I32, ""), ptr("w2", Pointee.I32, ""),
                       i32("tokens", "")))


def test_parameter_names_matching_the_declaration_pass():
    check_parameter_names(_Entry(), _DECLARED, "test")


@pytest.mark.parametrize(
    "entry, where",
    [(_KernelSwapped(), "@cute.kernel kernel"), (_LaunchSwapped(), "the launch self.kernel"),
     (_EntrySwapped(), "@cute.jit __call__")],
)
def test_swapped_pointer_pair_fails_naming_both(entry, where):
    with pytest.raises(AbiMismatchError) as err:
        check_parameter_names(entry, _DECLARED, "test")
    text = str(err.value)
    assert where in text
    assert "position 1: declared 'w13', takes 'w2'" in text and "position 2: declared 'w2', takes 'w13'" in text


def test_declaration_swapped_against_a_real_kernel_fails_the_build(monkeypatch):
    """compile_kernel refuses a probe whose declaration swaps (src, dst) before compiling anything."""
    pytest.importorskip("cutlass.cute", reason="needs CuTeDSL (cuteaot[codegen])")
    from cuteaot.codegen.compile import compile_kernel

    src, dst, items = ProbeSpec.SIGNATURE.params
    monkeypatch.setattr(ProbeSpec, "SIGNATURE", Signature((dst, src, items)))
    with pytest.raises(AbiMismatchError, match="position 0: declared 'dst', takes 'src'.*position 1: declared 'src'"):
        compile_kernel(ProbeSpec("e2m1_bf16").key(), "sm_90a")


def _one_spec_per_compile_target():
    return [
        ActivationSpec.create("silu", "bf16", 128), TopKSumSpec("bf16", 4, 512), TopKSumSpec("fp16", 4, 512, "int32"),
        RoutePackSpec("single", "int32"), RoutePackSpec("multi", "int64"), ProbeSpec("mma_bf16"),
        GemmSpec("fp16", 512, 256, 1, 128, 128, 16, 2), GemmSpec("bf16", 512, 512, 4, 256, 64, 64, 1, mainloop="wgmma"),
        FusedSpec("bf16", 512, 256, 4, "silu", 128, 128, 128, 128, 8, 1, decode=True),
    ]


def test_every_family_takes_its_declared_parameters_and_gets_derived_fake_arguments():
    """No compile: the builders' objects pass the name check, and their fake arguments follow the declaration."""
    pytest.importorskip("cutlass.cute", reason="needs CuTeDSL (cuteaot[codegen])")
    import cutlass

    from cuteaot.codegen.compile import BUILDERS

    fixed = {"i32": cutlass.Int32, "u32": cutlass.Uint32, "u8": cutlass.Uint8, "f32": cutlass.Float32}

    def element(spec, pointee: str):
        if pointee == "elem":
            return {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[spec.dtype.value]
        if pointee == "ids":
            ids = getattr(spec, "ids_dtype", None)
            return cutlass.Int64 if ids is not None and ids.value == "int64" else cutlass.Int32
        return fixed[pointee]

    for spec in _one_spec_per_compile_target():
        obj, args = BUILDERS[spec.FAMILY](spec)
        check_parameter_names(obj, spec.SIGNATURE, spec.FAMILY)
        assert len(args) == len(spec.SIGNATURE.params) + 1  # then the stream
        for p, arg in zip(spec.SIGNATURE.params, args):
            if p.kind is ParamKind.PTR:
                want = element(spec, p.pointee.value)
                assert arg.dtype is want, (spec.FAMILY, p.name, arg.dtype)
            else:
                assert isinstance(arg, {ParamKind.I32: cutlass.Int32, ParamKind.F32: cutlass.Float32}[p.kind])


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
        wrong = Signature(spec.SIGNATURE.params[:2] + (ptr("rows", Pointee.I32, ""),))
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
    from cuteaot.codegen.kernels.w4a16.fused_planning import fused_spec_for, plan_layer
    from cuteaot.codegen.kernels.w4a16.planning import gemm_spec_for, plan_for
    from cuteaot.runtime.kernels.w4a16.gemm_spec import Routes
    from cuteaot.runtime.resolution import MoeLayerFacts

    h200 = PROFILES["h200"]
    gemm = gemm_spec_for(plan_for(1, 1024, 512, 2, 8, h200), "bf16", 1024, 512, 2, a_per_route=False,
                         mul_topk_weights=False, epilogue="none")
    facts = MoeLayerFacts(dtype="bf16", hidden_size=512, intermediate_size=256, num_experts=16, top_k=4,
                          activation="silu")
    fused = fused_spec_for(plan_layer(1, facts, h200), facts)
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
