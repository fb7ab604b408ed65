"""A stand-in for a loaded bundle on the CPU: the real resolution table of a spec, no driver.

Runtime code under test (MoeLayer construction, resolution, validation, workspaces) reads the
bundle's `resolution`, `profile`, `device`, `plans` and `workspaces`; the table comes from the
build's own planner (codegen/table.py) for the spec, as a built bundle's manifest would hold it.
Kernel launches are replaced by `RecordedLaunch`.
"""

from __future__ import annotations

import functools
import types
from pathlib import Path

import torch

from cuteaot.codegen.spec import load_spec
from cuteaot.codegen.table import plan_bundle
from cuteaot.runtime.devices import PROFILES
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


class RecordedLaunch:
    """PersistentLaunch without a driver: records launches (by name) in `calls` instead of issuing them."""

    calls: list = []

    def __init__(self, bundle, digest: str):
        self.digest = digest
        self.spec = types.SimpleNamespace(mainloop=types.SimpleNamespace(value="?"), fc1_tile_n=0, fc1_tile_k=0,
                                          fc2_tile_n=0, fc2_tile_k=0)
        self.kernel = self

    def launch(self, grid_x, stream, /, **values):
        type(self).calls.append(("fused", grid_x, values))
