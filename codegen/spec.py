"""YAML specs -> frozen dataclasses, with strict validation.

A spec names a bundle, its target device profiles and the MoE problems to
serve.  Unknown keys, wrong types and impossible combinations are errors that
name the file, the line, the field and what is allowed.

    bundle: qwen3-30b-a3b
    targets: [h200, b200]
    moe:
      - name: qwen3-30b-a3b
        hidden_size: 2048
        intermediate_size: 768
        num_experts: 128
        top_k: 8
        activation: silu            # silu | swigluoai | relu2
        swiglu: {limit: 7.0}        # optional; alpha/beta for swigluoai only
        dtype: [bf16, fp16]         # one value or a list to enumerate
        fast_math: true             # one value or a list to enumerate
        bias: false                 # per-expert FC1/FC2 biases (gpt-oss); a value or a list (fused layers)
        weights: nvfp4              # nvfp4 | nf3 (bf16 only) | modelopt | modelopt_w31 (NVFP4 read as
                                    # stored: W13 gate or up rows first; sizes multiples of 64);
                                    # a value or a list (fused layers)
        tokens: [1, 2, 4, 8, 16]    # token-count buckets, ascending, at most MAX_TOKENS (65,536)
        gemm: true                  # also build the W4A16 GEMMs (FC1, FC2) + route packing
        tp: [1, 2]                  # optional: one problem per tensor-parallel degree, named
                                    # <name>-tp<N> with intermediate_size / N (the per-rank shard)
        fused: true                 # build the fused MoE kernels (+ route packing) for MoeLayer;
                                    # or a mapping of variant lists to enumerate, e.g.
                                    # {router_weight_on_input: [false, true], expert_map: [false, true],
                                    #  calibration: [false, true]}   (default: all false)
    probes: true                    # optional: also build the test-only intrinsic probe kernels
                                    # (`moe` may then be left out; see specs/probes.yaml)
    allow_spills: false             # optional (default true): a kernel that spills registers
                                    # fails the build instead of a warning
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

from cuteaot.runtime.devices import PROFILES, DeviceProfile
from cuteaot.runtime.errors import BadInputError, SpecError
from cuteaot.runtime.kernels import ActivationSpec, TopKSumSpec
from cuteaot.runtime.kernels.w4a16.fused_spec import FusedSpec
from cuteaot.runtime.resolution import MoeLayerFacts
from cuteaot.runtime.kernels.route_pack import MAX_EXPERTS, IdsDType
from cuteaot.runtime.kernels.topk_sum import MAX_TOP_K
from cuteaot.runtime.nf3 import NF3_BLOCK_K
from cuteaot.runtime.weights import SCALE_GROUP_K
from cuteaot.runtime.types import Activation, DType, WeightFormat

from .kernels.w4a16.fused_planning import fused_spec_for, plan_layer
from .kernels.w4a16.planning import gemm_spec_for, plan_for

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")

# The largest token bucket a spec may list.  Enumeration plans every token count 1..largest bucket
# on every target (linear: ~35 s for specs/moe-models.yaml at 16,384 on the 2-core builder), and a
# layer runs calls above its largest bucket in chunks of it, so larger buckets buy nothing but
# build time.  65,536 is 4x the largest bucket of any shipped spec.
MAX_TOKENS = 1 << 16
# The fused kernel counts the 16-byte vectors of its route-major buffers (routes x hidden / 8) in
# int32 (codegen/kernels/w4a16/fused.py), so tokens x top_k x width / 8 must stay below 2**31.
_INT32_MAX = 2**31 - 1
_VECTOR_ELEMENTS = 8  # bf16/fp16 elements per 16-byte vector


@dataclass(frozen=True)
class MoeProblem:
    name: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    activation: Activation
    swiglu_alpha: Optional[float]
    swiglu_beta: Optional[float]
    swiglu_limit: Optional[float]
    dtypes: tuple[DType, ...]
    fast_math: tuple[bool, ...]
    tokens: tuple[int, ...]
    gemm: bool = False
    # fused MoE variants to build: (router_weight_on_input, expert_map, calibration) triples
    fused: tuple[tuple[bool, bool, bool], ...] = ()
    biases: tuple[bool, ...] = (False,)  # layer variants without / with per-expert biases
    weights: tuple[WeightFormat, ...] = (WeightFormat.NVFP4,)  # weight formats of the fused layers

    @property
    def fc1_n(self) -> int:
        return self.activation.fc1_width(self.intermediate_size)

    def gemm_specs(self, m: int, dtype: DType, profile: DeviceProfile) -> dict:
        """{"fc1_gemm": GemmSpec, "fc2_gemm": GemmSpec} the runtime plans for m tokens on `profile`.

        FC1: tokens x hidden -> routes x fc1_n (relu2 applied in its epilogue for relu2);
        FC2: routes x intermediate -> routes x hidden, router weights applied.
        """
        fc1 = plan_for(m, self.fc1_n, self.hidden_size, self.top_k, self.num_experts, profile)
        fc2 = plan_for(m, self.hidden_size, self.intermediate_size, self.top_k, self.num_experts, profile)
        relu2 = self.activation is Activation.RELU2
        return {
            "fc1_gemm": gemm_spec_for(fc1, dtype, self.fc1_n, self.hidden_size, self.top_k, a_per_route=False,
                                      mul_topk_weights=False, epilogue="relu2" if relu2 else "none"),
            "fc2_gemm": gemm_spec_for(fc2, dtype, self.hidden_size, self.intermediate_size, self.top_k,
                                      a_per_route=True, mul_topk_weights=True, epilogue="none"),
        }

    def layer_facts(self) -> Iterator[MoeLayerFacts]:
        """The MoeLayer variants this problem builds: dtype x fast_math x fused variant x deterministic.

        deterministic=True replaces the decode regime (bf16 atomics) by the packed path; expert-map
        and calibration variants never take the decode regime, so they have no deterministic twin.
        """
        for dtype, fast_math, (on_input, expert_map, calibration), bias, weights in itertools.product(
                self.dtypes, self.fast_math, self.fused, self.biases, self.weights):
            for deterministic in (False, True) if not (expert_map or calibration) else (False,):
                yield MoeLayerFacts(
                    dtype=dtype, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                    num_experts=self.num_experts, top_k=self.top_k, activation=self.activation,
                    fast_math=fast_math, swiglu_alpha=self.swiglu_alpha, swiglu_beta=self.swiglu_beta,
                    swiglu_limit=self.swiglu_limit, router_weight_on_input=on_input, expert_map=expert_map,
                    calibration=calibration, deterministic=deterministic, bias=bias, weights=weights,
                )

    def fused_specs(self, m: int, profile: DeviceProfile) -> dict[MoeLayerFacts, FusedSpec]:
        """The fused kernel each layer variant runs for m tokens on `profile`."""
        return {facts: fused_spec_for(plan_layer(m, facts, profile), facts) for facts in self.layer_facts()}

    def activation_spec(self, dtype: DType, fast_math: bool) -> ActivationSpec:
        return ActivationSpec.create(
            self.activation, dtype, self.intermediate_size, fast_math=fast_math,
            swiglu_alpha=self.swiglu_alpha, swiglu_beta=self.swiglu_beta, swiglu_limit=self.swiglu_limit,
        )

    def topk_sum_spec(self, dtype: DType, ids_dtype: IdsDType | None = None, accumulate: bool = False) -> TopKSumSpec:
        """The top-k sum; with ids_dtype, the masked variant that skips routes dropped for their id; with
        accumulate, the one that adds into its output (a HybridMoeLayer's later parts)."""
        return TopKSumSpec(dtype, self.top_k, self.hidden_size, ids_dtype, True if accumulate else None)


@dataclass(frozen=True)
class BundleSpec:
    bundle: str
    targets: tuple[DeviceProfile, ...]
    moe: tuple[MoeProblem, ...]
    file: str
    sha256: str
    probes: bool = False  # build the `intrinsic_probe` kernels (runtime/kernels/probe.py)
    allow_spills: bool = True  # false: a kernel that spills registers fails the build


class _Node:
    """A YAML value with the line it came from (1-based)."""

    __slots__ = ("value", "line")

    def __init__(self, value: Any, line: int):
        self.value = value
        self.line = line


def _convert(node: yaml.Node, file: str) -> _Node:
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, _Node] = {}
        key_lines: dict[str, int] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                raise SpecError(file, k.start_mark.line + 1, "(key)", "keys must be plain names, not lists or mappings")
            key = k.value
            if key in out:
                raise SpecError(file, k.start_mark.line + 1, str(key), f"duplicate key (first on line {key_lines[key]})")
            key_lines[key] = k.start_mark.line + 1
            out[key] = _convert(v, file)
        return _Node(out, line)
    if isinstance(node, yaml.SequenceNode):
        return _Node([_convert(v, file) for v in node.value], line)
    return _Node(yaml.safe_load(yaml.serialize(node)), line)


