"""A stand-in for a loaded bundle on the CPU: the real resolution table of a spec, no driver.

Runtime code under test (MoeLayer construction, resolution, validation, workspaces) reads the
bundle's `resolution`, `profile`, `device`, `plans` and `workspaces`; the table comes from the
build's own planner (codegen/table.py) for the spec, as a built bundle's manifest would hold it.
Kernel launches are replaced by `StubLaunch`.
"""

from __future__ import annotations

import functools
import types
from pathlib import Path

import torch

from cuteaot.codegen.enumerate import kernel_keys
from cuteaot.codegen.spec import load_spec
from cuteaot.codegen.table import plan_bundle
from cuteaot.runtime.abi import ArgBuffer
from cuteaot.runtime.bundle import LaunchState, PreparedLaunch
from cuteaot.runtime.devices import PROFILES
from cuteaot.runtime.errors import UnknownSpecializationError
from cuteaot.runtime.kernels.w4a16.fused_spec import FusedSpec
from cuteaot.runtime.kernels import FAMILIES
from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec
from cuteaot.runtime.plans import BundlePlans
from cuteaot.runtime.resolution import Entry, ResolutionTable
from cuteaot.runtime.workspace import WorkspacePool

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def _planned(spec_path: str) -> tuple[tuple[Entry, ...], dict]:
    """The spec's table entries, and the spec of every kernel they name by digest."""
    planned = plan_bundle(load_spec(spec_path))
    specs = {key.digest: FAMILIES[key.family].from_facts(key.facts) for keys in planned.keys.values() for key in keys}
    return tuple(planned.entries), specs


def stub_bundle(spec_path: str | Path = ROOT / "specs" / "tiny-fused.yaml", profile: str = "h200"):
    """A bundle-shaped namespace whose resolution table is the spec's, planned for `profile`."""
    cpu = torch.device("cpu")
    entries, specs = _planned(str(spec_path))
    table = ResolutionTable(list(entries), profile, "stub")
    helpers = {key.digest for key in kernel_keys(load_spec(str(spec_path)))}  # what the build makes besides

    def kernel(key):  # a loaded helper kernel (the top-k sums a layer checks for), as Bundle.kernel finds it
        if key.digest not in helpers:
            raise UnknownSpecializationError(f"stub bundle: no kernel {key.describe()}")
        return key

    return types.SimpleNamespace(device=cpu, device_index=None, profile=PROFILES[profile], resolution=table,
                                 plans=BundlePlans(), workspaces=WorkspacePool(cpu), name="stub", id="stub",
                                 specs=specs, kernel=kernel, gemm_workspaces={}, captured_gemm_workspaces=[],
                                 launch_state=LaunchState())


class _IssuesPacked:
    """A stub kernel's side of the runtime's prepared launches: a plain argument buffer per thread, and the
    launch of a filled one recorded through the stub's `_issue` with what the driver would read from it."""

    def _new_thread_buffer(self):
        return ArgBuffer(self._signature)

    def _issue_packed(self, grid_x, stream, buffer):
        self._issue(grid_x, stream, buffer.values())


class StubLaunch(_IssuesPacked):
    """PersistentLaunch without a driver: checks each launch's argument names against its family's
    declaration (as LoadedKernel does) and records it in `calls` instead of issuing it."""

    calls: list = []

    def __init__(self, bundle, digest: str):
        self.digest, self.kernel = digest, self
        self.spec = None if bundle is None else bundle.specs[digest]  # as the bundle's record would give it

    def check_grid(self, grid_x):  # PersistentLaunch's, against no GPU: a count at least
        assert isinstance(grid_x, int) and grid_x >= 1, grid_x

    def launch(self, grid_x, stream, /, **values):
        (GemmSpec if "qweight" in values else FusedSpec).SIGNATURE.order(values)
        type(self).calls.append(("fused", grid_x, values))

    # the fused kernel's prepared launches (MoeLayer) run the runtime's own PreparedLaunch on this stub
    _signature = FusedSpec.SIGNATURE

    def prepare(self, variables, **constants):
        return PreparedLaunch(self, variables, constants)

    def _issue(self, grid_x, stream, ordered):
        type(self).calls.append(("fused", grid_x, dict(zip(self._signature.names, ordered, strict=True))))


class RecordingKernel(_IssuesPacked):
    """A LoadedKernel without a driver: its by-name (`launch`) and prepared (`prepare`) launch paths
    run as in the runtime, and each launch is recorded in `issued` as (tag, grid, values in
    declaration order) instead of being issued."""

    waits_on_grid = False

    def __init__(self, issued: list, tag=None, block=(512, 1, 1)):
        self.issued, self.tag, self.block = issued, tag, block

    def mark_waits_on_grid(self):
        self.waits_on_grid = True

    def bind(self, signature):
        self._signature = signature

    def launch(self, grid_x, stream, /, **values):
        self.issued.append((self.tag, grid_x, self._signature.order(values)))

    def prepare(self, variables, **constants):
        return PreparedLaunch(self, variables, constants)

    def _issue(self, grid_x, stream, ordered):
        self.issued.append((self.tag, grid_x, tuple(ordered)))


class StubRoutePack:
    """PreparedRoutePack without a driver: records ("pack_routes", ids shape, block) in StubLaunch.calls."""

    def __init__(self, bundle, topk_ids, num_experts, block_size, *, expert_map, packed, block_ids, count, workspace):
        self.block_size, self.outputs = block_size, (packed, block_ids, count)

    def __call__(self, topk_ids, stream):
        StubLaunch.calls.append(("pack_routes", tuple(topk_ids.shape), self.block_size))
        return self.outputs


class StubTopkSum:
    """PreparedTopkSum without a driver: records ("topk_sum", fc2 shape) in StubLaunch.calls, with
    "accumulate" appended for the accumulating variant."""

    def __init__(self, bundle, fc2, out, topk_ids, num_experts, accumulate=False):
        self.fc2_shape, self.accumulate = tuple(fc2.shape), accumulate

    def __call__(self, out, topk_ids, stream):
        StubLaunch.calls.append(("topk_sum", self.fc2_shape) + (("accumulate",) if self.accumulate else ()))


class StubZeroFill:
    """ZeroFill without a driver: records ("zero", address, words) in StubLaunch.calls."""

    def __init__(self, address, words):
        self.address, self.words = address, words

    def issue(self, stream):
        StubLaunch.calls.append(("zero", self.address, self.words))


def stub_launches(monkeypatch) -> list:
    """Replace MoeLayer's kernel launches (fused or GEMM, route packing, top-k sum, activation, the
    output's zeroing) by recorders; returns the list they append to."""
    from cuteaot.runtime import moe

    calls: list = []
    monkeypatch.setattr(StubLaunch, "calls", calls)
    monkeypatch.setattr(moe, "persistent_launch", StubLaunch)
    monkeypatch.setattr(moe, "current_stream_handle", lambda index: 0)
    monkeypatch.setattr(moe, "PreparedRoutePack", StubRoutePack)
    monkeypatch.setattr(moe, "PreparedTopkSum", StubTopkSum)
    monkeypatch.setattr(moe, "ZeroFill", StubZeroFill)
    monkeypatch.setattr(moe, "moe_activation", lambda bundle, fc1, out, **kw: calls.append(("activation", fc1.shape)))
    return calls

