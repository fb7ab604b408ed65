"""Specialization keys are canonical and stable; enumeration deduplicates."""

from __future__ import annotations

import pytest

from cuteaot.codegen.enumerate import jobs, kernel_keys, resolution_table
from cuteaot.codegen.spec import load_spec
from cuteaot.runtime.keys import KernelKey
from cuteaot.runtime.kernels import ActivationSpec, TopKSumSpec
from tests.conftest import TINY_SPEC


def test_key_is_order_independent_and_canonical():
    a = KernelKey("f", 1, {"b": 2, "a": None, "c": 1.5})
    b = KernelKey("f", 1, {"c": 1.5, "a": None, "b": 2})
    assert a == b and a.digest == b.digest
    assert a.canonical == '{"facts":{"a":null,"b":2,"c":1.5},"family":"f","version":1}'
    assert KernelKey("f", 2, {"b": 2, "a": None, "c": 1.5}).digest != a.digest


def test_key_digest_is_stable_across_releases():
    # Changing this digest orphans every cached cubin and bundle: bump VERSION on purpose instead.
    spec = ActivationSpec.create("silu", "bf16", 768)
    assert spec.key().digest == "578bffda83e4562fdad1c27ab1798af25ce265f6f483692b31ca207da5fed240"
    assert TopKSumSpec("bf16", 8, 2048).key().digest == (
        "d2b71a1e35f06270bdfecb569e62395c7f8e9aea9b60fb1e5998442094fbeff6"
    )


def test_key_rejects_non_json_facts():
    with pytest.raises(TypeError):
        KernelKey("f", 1, {"a": [1, 2]})
    with pytest.raises(ValueError):
        KernelKey("f", 1, {"a": float("nan")})


def test_from_facts_round_trips():
    for spec in (ActivationSpec.create("swigluoai", "fp16", 2880, fast_math=False), TopKSumSpec("bf16", 4, 2880)):
        key = spec.key()
        assert type(spec).from_facts(key.facts).key() == key


def test_swigluoai_defaults_and_relu2_normalisation():
    oai = ActivationSpec.create("swigluoai", "bf16", 128)
    assert (oai.swiglu_alpha, oai.swiglu_beta, oai.swiglu_limit) == (1.702, 1.0, 7.0)
    assert ActivationSpec.create("relu2", "bf16", 128, fast_math=True).key() == ActivationSpec.create(
        "relu2", "bf16", 128, fast_math=False
    ).key()


def test_tiny_enumeration():
    spec = load_spec(TINY_SPEC)
    keys = kernel_keys(spec)
    assert len(keys) == len(set(keys)) == 18  # 12 activations (relu2 deduplicated) + 6 top-k sums
    assert len(jobs(spec)) == 36 and {j.arch for j in jobs(spec)} == {"sm_90a", "sm_120a"}
    assert jobs(spec) == jobs(load_spec(TINY_SPEC))  # deterministic order
    rows = resolution_table(spec)
    digests = {k.digest for k in keys}
    assert rows and all(set(r["kernels"].values()) <= digests for r in rows)
    # tiny-relu2 lists no fast_math, so its rows carry the default
    assert {r["fast_math"] for r in rows if r["problem"] == "tiny-relu2"} == {True}
