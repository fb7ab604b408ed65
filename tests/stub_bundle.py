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

from cuteaot.codegen.spec import load_spec
from cuteaot.codegen.table import plan_bundle
from cuteaot.runtime.bundle import PreparedLaunch
from cuteaot.runtime.devices import PROFILES
from cuteaot.runtime.kernels.w4a16.fused_spec import FusedSpec
from cuteaot.runtime.kernels.w4a16.gemm_spec import GemmSpec
from cuteaot.runtime.plans import BundlePlans
from cuteaot.runtime.resolution import Entry, ResolutionTable
from cuteaot.runtime.workspace import WorkspacePool

ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def _entries(spec_path: str) -> tuple[Entry, ...]:
    return tuple(plan_bundle(load_spec(spec_path)).entries)


def stub_bundle(spec_path: str | Path = ROOT / "specs" / "tiny-fused.yaml", profile: str = "h200"):
    """A bundle-shaped namespace whose resolution table is the spec's, planned for `profile`."""
    cpu = torch.device("cpu")
    table = ResolutionTable(list(_entries(str(spec_path))), profile, "stub")
    return types.SimpleNamespace(device=cpu, device_index=None, profile=PROFILES[profile], resolution=table,
                                 plans=BundlePlans(), workspaces=WorkspacePool(cpu), name="stub", id="stub")


class StubLaunch:
    """PersistentLaunch without a driver: checks each launch's argument names against its family's
    declaration (as LoadedKernel does) and records it in `calls` instead of issuing it."""

    calls: list = []

    def __init__(self, bundle, digest: str):
        self.digest, self.kernel = digest, self

    def launch(self, grid_x, stream, /, **values):
        (GemmSpec if "qweight" in values else FusedSpec).SIGNATURE.order(values)
        type(self).calls.append(("fused", grid_x, values))

    # the fused kernel's prepared launches (MoeLayer) run the runtime's own PreparedLaunch on this stub
    _signature = FusedSpec.SIGNATURE

    def prepare(self, variables, **constants):
        return PreparedLaunch(self, variables, constants)

    def _issue(self, grid_x, stream, ordered):
        type(self).calls.append(("fused", grid_x, dict(zip(self._signature.names, ordered, strict=True))))
