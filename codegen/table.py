"""The resolution table: plan every token count of a spec once, at build time.

For each device profile and problem of a spec this runs the planners for every M
from 1 to the largest token bucket, merges consecutive token counts with the same
decision into one launch range, and records the buffer sizes each token bucket
needs.  The result is written into the manifest (runtime/resolution.py reads it)
and names every planned kernel, so enumeration and the table are one pass and can
never disagree.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional

from cuteaot.runtime.devices import DeviceProfile
from cuteaot.runtime.keys import KernelKey
from cuteaot.runtime.kernels.w4a16.geometry import BARRIER_WORDS
from cuteaot.runtime.errors import SpecError
from cuteaot.runtime.resolution import GEMM, MOE_LAYER, Entry, GemmFacts, Launch, Workspace, gemm_variant
from cuteaot.runtime.types import Activation, DType

from .kernels.w4a16.fused_planning import fused_spec_for, plan_layer, split_layer
from .kernels.w4a16.planning import gemm_spec_for, plan_for, tables_of
from .spec import BundleSpec, MoeProblem


@dataclass
class PlannedBundle:
    """The table entries of a spec and the kernel keys they name, per architecture."""

    entries: list[Entry] = field(default_factory=list)
    keys: dict[str, set[KernelKey]] = field(default_factory=dict)
    file: str = "spec"  # the spec's, for errors
    _problems: dict = field(default_factory=dict)  # (profile, op, facts) -> the problem that planned it

    def add(self, entry: Entry, keys: set[KernelKey], arch: str) -> None:
        """Record an entry; two problems may not plan the same layer (the runtime looks entries up by their
        facts, so the later one's token range would silently replace the earlier one's)."""
        where = (entry.profile, entry.op, entry.facts)
        first = self._problems.setdefault(where, entry.problem)
        if first != entry.problem:
            raise SpecError(self.file, None, "moe", f"problems {first!r} and {entry.problem!r} describe the same "
                            f"{entry.op} layer on {entry.profile} ({entry.facts}); make them one problem with "
                            "both problems' token buckets")
        self.entries.append(entry)
        self.keys.setdefault(arch, set()).update(keys)


@dataclass
class _Ranges:
    """Consecutive token counts with one decision, and the buffer sizes of each token bucket."""

    buckets: tuple[int, ...]
    launches: list[Launch] = field(default_factory=list)
    workspaces: list[Workspace] = field(default_factory=list)
    _peak: dict[str, int] = field(default_factory=dict)

    def add(self, m: int, decision: tuple, kernels: dict[str, str], sizes: dict[str, int],
            grids: dict[str, int] | None = None) -> None:
        """Record M's decision (grid_x, route_block), kernels and other roles' grids; `sizes` are what M needs."""
        last = self.launches[-1] if self.launches else None
        grid_x, route_block = decision
        grids = grids or {}
        if last is not None and (last.grid_x, last.route_block, dict(last.kernels), dict(last.grids)) == (
                grid_x, route_block, kernels, grids):
            self.launches[-1] = Launch(last.m_min, m, grid_x, route_block, kernels, sizes, grids)
        else:
            self.launches.append(Launch(m, m, grid_x, route_block, kernels, sizes, grids))
        for name, value in sizes.items():
            self._peak[name] = max(self._peak.get(name, 0), value)
        if m in self.buckets:
            self.workspaces.append(Workspace(m, dict(self._peak)))


def plan_bundle(spec: BundleSpec, progress: Optional[Callable[[str], None]] = None) -> PlannedBundle:
    """Every entry of the spec's resolution table; `progress(line)` hears one line per planned problem."""
    planned = PlannedBundle(file=spec.file)
    total = len(spec.targets) * sum(bool(p.gemm) + bool(p.fused) for p in spec.moe)
    count = itertools.count(1)
    for profile in spec.targets:
        for problem in spec.moe:
            for op, entries in ((GEMM, _gemm_entries), (MOE_LAYER, _moe_layer_entries)):
                if not (problem.gemm if op == GEMM else problem.fused):
                    continue
                if progress:
                    kind = "fused" if op == MOE_LAYER else "gemm"
                    lender = "" if op != MOE_LAYER else "; " + tables_of(
                        problem.hidden_size, problem.intermediate_size, problem.num_experts, problem.top_k,
                        problem.activation.is_gated, profile)
                    progress(f"planning {spec.bundle}: problem {next(count)}/{total} {kind} {problem.name} on "
                             f"{profile.name}, 1..{problem.tokens[-1]} tokens{lender}")
                for entry, keys in entries(problem, profile):
                    planned.add(entry, keys, profile.arch)
    return planned


# ------------------------------------------------------------------------------------- MoE layer


