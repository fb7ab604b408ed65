"""Frozen resolution: the build's serve-time decisions, read back by table lookup.

The build plans every token count of every problem in a spec (codegen/kernels/w4a16/
planning.py, fused_planning.py) and writes the decisions into the manifest's
`resolution` table; the runtime never plans.  A table entry is one operation on one
device profile with the facts a call must match:

* `moe_layer` — the fused MoE layer (`MoeLayer`), facts `MoeLayerFacts`;
* `gemm` — one grouped W4A16 GEMM (`w4a16_moe_gemm`), facts `GemmFacts`.

Each entry holds the **launches**, contiguous token ranges [m_min, m_max] with the
kernel (key digest), grid and route handling of every M in the range, and the
**workspaces**, the buffer sizes a caller reserves for up to `max_tokens` tokens (one
per token bucket of the spec).  A call finds its launch by binary search on M; a layer
finds its entry by its facts, or fails with the nearest entries named.

docs/manifest.md documents the JSON; this module is the only reader.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field, fields
from typing import Mapping, Optional

from .errors import BadInputError, SchemaMismatchError, UnknownSpecializationError
from .types import Activation, DType, WeightFormat

MOE_LAYER = "moe_layer"
GEMM = "gemm"


# ------------------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class MoeLayerFacts:
    """What selects a fused MoE layer's kernels: its shape, numerics and options (normalised)."""

    dtype: DType
    hidden_size: int
    intermediate_size: int
    num_experts: int  # experts the routing addresses (the expert map's length under EP)
    top_k: int
    activation: Activation
    fast_math: bool = True
    swiglu_alpha: Optional[float] = None
    swiglu_beta: Optional[float] = None
    swiglu_limit: Optional[float] = None
    router_weight_on_input: bool = False
    expert_map: bool = False
    calibration: bool = False  # the per-call activation-amax variant
    deterministic: bool = False
    bias: bool = False  # per-expert FC1 and FC2 biases (gpt-oss)
    weights: WeightFormat = WeightFormat.NVFP4  # how the expert weights are stored

    def __post_init__(self) -> None:
        act = Activation(self.activation)
        object.__setattr__(self, "weights", WeightFormat(self.weights))
        object.__setattr__(self, "dtype", DType(self.dtype))
        object.__setattr__(self, "activation", act)
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BadInputError(f"{name} must be a positive int, got {value!r}")
        # the activation's own spec validates its parameters and fills the swigluoai defaults
        from .kernels.activation import ActivationSpec  # lazily: the kernels import the bundle, which imports us

        spec = ActivationSpec.create(act, self.dtype, self.intermediate_size, fast_math=bool(self.fast_math),
                                     swiglu_alpha=self.swiglu_alpha, swiglu_beta=self.swiglu_beta,
                                     swiglu_limit=self.swiglu_limit)
        for name in ("fast_math", "swiglu_alpha", "swiglu_beta", "swiglu_limit"):  # relu2 drops fast_math
            object.__setattr__(self, name, getattr(spec, name))
        for name in ("router_weight_on_input", "expert_map", "calibration", "deterministic", "bias"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.bias and self.router_weight_on_input:
            raise BadInputError("bias with router_weight_on_input is not defined: the router weight would "
                                "scale FC1's bias but not FC2's")
        if self.weights is WeightFormat.NF3 and self.dtype is not DType.BF16:
            raise BadInputError(f"NF3 weights serve bf16 activations only, got {self.dtype.value}")
        if self.deterministic and (self.expert_map or self.calibration):
            object.__setattr__(self, "deterministic", False)  # those variants never take the atomic path

    @property
    def gated(self) -> bool:
        return self.activation.is_gated

    def to_json(self) -> dict:
        return _facts_json(self)


@dataclass(frozen=True)
class GemmFacts:
    """What selects a grouped GEMM's plan: the weights' logical shape and the routing."""

    dtype: DType
    n: int
    k: int
    top_k: int
    num_experts: int
    layout: str = "packed"
    scale_format: str = "e4m3_k16"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DType(self.dtype))

    def to_json(self) -> dict:
        return _facts_json(self)


def gemm_variant(a_per_route: bool, mul_topk_weights: bool, epilogue: str) -> str:
    """The name of one GEMM kernel variant within a launch (which operands and epilogue)."""
    return f"a_per_route={int(bool(a_per_route))},mul_topk_weights={int(bool(mul_topk_weights))},epilogue={epilogue}"


