"""Specialization keys are canonical and stable; enumeration deduplicates."""

from __future__ import annotations

import dataclasses

import pytest

from cuteaot.codegen.enumerate import jobs, kernel_keys
from cuteaot.codegen.table import plan_bundle
from cuteaot.codegen.spec import load_spec
from cuteaot.runtime.keys import KernelKey
from cuteaot.runtime.errors import BadInputError
from cuteaot.runtime.kernels import ActivationSpec, FusedSpec, GemmSpec, ProbeSpec, RoutePackSpec, TopKSumSpec
from cuteaot.runtime.kernels.route_pack import IdsDType, RouteStage
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


# Digests of one key per family, computed before key() was derived from the dataclass fields
# (when each family typed its facts by hand): deriving them must not orphan any built cubin.
# The GEMM and fused digests are those of VERSION 2 (the bias parameters changed their ABI).
_PINNED = [
    (lambda: TopKSumSpec("bf16", 4, 512, "int64"), "6d04ec090d72199171049b5b968b50aa6ffebbf40b26dff9edc36346fd291737"),
    (lambda: GemmSpec("bf16", 1024, 512, 2, 128, 128, 8, 1, routes="direct"),
     "d3fed6cea56f1dd8fb6896792f1f619837120815f7d7b56ba69687ae6a3a4354"),
    (lambda: GemmSpec("bf16", 1024, 512, 2, 128, 128, 16, 1, n_out=1000, k_in=504, epilogue="relu2"),
     "8046a356d85a9df5a6a269da29bffac9e68554ed5cbcf0684aedfcff9e594a88"),
    (lambda: FusedSpec("bf16", 512, 256, 4, "silu", 128, 128, 128, 128, 8, 1, decode=True),
     "8041102ed42fceb6f7a141cf4968914f1a5b94b7bbfdda661608d9562e34bd6e"),
    (lambda: FusedSpec("fp16", 512, 256, 4, "swigluoai", 128, 128, 128, 128, 16, 1, swiglu_alpha=1.702,
                       swiglu_beta=1.0, swiglu_limit=7.0),
     "869593f7c913126477c7f4aa306d56aab273a54f23919d256cd3d4923db118a7"),
    (lambda: RoutePackSpec("multi", "int64"), "31b9a7ea877740aa8cc53de0049a96e6d5867a1d37955b808d7689256b3ad832"),
    (lambda: RoutePackSpec("single", "int32"), "342c6131c2b93ee091724fe9377150973fe36f7b4e46674c6b6c5e9f76e23d50"),
    (lambda: ProbeSpec("e2m1_bf16"), "b219618b14f4302da05d4aa2e6f7d8d666d9d6213807c215417af11bd753118e"),
]


@pytest.mark.parametrize("make, digest", _PINNED)
def test_derived_keys_keep_the_hand_written_digests(make, digest):
    spec = make()
    assert spec.key().digest == digest
    assert type(spec).from_facts(spec.key().facts) == spec


def test_key_facts_are_the_fields_plus_the_family_constants():
    for spec in (make() for make, _ in _PINNED):
        names = {f.name for f in dataclasses.fields(spec)}
        omitted = {n for n in type(spec).KEY_OMITS_NONE if getattr(spec, n) is None}
        assert set(spec.key().facts) == (names - omitted) | set(type(spec).CONSTANT_FACTS), type(spec).__name__
    assert "ids_dtype" not in TopKSumSpec("bf16", 4, 512).key().facts  # the plain sum's keys predate the field
    assert RoutePackSpec("multi", "int64").key().facts["ids_dtype"] == "int64"


def test_from_facts_restores_enums_and_names_bad_facts():
    spec = RoutePackSpec.from_facts({"stage": "multi", "ids_dtype": "int64", "threads": 512, "max_experts": 512})
    assert spec.stage is RouteStage.MULTI and spec.ids_dtype is IdsDType.INT64
    facts = dict(GemmSpec("bf16", 1024, 512, 2, 128, 128, 16, 1).key().facts)
    with pytest.raises(BadInputError, match=r"unknown \['tile_m'\], missing \[\]"):
        GemmSpec.from_facts({**facts, "tile_m": 64})
    del facts["tile_n"]
    with pytest.raises(BadInputError, match=r"unknown \[\], missing \['tile_n'\]"):
        GemmSpec.from_facts(facts)
    # a constant that differs is not an error here: the key it gives back is not the one asked for
    stale = ActivationSpec.create("silu", "bf16", 768).key()
    assert ActivationSpec.from_facts({**stale.facts, "vector": 4}).key() == stale


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
    # element-wise problems only: nothing is planned per token count, the table is empty
    assert plan_bundle(spec).entries == [] and {j.key for j in jobs(spec)} == set(keys)
