"""Spec parsing and validation: every error names file, line and field."""

from __future__ import annotations

import re
import textwrap

import pytest

from cuteaot.codegen.spec import load_spec
from cuteaot.runtime import Activation, DType, SpecError

GOOD = """\
bundle: demo
targets: [h200]
moe:
  - name: m
    hidden_size: 256
    intermediate_size: 128
    num_experts: 8
    top_k: 2
    activation: silu
    dtype: bf16
    tokens: [1, 8]
"""


def _write(tmp_path, text):
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def _error(tmp_path, text) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_spec(_write(tmp_path, text))
    return info.value


def test_good_spec_loads(tmp_path):
    spec = load_spec(_write(tmp_path, GOOD))
    assert spec.bundle == "demo" and [t.name for t in spec.targets] == ["h200"]
    (p,) = spec.moe
    assert p.activation is Activation.SILU and p.dtypes == (DType.BF16,) and p.fast_math == (True,)
    assert p.tokens == (1, 8) and p.swiglu_limit is None


def test_tiny_spec_loads(tmp_path):
    from tests.conftest import TINY_SPEC

    spec = load_spec(TINY_SPEC)
    assert {p.activation for p in spec.moe} == set(Activation)


def test_unknown_key_names_line_and_allowed_keys(tmp_path):
    err = _error(tmp_path, GOOD.replace("    top_k: 2\n", "    top_k: 2\n    topk: 2\n"))
    assert err.line == 9 and err.field == "moe[0].topk"
    assert "unknown key" in str(err) and "top_k" in str(err) and str(err).startswith(str(tmp_path))


def test_wrong_type(tmp_path):
    err = _error(tmp_path, GOOD.replace("top_k: 2", "top_k: eight"))
    assert err.line == 8 and err.field == "moe[0].top_k" and "expected an integer" in str(err)


def test_bool_is_not_an_integer(tmp_path):
    err = _error(tmp_path, GOOD.replace("num_experts: 8", "num_experts: true"))
    assert err.field == "moe[0].num_experts"


def test_intermediate_not_vectorisable(tmp_path):
    err = _error(tmp_path, GOOD.replace("intermediate_size: 128", "intermediate_size: 100"))
    assert err.line == 6 and err.field == "moe[0].intermediate_size" and "multiple of 8" in str(err)


@pytest.mark.parametrize("edit, field, message", [
    (("hidden_size: 256", "hidden_size: 264"), "hidden_size", "hidden_size 264 is not a multiple of 16: it is FC1's K"),
    (("intermediate_size: 128", "intermediate_size: 136"), "intermediate_size",
     "intermediate_size 136 is not a multiple of 16: it is FC2's K"),
    (("tokens: [1, 8]", "tokens: [1, 8]\n    tp: 16"), "tp", "intermediate_size / tp = 8 is not a multiple of 16"),
    (("num_experts: 8", "num_experts: 513"), "num_experts", "num_experts 513 exceeds 512"),
])
def test_sizes_no_weights_can_have_are_refused(tmp_path, edit, field, message):
    """What prepare_w13 / MoeLayer would refuse at serve time, refused when the spec is read."""
    err = _error(tmp_path, GOOD.replace(*edit) + "    fused: true\n")
    assert err.field == f"moe[0].{field}" and message in str(err)
    load_spec(_write(tmp_path, GOOD.replace(*edit)))  # element-wise kernels only: no weights, any size


def test_top_k_above_experts(tmp_path):
    err = _error(tmp_path, GOOD.replace("top_k: 2", "top_k: 9"))
    assert err.field == "moe[0].top_k" and "exceeds num_experts" in str(err)


def test_enum_values_listed(tmp_path):
    err = _error(tmp_path, GOOD.replace("activation: silu", "activation: gelu"))
    assert err.line == 9 and "swigluoai" in str(err) and "relu2" in str(err)


def test_swiglu_alpha_only_for_swigluoai(tmp_path):
    err = _error(tmp_path, GOOD.replace("    dtype: bf16\n", "    swiglu: {alpha: 1.0}\n    dtype: bf16\n"))
    assert err.field == "moe[0].swiglu.alpha" and "allowed keys: limit" in str(err)


def test_relu2_takes_no_swiglu(tmp_path):
    text = GOOD.replace("activation: silu", "activation: relu2").replace("    dtype: bf16\n", "    swiglu: {limit: 1.0}\n    dtype: bf16\n")
    assert "not gated" in str(_error(tmp_path, text))


def test_unknown_target(tmp_path):
    err = _error(tmp_path, GOOD.replace("[h200]", "[h200, a100]"))
    assert err.line == 2 and "a100" in str(err) and "h200" in str(err)


def test_tokens_must_ascend(tmp_path):
    assert "strictly ascending" in str(_error(tmp_path, GOOD.replace("[1, 8]", "[8, 1]")))


def test_token_bucket_bound_names_file_line_field_and_limit(tmp_path):
    """`tokens: [1, 1000000000]` used to enumerate for many minutes; now it is a spec error."""
    from cuteaot.codegen.spec import MAX_TOKENS

    err = _error(tmp_path, GOOD.replace("tokens: [1, 8]", "tokens: [1, 1000000000]"))
    assert err.line == 11 and err.field == "moe[0].tokens" and str(err).startswith(str(tmp_path))
    assert "1,000,000,000" in str(err) and f"{MAX_TOKENS:,}" in str(err)
    block = GOOD.replace("tokens: [1, 8]", f"tokens:\n      - 1\n      - {MAX_TOKENS + 1}")
    assert _error(tmp_path, block).line == 13  # the offending item's own line
    assert load_spec(_write(tmp_path, GOOD.replace("[1, 8]", f"[1, {MAX_TOKENS}]"))).moe[0].tokens[-1] == MAX_TOKENS