class _Reader:
    def __init__(self, file: str):
        self.file = file

    def fail(self, node: _Node | None, field: str, message: str) -> SpecError:
        return SpecError(self.file, node.line if node else None, field, message)

    def mapping(self, node: _Node, field: str, required: set[str], optional: set[str]) -> dict[str, _Node]:
        if not isinstance(node.value, dict):
            raise self.fail(node, field, f"expected a mapping, got {type(node.value).__name__}")
        for key, child in node.value.items():
            if key not in required | optional:
                allowed = ", ".join(sorted(required | optional))
                raise self.fail(child, f"{field}.{key}" if field else key, f"unknown key; allowed keys: {allowed}")
        missing = sorted(required - node.value.keys())
        if missing:
            raise self.fail(node, field or "(top level)", f"missing required key(s): {', '.join(missing)}")
        return node.value

    def integer(self, node: _Node, field: str, minimum: int = 1) -> int:
        if not isinstance(node.value, int) or isinstance(node.value, bool):
            raise self.fail(node, field, f"expected an integer, got {node.value!r}")
        if node.value < minimum:
            raise self.fail(node, field, f"must be >= {minimum}, got {node.value}")
        return node.value

    def number(self, node: _Node, field: str) -> float:
        if not isinstance(node.value, (int, float)) or isinstance(node.value, bool):
            raise self.fail(node, field, f"expected a number, got {node.value!r}")
        return float(node.value)

    def boolean(self, node: _Node, field: str) -> bool:
        if not isinstance(node.value, bool):
            raise self.fail(node, field, f"expected true or false, got {node.value!r}")
        return node.value

    def name(self, node: _Node, field: str) -> str:
        if not isinstance(node.value, str) or not _NAME.match(node.value):
            raise self.fail(node, field, f"expected a lower-case name ([a-z0-9._-]), got {node.value!r}")
        return node.value

    def choice(self, node: _Node, field: str, enum):
        allowed = [e.value for e in enum]
        if node.value not in allowed:
            raise self.fail(node, field, f"must be one of {allowed}, got {node.value!r}")
        return enum(node.value)

    def one_or_list(self, node: _Node, field: str, read) -> tuple:
        items = node.value if isinstance(node.value, list) else [node]
        if not items:
            raise self.fail(node, field, "must not be an empty list")
        values = tuple(read(item, field) for item in items)
        if len(set(values)) != len(values):
            raise self.fail(node, field, f"lists a value twice: {[getattr(v, 'value', v) for v in values]}")
        return values