def _facts_json(facts) -> dict:
    out = {}
    for f in fields(facts):
        value = getattr(facts, f.name)
        out[f.name] = value.value if hasattr(value, "value") else value
    return out


_FACTS = {MOE_LAYER: MoeLayerFacts, GEMM: GemmFacts}


# ------------------------------------------------------------------------------------- entries


@dataclass(frozen=True)
class Launch:
    """How every M in [m_min, m_max] launches (the planner's decision for that range).

    route_block: 0 = direct routes (topk_ids read as they are), else the packed block size.
    kernels: the kernel key digest per role or variant.  moe_layer: {"fused": ...} for the fused
        kernel, or {"fc1": ..., "fc2": ...} for the two grouped-GEMM launches (with the activation
        and top-k sum kernels of the layer between and after them); gemm: by gemm_variant.
    grids: the grid of each role whose grid is not grid_x (the split layer's "fc2").
    sizes: buffer sizes the launch needs at m_max (its split-K scratch, locks, route slots).
    """

    m_min: int
    m_max: int
    grid_x: int
    route_block: int
    kernels: Mapping[str, str]
    sizes: Mapping[str, int] = field(default_factory=dict)
    grids: Mapping[str, int] = field(default_factory=dict)

    @property
    def direct(self) -> bool:
        return self.route_block == 0

    @property
    def split(self) -> bool:
        """A MoE layer run as FC1 and FC2 grouped-GEMM launches instead of one fused kernel."""
        return "fc1" in self.kernels

    def grid(self, role: str) -> int:
        return self.grids.get(role, self.grid_x)

    def kernel(self, variant: str) -> str:
        try:
            return self.kernels[variant]
        except KeyError:
            raise UnknownSpecializationError(
                f"the bundle has no {variant!r} kernel for M in [{self.m_min}, {self.m_max}]; built variants: "
                f"{sorted(self.kernels)}. Add the variant to the spec and rebuild (`cuteaot build SPEC --out DIR`)."
            ) from None


@dataclass(frozen=True)
class Workspace:
    """Buffer sizes (elements) that serve every launch of an entry for up to `max_tokens` tokens."""

    max_tokens: int
    sizes: Mapping[str, int]