def test_int32_route_vectors_bound_the_largest_bucket(tmp_path):
    """A wide, high-top_k fused problem whose route buffers overflow int32 vector counts is refused."""
    wide = GOOD.replace("hidden_size: 256", "hidden_size: 65536").replace("num_experts: 8", "num_experts: 512")
    wide = wide.replace("top_k: 2", "top_k: 32").replace("tokens: [1, 8]", "tokens: [1, 16384]")
    err = _error(tmp_path, wide + "    gemm: true\n")
    assert err.field == "moe[0].tokens" and "int32" in str(err) and "at most 8,191" in str(err)


def test_missing_key(tmp_path):
    err = _error(tmp_path, GOOD.replace("    tokens: [1, 8]\n", ""))
    assert "missing required key(s): tokens" in str(err) and err.line == 4


def test_duplicate_problem_and_duplicate_key(tmp_path):
    dup = GOOD + GOOD.split("moe:\n")[1]
    assert "duplicate problem name" in str(_error(tmp_path, dup))
    assert "duplicate key" in str(_error(tmp_path, GOOD.replace("bundle: demo\n", "bundle: demo\nbundle: x\n")))


def test_dtype_list_enumerates_and_rejects_repeats(tmp_path):
    spec = load_spec(_write(tmp_path, GOOD.replace("dtype: bf16", "dtype: [bf16, fp16]")))
    assert spec.moe[0].dtypes == (DType.BF16, DType.FP16)
    assert "twice" in str(_error(tmp_path, GOOD.replace("dtype: bf16", "dtype: [bf16, bf16]")))


def test_yaml_syntax_error_has_line(tmp_path):
    err = _error(tmp_path, GOOD.replace("targets: [h200]", "targets: [h200"))
    assert err.line is not None and err.field == "(syntax)"


def test_bias_enumerates_layer_variants_and_refuses_router_weight_on_input(tmp_path):
    spec = load_spec(_write(tmp_path, GOOD + "    bias: [false, true]\n    fused: true\n"))
    assert [f.bias for f in spec.moe[0].layer_facts() if not f.deterministic] == [False, True]
    err = _error(tmp_path, GOOD + "    bias: true\n    fused: {router_weight_on_input: [false, true]}\n")
    assert "moe[0].fused" in str(err) and "bias with router_weight_on_input" in str(err)
    err = _error(tmp_path, GOOD + "    bias: yes please\n")
    assert "moe[0].bias" in str(err) and "expected true or false" in str(err)


def test_two_problems_of_one_layer_are_refused_when_planned(tmp_path):
    """The runtime finds a table entry by the layer's facts: a second problem of the same layer would replace the
    first one's token range."""
    from cuteaot.codegen.table import plan_bundle
    from cuteaot.runtime.errors import SpecError

    twice = GOOD + "    fused: true\n" + GOOD.split("moe:\n")[1].replace("name: m", "name: m2").replace(
        "tokens: [1, 8]", "tokens: [1, 4]") + "    fused: true\n"
    spec = load_spec(_write(tmp_path, twice))
    with pytest.raises(SpecError, match="problems 'm' and 'm2' describe the same moe_layer layer on h200"):
        plan_bundle(spec)


def test_a_target_that_is_not_a_name_is_a_spec_error(tmp_path):
    err = _error(tmp_path, GOOD.replace("targets: [h200]", "targets: [[h200]]"))
    assert err.field == "targets" and "unknown device profile" in str(err)


@pytest.mark.parametrize("edit, field, message", [
    (("bundle: demo", "bundle: !!python/name:os.system demo"), "(syntax)", "could not determine a constructor"),
    (("    top_k: 2\n", "    top_k: 2\n    ? [a, b]\n    : 1\n"), "(key)", "keys must be plain names"),
    (("targets: [h200]", "targets: &a [*a]"), "(syntax)", "an alias refers to itself"),
    (("num_experts: 8", "num_experts: 64"), "moe[0].top_k", None),  # with top_k 40 below
    (("activation: silu", "activation: swigluoai\n    swiglu: {limit: .nan}"), "moe[0].swiglu", "swiglu_limit"),
])
def test_a_spec_yaml_cannot_crash_the_reader_or_blame_another_field(tmp_path, edit, field, message):
    text = GOOD.replace(*edit)
    if field == "moe[0].top_k":
        text, message = text.replace("top_k: 2", "top_k: 40"), r"top_k must be an int in \[1, 32\], got 40"
    err = _error(tmp_path, text)
    assert err.field == field and re.search(message, str(err)), str(err)


def test_sizes_too_small_for_a_vector_are_a_spec_error(tmp_path):
    err = _error(tmp_path, GOOD.replace("hidden_size: 256", "hidden_size: 4").replace(
        "intermediate_size: 128", "intermediate_size: 4").replace("top_k: 2", "top_k: 1") + "    fused: true\n")
    assert "multiple of 8" in str(err)