def _problem(r: _Reader, node: _Node, field: str) -> list[MoeProblem]:
    """One problem, or one per tensor-parallel degree of `tp` (named <name>-tp<N>, I / N each)."""
    m = node.value if isinstance(node.value, dict) else {}
    if "tp" not in m:
        return [_one_problem(r, node, field, 1)]
    degrees = r.one_or_list(m["tp"], f"{field}.tp", r.integer)
    return [_one_problem(r, node, field, tp) for tp in degrees]


def _one_problem(r: _Reader, node: _Node, field: str, tp: int) -> MoeProblem:
    m = r.mapping(
        node, field,
        required={"name", "hidden_size", "intermediate_size", "num_experts", "top_k", "activation", "dtype", "tokens"},
        optional={"swiglu", "fast_math", "gemm", "fused", "tp", "bias", "weights"},
    )
    activation = r.choice(m["activation"], f"{field}.activation", Activation)
    swiglu: dict[str, float] = {}
    if "swiglu" in m:
        allowed = {"alpha", "beta", "limit"} if activation is Activation.SWIGLUOAI else {"limit"}
        if activation is Activation.RELU2:
            raise r.fail(m["swiglu"], f"{field}.swiglu", "relu2 is not gated and takes no swiglu parameters")
        sw = r.mapping(m["swiglu"], f"{field}.swiglu", set(), allowed)
        swiglu = {k: r.number(v, f"{field}.swiglu.{k}") for k, v in sw.items()}
    tokens_node = m["tokens"]
    if not isinstance(tokens_node.value, list) or not tokens_node.value:
        raise r.fail(tokens_node, f"{field}.tokens", "expected a non-empty list of token counts")
    tokens = tuple(r.integer(t, f"{field}.tokens") for t in tokens_node.value)
    if list(tokens) != sorted(set(tokens)):
        raise r.fail(tokens_node, f"{field}.tokens", f"must be strictly ascending, got {list(tokens)}")
    for node_t in tokens_node.value:
        if node_t.value > MAX_TOKENS:
            raise r.fail(node_t, f"{field}.tokens", (
                f"token bucket {node_t.value:,} exceeds the limit of {MAX_TOKENS:,} tokens (the build plans every "
                "count up to the largest bucket; larger calls run in chunks of the largest bucket anyway); "
                f"list buckets up to {MAX_TOKENS}"))
    num_experts = r.integer(m["num_experts"], f"{field}.num_experts")
    top_k = r.integer(m["top_k"], f"{field}.top_k")
    if not 1 <= top_k <= MAX_TOP_K:  # the top-k sum's unrolled route loop
        raise r.fail(m["top_k"], f"{field}.top_k", f"top_k must be an int in [1, {MAX_TOP_K}], got {top_k}")
    if top_k > num_experts:
        raise r.fail(m["top_k"], f"{field}.top_k", f"top_k {top_k} exceeds num_experts {num_experts}")
    fast_math = r.one_or_list(m["fast_math"], f"{field}.fast_math", r.boolean) if "fast_math" in m else (True,)
    inter = r.integer(m["intermediate_size"], f"{field}.intermediate_size")
    name = r.name(m["name"], f"{field}.name")
    if "tp" in m:
        if inter % tp:
            raise r.fail(m["tp"], f"{field}.tp", f"intermediate_size {inter} is not divisible by tp={tp}")
        inter, name = inter // tp, f"{name}-tp{tp}"
    problem = MoeProblem(
        name=name,
        hidden_size=r.integer(m["hidden_size"], f"{field}.hidden_size"),
        intermediate_size=inter,
        num_experts=num_experts,
        top_k=top_k,
        activation=activation,
        swiglu_alpha=swiglu.get("alpha"),
        swiglu_beta=swiglu.get("beta"),
        swiglu_limit=swiglu.get("limit"),
        dtypes=r.one_or_list(m["dtype"], f"{field}.dtype", lambda n, f: r.choice(n, f, DType)),
        fast_math=fast_math,
        tokens=tokens,
        gemm=r.boolean(m["gemm"], f"{field}.gemm") if "gemm" in m else False,
        fused=_fused_variants(r, m["fused"], f"{field}.fused") if "fused" in m else (),
        biases=r.one_or_list(m["bias"], f"{field}.bias", r.boolean) if "bias" in m else (False,),
        weights=(r.one_or_list(m["weights"], f"{field}.weights", lambda n, f: r.choice(n, f, WeightFormat))
                 if "weights" in m else (WeightFormat.NVFP4,)),
    )
    if problem.weights != (WeightFormat.NVFP4,):
        if WeightFormat.NF3 in problem.weights and problem.dtypes != (DType.BF16,):
            raise r.fail(m["weights"], f"{field}.weights", "NF3 weights serve bf16 activations only; "
                         f"dtype is {[d.value for d in problem.dtypes]}")
        if problem.gemm:
            raise r.fail(m["weights"], f"{field}.weights", "the standalone GEMMs (gemm: true) read NVFP4; "
                         "layers of other weight formats run through the fused kernels (fused: ...)")
        if not problem.fused:
            raise r.fail(m["weights"], f"{field}.weights", "weight formats other than nvfp4 need fused layers "
                         "(fused: true)")
    if problem.gemm or problem.fused:
        _check_int32_routes(r, tokens_node, f"{field}.tokens", problem)
    # The kernel families' own validity checks decide what combinations can be built.
    # The activation's check is the swiglu node's where the sizes pass it without the swiglu values.
    unswiglued = dataclasses.replace(problem, swiglu_alpha=None, swiglu_beta=None, swiglu_limit=None)
    checks = [
        ("intermediate_size", lambda: unswiglued.activation_spec(problem.dtypes[0], True)),
        ("swiglu", lambda: problem.activation_spec(problem.dtypes[0], True)),
        ("hidden_size", lambda: problem.topk_sum_spec(problem.dtypes[0])),
    ]
    # every token count up to the largest bucket must have a plan (fit check, tiles); checked on the H200
    if problem.gemm:
        checks.append(("gemm", lambda: problem.gemm_specs(problem.tokens[-1], problem.dtypes[0], PROFILES["h200"])))
    if problem.fused:
        for m_check in (1, problem.tokens[-1]):
            checks.append(("fused", lambda m_check=m_check: problem.fused_specs(m_check, PROFILES["h200"])))
    for name, check in checks:
        try:
            check()
        except BadInputError as exc:
            raise r.fail(m.get(name, node), f"{field}.{name}", str(exc)) from None
    if problem.gemm or problem.fused:
        _check_layer_sizes(r, m, field, problem)
    return problem