@dataclass(frozen=True)
class Entry:
    op: str
    profile: str
    problem: str
    facts: object  # MoeLayerFacts | GemmFacts
    launches: tuple[Launch, ...]
    workspaces: tuple[Workspace, ...]

    @property
    def max_tokens(self) -> int:
        return self.launches[-1].m_max

    def launch(self, m: int) -> Launch:
        """The launch of an m-token call (1 <= m <= max_tokens): binary search over the ranges."""
        if not 1 <= m <= self.max_tokens:
            raise BadInputError(f"{self.problem}: the table covers 1..{self.max_tokens} tokens per launch, got {m}")
        i = bisect.bisect_right(self._starts, m) - 1
        return self.launches[i]

    def workspace(self, max_tokens: int) -> Workspace:
        """The smallest recorded workspace serving up to max_tokens tokens."""
        for ws in self.workspaces:
            if ws.max_tokens >= max_tokens:
                return ws
        raise BadInputError(
            f"{self.problem}: the bundle serves at most {self.max_tokens} tokens per launch, max_tokens={max_tokens} "
            "asks for more; larger calls run in chunks of max_tokens"
        )

    @property
    def _starts(self) -> list[int]:
        return [launch.m_min for launch in self.launches]

    def to_json(self) -> dict:
        return {
            "op": self.op, "profile": self.profile, "problem": self.problem, "facts": self.facts.to_json(),
            "launches": [asdict(launch) for launch in self.launches],
            "workspaces": [asdict(ws) for ws in self.workspaces],
        }

    @classmethod
    def from_json(cls, raw: dict) -> "Entry":
        try:
            facts = _FACTS[raw["op"]](**raw["facts"])
            launches = tuple(Launch(**launch) for launch in raw["launches"])
            workspaces = tuple(Workspace(**ws) for ws in raw["workspaces"])
            entry = cls(raw["op"], raw["profile"], raw["problem"], facts, launches, workspaces)
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaMismatchError(f"malformed resolution entry {raw.get('problem')!r}: {exc}") from exc
        entry.check()
        return entry

    def check(self) -> None:
        """The launches tile 1..max_tokens without gaps or overlaps; their grids, blocks and sizes are
        counts (a table edited by hand, or written by another tool, fails here rather than at a launch)."""
        expected = 1
        for launch in self.launches:
            where = f"launch [{launch.m_min}, {launch.m_max}]"
            for name in ("kernels", "sizes", "grids"):
                if not isinstance(getattr(launch, name), dict):
                    self._fail(f"{where} has {name} = {getattr(launch, name)!r}, not an object")
            self._counts(where, [("m_min", launch.m_min, 1), ("m_max", launch.m_max, 1), ("grid_x", launch.grid_x, 1),
                                 ("route_block", launch.route_block, 0)]
                         + [(f"grids[{role!r}]", v, 1) for role, v in launch.grids.items()]
                         + [(f"sizes[{name!r}]", v, 0) for name, v in launch.sizes.items()])
            if not launch.kernels or not all(isinstance(d, str) for d in launch.kernels.values()):
                self._fail(f"{where} names no kernel digests: {launch.kernels!r}")
            if launch.m_min != expected or launch.m_max < launch.m_min:
                self._fail(f"launch ranges must tile 1..max from 1 without gaps, got [{launch.m_min}, "
                           f"{launch.m_max}] after {expected - 1}")
            expected = launch.m_max + 1
        if not self.launches or not self.workspaces:
            self._fail("has no launches or workspaces")
        for ws in self.workspaces:
            if not isinstance(ws.sizes, dict):
                self._fail(f"a workspace has sizes = {ws.sizes!r}, not an object")
            self._counts("a workspace", [("max_tokens", ws.max_tokens, 0), *((n, v, 0) for n, v in ws.sizes.items())])
        if max(ws.max_tokens for ws in self.workspaces) < self.max_tokens:
            self._fail(f"no workspace serves its {self.max_tokens} tokens")

    def _counts(self, where: str, counts) -> None:
        for name, value, least in counts:
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                self._fail(f"{where} has {name} = {value!r}, not an int >= {least}")

    def _fail(self, message: str):
        raise SchemaMismatchError(f"resolution entry {self.problem}/{self.profile}: {message}")


# ------------------------------------------------------------------------------------- the table


class ResolutionTable:
    """The entries of one device profile, by operation and facts."""

    def __init__(self, entries: list[Entry], profile: str, bundle: str):
        self.profile, self.bundle = profile, bundle
        self._by_facts: dict[tuple[str, object], Entry] = {}
        for entry in entries:
            if entry.profile == profile:
                self._by_facts[(entry.op, entry.facts)] = entry

    @classmethod
    def from_manifest(cls, manifest: dict, profile: str) -> "ResolutionTable":
        return cls([Entry.from_json(raw) for raw in manifest["resolution"]], profile, manifest["bundle"])

    def entries(self, op: str) -> list[Entry]:
        return [e for (o, _), e in self._by_facts.items() if o == op]

    def find(self, op: str, facts) -> Entry:
        """The entry for these facts, or UnknownSpecializationError naming the nearest ones."""
        found = self._by_facts.get((op, facts))
        if found is not None:
            return found
        raise UnknownSpecializationError(self._nearest(op, facts))

    def _nearest(self, op: str, facts) -> str:
        wanted = facts.to_json()
        scored = []
        for entry in self.entries(op):
            have = entry.facts.to_json()
            diff = {k: have.get(k) for k in sorted(wanted) if have.get(k) != wanted[k]}
            scored.append((len(diff), entry.problem, diff))
        scored.sort(key=lambda t: (t[0], t[1]))
        lines = [f"  {problem}: differs in {diff}" for _, problem, diff in scored[:3]]
        nearest = "\n".join(lines) if lines else f"  (the bundle has no {op} entries for {self.profile})"
        shown = ", ".join(f"{k}={v}" for k, v in wanted.items())
        return (
            f"bundle {self.bundle!r} has no {op} for {shown} on {self.profile}.\n"
            f"Nearest built:\n{nearest}\n"
            "Add the problem (or option) to the bundle's spec and rebuild it (`cuteaot build SPEC --out DIR`)."
        )