def _moe_layer_entries(problem: MoeProblem, profile: DeviceProfile) -> Iterator[tuple[Entry, set[KernelKey]]]:
    seen = set()
    for facts in problem.layer_facts():
        if facts in seen:  # relu2 normalises fast_math away: one entry for both spec values
            continue
        seen.add(facts)
        ranges, keys, specs = _Ranges(problem.tokens), set(), {}
        for m in range(1, problem.tokens[-1] + 1):
            split = split_layer(m, facts, profile)
            if split is not None:
                _add_split(ranges, keys, specs, m, split)
                continue
            plan = plan_layer(m, facts, profile)
            # the plan without its per-M launch facts decides the kernel (any field added later counts)
            decided = replace(plan, m=0, grid_x=0, max_route_slots=0, max_route_blocks=0, micro_sums=0)
            key = specs.get(decided)
            if key is None:
                key = specs[decided] = fused_spec_for(plan, facts).key()
                keys.add(key)
            sizes = {"c_tmp_floats": plan.c_tmp_floats, "lock_words": plan.lock_words,
                     "route_slots": plan.max_route_slots, "route_blocks": plan.max_route_blocks}
            ranges.add(m, (plan.grid_x, 0 if plan.decode else plan.moe_block_size), {"fused": key.digest}, sizes)
        yield _entry(MOE_LAYER, problem, profile, facts, ranges), keys


def _add_split(ranges: _Ranges, keys: set, specs: dict, m: int, split) -> None:
    """Record M as two grouped-GEMM launches (FC1, FC2) with the layer's activation between them."""
    fc1, fc2 = split
    decided = (fc1.spec, fc2.spec)  # the kernels themselves (split_layer made them)
    found = specs.get(decided)
    if found is None:
        found = specs[decided] = {"fc1": fc1.spec.key(), "fc2": fc2.spec.key()}
        keys.update(found.values())
    sizes = {"c_tmp_floats": max(fc1.plan.splitk_scratch_floats, fc2.plan.splitk_scratch_floats),
             "lock_words": BARRIER_WORDS + max(fc1.plan.lock_slots, fc2.plan.lock_slots),  # slots after the barrier
             "route_slots": fc1.plan.max_route_slots, "route_blocks": fc1.plan.max_route_blocks}
    kernels = {role: key.digest for role, key in found.items()}
    grids = {} if fc2.plan.grid_x == fc1.plan.grid_x else {"fc2": fc2.plan.grid_x}
    ranges.add(m, (fc1.plan.grid_x, fc1.plan.moe_block_size), kernels, sizes, grids)


# ------------------------------------------------------------------------------------- GEMM


def _gemm_roles(problem: MoeProblem) -> list[tuple[int, int, tuple[bool, bool, str]]]:
    """(N, K, (a_per_route, mul_topk_weights, epilogue)) of the layer's two GEMMs: FC1 (relu2 in its
    epilogue) and FC2 (route rows in, router weights applied)."""
    relu2 = problem.activation is Activation.RELU2
    return [
        (problem.fc1_n, problem.hidden_size, (False, False, "relu2" if relu2 else "none")),
        (problem.hidden_size, problem.intermediate_size, (True, True, "none")),
    ]


def _gemm_entries(problem: MoeProblem, profile: DeviceProfile) -> Iterator[tuple[Entry, set[KernelKey]]]:
    by_facts: dict[GemmFacts, list[tuple[bool, bool, str]]] = {}
    for dtype in problem.dtypes:
        for n, k, flags in _gemm_roles(problem):
            facts = GemmFacts(dtype=dtype, n=n, k=k, top_k=problem.top_k, num_experts=problem.num_experts)
            by_facts.setdefault(facts, []).append(flags)
    for facts, roles in by_facts.items():
        ranges, keys, specs = _Ranges(problem.tokens), set(), {}
        for m in range(1, problem.tokens[-1] + 1):
            plan = plan_for(m, facts.n, facts.k, facts.top_k, facts.num_experts, profile)
            decided = (plan.moe_block_size, plan.direct_topk_routes, plan.tile, plan.blocks_per_sm,
                       plan.whole_tiles_m8, plan.mainloop)
            kernels = specs.get(decided)
            if kernels is None:
                found = {gemm_variant(*flags): _gemm_key(plan, facts, flags) for flags in roles}
                keys.update(found.values())
                kernels = specs[decided] = {variant: key.digest for variant, key in found.items()}
            sizes = {"c_tmp_floats": plan.splitk_scratch_floats, "lock_slots": plan.lock_slots,
                     "route_slots": plan.max_route_slots, "route_blocks": plan.max_route_blocks}
            ranges.add(m, (plan.grid_x, 0 if plan.direct_topk_routes else plan.moe_block_size), kernels, sizes)
        yield _entry(GEMM, problem, profile, facts, ranges), keys


def _gemm_key(plan, facts: GemmFacts, flags: tuple[bool, bool, str]) -> KernelKey:
    a_per_route, mul_topk_weights, epilogue = flags
    spec = gemm_spec_for(plan, DType(facts.dtype), facts.n, facts.k, facts.top_k, a_per_route=a_per_route,
                         mul_topk_weights=mul_topk_weights, epilogue=epilogue)
    return spec.key()


def _entry(op: str, problem: MoeProblem, profile: DeviceProfile, facts, ranges: _Ranges) -> Entry:
    entry = Entry(op, profile.name, problem.name, facts, tuple(ranges.launches), tuple(ranges.workspaces))
    entry.check()
    return entry