def _check_layer_sizes(r: _Reader, m: dict, field: str, problem: MoeProblem) -> None:
    """What MoeLayer and the weights' preparation would refuse at serve time, refused when the spec is read:
    more experts than the route tables hold, and GEMM K sizes the weights' block scales do not divide."""
    if problem.num_experts > MAX_EXPERTS:
        raise r.fail(m["num_experts"], f"{field}.num_experts", f"num_experts {problem.num_experts} exceeds "
                     f"{MAX_EXPERTS}, the most experts the route tables hold (per-expert counts in shared memory)")
    k_block = NF3_BLOCK_K if WeightFormat.NF3 in problem.weights else SCALE_GROUP_K
    for size_name, gemm in (("hidden_size", "FC1"), ("intermediate_size", "FC2")):
        size = getattr(problem, size_name)
        if size % k_block:
            where = "tp" if size_name == "intermediate_size" and "tp" in m else size_name
            what = f"intermediate_size / tp = {size}" if where == "tp" else f"{size_name} {size}"
            raise r.fail(m[where], f"{field}.{where}", f"{what} is not a multiple of {k_block}: it is {gemm}'s K, "
                         f"and the weights carry one scale per {k_block} of K")


def _check_int32_routes(r: _Reader, node: _Node, field: str, problem: MoeProblem) -> None:
    """The largest bucket's route-major buffers must be countable in int32 16-byte vectors."""
    per_token = max(1, problem.top_k * max(problem.hidden_size, problem.fc1_n) // _VECTOR_ELEMENTS)
    limit = _INT32_MAX // per_token
    if problem.tokens[-1] > limit:
        raise r.fail(node, field, (
            f"largest bucket {problem.tokens[-1]:,} x top_k {problem.top_k} x width "
            f"{max(problem.hidden_size, problem.fc1_n)} overflows the kernels' int32 vector counts; "
            f"the largest bucket may be at most {limit:,} for this problem"))


def _fused_variants(r: _Reader, node: _Node, field: str) -> tuple[tuple[bool, bool, bool], ...]:
    """`fused: true|false` or a mapping of variant lists -> (on_input, expert_map, calibration) triples."""
    if isinstance(node.value, bool):
        return ((False, False, False),) if node.value else ()
    names = ("router_weight_on_input", "expert_map", "calibration")
    m = r.mapping(node, field, set(), set(names))
    lists = [r.one_or_list(m[n], f"{field}.{n}", r.boolean) if n in m else (False,) for n in names]
    return tuple(dict.fromkeys((a, b, c) for a in lists[0] for b in lists[1] for c in lists[2]))


def load_spec(path: str | Path) -> BundleSpec:
    path = Path(path)
    file = str(path)
    if path.is_dir():
        hint = " (a model directory: `cuteaot spec DIR -o SPEC.yaml` writes its spec)" \
            if (path / "config.json").is_file() else ""
        raise SpecError(file, None, "(file)", f"is a directory; pass a spec YAML file{hint}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(file, None, "(file)", f"cannot read spec: {exc}") from None
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise SpecError(file, mark.line + 1 if mark else None, "(syntax)", str(exc)) from None
    if root is None:
        raise SpecError(file, 1, "(top level)", "the spec is empty")
    r = _Reader(file)
    try:
        top_node = _convert(root, file)
    except yaml.YAMLError as exc:  # a tag safe_load refuses (e.g. !!python/name:...)
        mark = getattr(exc, "problem_mark", None)
        raise SpecError(file, mark.line + 1 if mark else None, "(syntax)", str(exc)) from None
    except RecursionError:
        raise SpecError(file, None, "(syntax)", "an alias refers to itself (a recursive anchor)") from None
    if isinstance(top_node.value, dict) and "bundle" not in top_node.value and (
            {"model_type", "architectures"} & top_node.value.keys()):
        raise r.fail(top_node, "(top level)", "this is a Hugging Face model config, not a cuteaot spec; "
                     "`cuteaot spec MODEL_DIR -o SPEC.yaml` writes the spec of its MoE layers")
    top = r.mapping(top_node, "", required={"bundle", "targets"},
                    optional={"description", "moe", "probes", "allow_spills"})
    probes = r.boolean(top["probes"], "probes") if "probes" in top else False
    allow_spills = r.boolean(top["allow_spills"], "allow_spills") if "allow_spills" in top else True
    if "moe" not in top and not probes:
        raise r.fail(top_node, "(top level)", "missing required key(s): moe (only a `probes: true` spec may omit it)")
    targets_node = top["targets"]
    if not isinstance(targets_node.value, list) or not targets_node.value:
        raise r.fail(targets_node, "targets", f"expected a non-empty list of device profiles from {sorted(PROFILES)}")
    targets = []
    for t in targets_node.value:
        if not isinstance(t.value, str) or t.value not in PROFILES:
            raise r.fail(t, "targets", f"unknown device profile {t.value!r}; known: {sorted(PROFILES)}")
        if PROFILES[t.value] in targets:
            raise r.fail(t, "targets", f"{t.value!r} is listed twice")
        targets.append(PROFILES[t.value])
    moe_node = top.get("moe", _Node([], top_node.line))
    if "moe" in top and (not isinstance(moe_node.value, list) or not moe_node.value):
        raise r.fail(moe_node, "moe", "expected a non-empty list of MoE problems")
    problems = [q for i, p in enumerate(moe_node.value) for q in _problem(r, p, f"moe[{i}]")]
    seen: dict[str, int] = {}
    for i, p in enumerate(problems):
        if p.name in seen:
            raise r.fail(moe_node, "moe", f"duplicate problem name {p.name!r} (problems {seen[p.name]} and {i})")
        seen[p.name] = i
    return BundleSpec(
        bundle=r.name(top["bundle"], "bundle"),
        targets=tuple(targets),
        moe=tuple(problems),
        file=file,
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        probes=probes,
        allow_spills=allow_spills,
    )
