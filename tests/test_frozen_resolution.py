"""Frozen resolution: the runtime serves what the manifest's table says, never what a planner says.

* the serving path (resolution, MoeLayer construction and calls, the GEMM op's lookup) runs in a
  process where every planning module, and all of codegen, cannot be imported;
* a planner constant edited after the build does not change what is served: the table does;
* a table entry's launches tile 1..max_tokens and the lookup is a binary search over them;
* an old (schema 1) bundle is refused with a message that says to rebuild.
"""

from __future__ import annotations

import copy
import functools

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cuteaot.codegen.kernels.w4a16.fused_planning as fused_planning
import cuteaot.runtime.moe as moe
from cuteaot.codegen.spec import load_spec
from cuteaot.codegen.table import plan_bundle
from cuteaot.runtime.errors import SchemaMismatchError, UnknownSpecializationError
from cuteaot.runtime.manifest import SCHEMA_VERSION, read_manifest
from cuteaot.runtime.resolution import MOE_LAYER, Entry, MoeLayerFacts, ResolutionTable
from tests.stub_bundle import ROOT, StubLaunch, stub_bundle, stub_launches

SPEC = ROOT / "specs" / "tiny-fused.yaml"
FACTS = MoeLayerFacts(dtype="bf16", hidden_size=512, intermediate_size=256, num_experts=16, top_k=4,
                      activation="silu")


def _table(spec_path: Path = SPEC) -> list[dict]:
    return [entry.to_json() for entry in plan_bundle(load_spec(spec_path)).entries]


def test_launch_ranges_tile_every_token_count_and_lookup_is_exact():
    table = ResolutionTable([Entry.from_json(raw) for raw in _table()], "h200", "tiny-fused")
    entry = table.find(MOE_LAYER, FACTS)
    assert entry.launches[0].m_min == 1 and entry.max_tokens == 4096
    for a, b in zip(entry.launches, entry.launches[1:]):
        assert b.m_min == a.m_max + 1
    for launch in entry.launches:
        for m in {launch.m_min, launch.m_max, (launch.m_min + launch.m_max) // 2}:
            assert entry.launch(m) is launch


def test_nearest_entries_are_named_for_an_unbuilt_layer():
    table = ResolutionTable([Entry.from_json(raw) for raw in _table()], "h200", "tiny-fused")
    wanted = MoeLayerFacts(dtype="bf16", hidden_size=512, intermediate_size=256, num_experts=16, top_k=2,
                           activation="silu")
    with pytest.raises(UnknownSpecializationError, match=r"(?s)top_k=2.*tiny-fused-silu: differs in \{'top_k': 4\}"):
        table.find(MOE_LAYER, wanted)


def test_a_planner_change_after_the_build_does_not_change_what_is_served(monkeypatch):
    """The bundle was planned with DECODE_MAX_M = 2; a later planner says 8: the layer still serves 2."""
    built = _table()  # what the build wrote into the manifest
    monkeypatch.setattr(fused_planning, "DECODE_MAX_M", 8)
    replanned = _table()
    assert replanned != built  # the planner now decides otherwise ...
    bundle = stub_bundle()
    bundle.resolution = ResolutionTable([Entry.from_json(raw) for raw in built], "h200", "tiny-fused")
    monkeypatch.setattr(moe, "persistent_launch", StubLaunch)
    layer = moe.MoeLayer(bundle, *_weights(), top_k=4)
    assert [layer.resolve(m).decode for m in (1, 2, 3, 8)] == [True, True, False, False]  # ... the table decides
    assert layer.resolve(5).launch == bundle.resolution.find(MOE_LAYER, FACTS).launch(5)


def _weights():
    from cuteaot.runtime.weights import prepare_w2, prepare_w13
    from tests.reference.nvfp4 import random_nvfp4

    g = torch.Generator().manual_seed(0)
    return prepare_w13(*random_nvfp4(16, 512, 512, g), "bf16"), prepare_w2(*random_nvfp4(16, 512, 256, g), "bf16")


_SERVE_WITHOUT_PLANNERS = textwrap.dedent('''
    import importlib.abc, json, sys, types
    import torch

    class Blocked(importlib.abc.MetaPathFinder):
        """Nothing that plans may be imported by the serving path."""
        def find_spec(self, name, path, target=None):
            if name.startswith("cuteaot.codegen") or name.endswith("planning") or name == "cutlass" \\
                    or name.startswith("cutlass.") or name == "yaml":
                raise ImportError(f"blocked for this test: {name}")
            return None

    sys.meta_path.insert(0, Blocked())
    import cuteaot.runtime.moe as moe
    from cuteaot.runtime.devices import PROFILES
    from cuteaot.runtime.kernels import FAMILIES
    from cuteaot.runtime.resolution import ResolutionTable
    from cuteaot.runtime.weights import pack_nvfp4
    from cuteaot.runtime.workspace import WorkspacePool

    manifest = json.load(open(sys.argv[1]))
    cpu = torch.device("cpu")
    bundle = types.SimpleNamespace(device=cpu, device_index=None, profile=PROFILES["h200"], plans=None,
                                   resolution=ResolutionTable.from_manifest(manifest, "h200"),
                                   workspaces=WorkspacePool(cpu), name="t", id="t")
    calls = []

    class Launch:
        def __init__(self, bundle, digest):
            self.digest, self.kernel = digest, self
            family, facts = manifest["specs"][digest]  # what the bundle's kernel record would give
            self.spec = FAMILIES[family].from_facts(facts)
        def launch(self, grid_x, stream, *values, **named):
            calls.append((self.digest, grid_x))
        def check_grid(self, grid_x):
            assert grid_x >= 1
        def prepare(self, variables, **constants):
            return self

    moe.persistent_launch = Launch
    moe.current_stream_handle = lambda index: 0
    class Step:  # the prepared route packing / top-k sum: record nothing, return the output buffers
        def __init__(self, *args, **buffers):
            self.outputs = (buffers.get("packed"), buffers.get("block_ids"), buffers.get("count"))
        def __call__(self, *args):
            return self.outputs

    moe.PreparedRoutePack = moe.PreparedTopkSum = Step
    moe.moe_activation = lambda *a, **k: calls.append(("activation", None))
    w = lambda n, k: pack_nvfp4(torch.zeros(16, n, k // 2, dtype=torch.uint8),
                                torch.ones(16, n, k // 16).to(torch.float8_e4m3fn), torch.ones(16), "bf16")
    layer = moe.MoeLayer(bundle, w(512, 512), w(512, 256), top_k=4)
    served = []
    for m in (1, 3, 64, 600, 4096):
        x = torch.zeros(m, 512, dtype=torch.bfloat16)
        ids = (torch.arange(m * 4, dtype=torch.int32) % 16).view(m, 4)
        before = len(calls)
        layer(x, torch.full((m, 4), 0.25), ids, out=torch.empty(m, 512, dtype=torch.bfloat16))
        served.append(calls[before:])
    blocked = [n for n in sys.modules if n.startswith("cuteaot.codegen") or n.endswith("planning")]
    print(json.dumps({"served": served, "imported_planners": blocked}))
''')


def test_the_serving_path_runs_with_every_planner_blocked(tmp_path):
    planned = plan_bundle(load_spec(SPEC))
    manifest = {"schema_version": SCHEMA_VERSION, "bundle": "t", "resolution": [e.to_json() for e in planned.entries],
                "specs": {key.digest: [key.family, key.facts] for keys in planned.keys.values() for key in keys}}
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    proc = subprocess.run([sys.executable, "-c", _SERVE_WITHOUT_PLANNERS, str(path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["imported_planners"] == []
    entry = ResolutionTable([Entry.from_json(raw) for raw in manifest["resolution"]], "h200", "t").find(MOE_LAYER,
                                                                                                        FACTS)
    expected = [[[digest, entry.launch(m).grid(role)] for role, digest in entry.launch(m).kernels.items()]
                for m in (1, 3, 64, 600, 4096)]
    assert result["served"] == expected
    assert not entry.launch(1).split and entry.launch(4096).split  # both kinds of launch were served
    # (no activation launch: FC1's gated epilogue applies silu; the served list would show one)


def test_a_schema_1_bundle_is_refused_with_a_rebuild_message(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 1, "bundle": "old"}))
    with pytest.raises(SchemaMismatchError, match="schema_version is 1, this runtime reads 2; rebuild the bundle"):
        read_manifest(tmp_path)


def test_biased_layers_resolve_their_own_kernels_and_pass_the_biases(monkeypatch):
    """specs/tiny-fused.yaml builds the swigluoai layer with and without biases: a layer whose
    weights carry biases finds the bias entry (kernels keyed bias=true) and passes the bias
    pointers to every GEMM phase; without biases the other entry, and no bias is read."""
    from cuteaot.runtime.weights import prepare_w2, prepare_w13
    from tests.reference.nvfp4 import random_nvfp4

    table = ResolutionTable([Entry.from_json(raw) for raw in _table()], "h200", "tiny-fused")
    bundle = stub_bundle()
    bundle.resolution = table
    calls = stub_launches(monkeypatch)  # every launch, its argument names checked against the family's ABI
    g = torch.Generator().manual_seed(1)
    q13, q2 = random_nvfp4(8, 704, 736, g), random_nvfp4(8, 736, 352, g)
    b13, b2 = torch.randn(8, 704).to(torch.bfloat16), torch.randn(8, 736).to(torch.bfloat16)
    plain = moe.MoeLayer(bundle, prepare_w13(*q13, "bf16"), prepare_w2(*q2, "bf16"), top_k=2, activation="swigluoai")
    biased = moe.MoeLayer(bundle, prepare_w13(*q13, "bf16", bias=b13), prepare_w2(*q2, "bf16", bias=b2), top_k=2,
                          activation="swigluoai")
    assert biased.facts.bias and not plain.facts.bias and biased.entry is not plain.entry
    for layer in (plain, biased):
        for m in (1, 37, 4096):
            calls.clear()
            x = torch.zeros(m, 736, dtype=torch.bfloat16)
            ids = (torch.arange(m * 2, dtype=torch.int32) % 8).view(m, 2)
            layer(x, torch.full((m, 2), 0.5), ids, out=torch.empty(m, 736, dtype=torch.bfloat16))
            fused = [c[2] for c in calls if c[0] == "fused"]  # the fused kernel or the two GEMMs
            assert fused
            for values in fused:
                keys = [k for k in values if "bias" in k]
                pointers = {values[k] for k in keys}
                if layer is biased:
                    assert pointers <= {b.data_ptr() for b in (biased.w13_bias, biased.w2_bias)} and pointers
                else:
                    assert not pointers & {b13.data_ptr(), b2.data_ptr()}
    with pytest.raises(UnknownSpecializationError, match=r"differs in \{'bias': False\}"):
        q = random_nvfp4(16, 512, 512, g), random_nvfp4(16, 512, 256, g)
        moe.MoeLayer(bundle, prepare_w13(*q[0], "bf16", bias=torch.zeros(16, 512)), prepare_w2(*q[1], "bf16"),
                     top_k=4)


@pytest.mark.parametrize("edit, message", [
    (lambda launch: launch.update(grid_x=0), r"grid_x = 0, not an int >= 1"),
    (lambda launch: launch.update(grid_x=-3), r"grid_x = -3, not an int >= 1"),
    (lambda launch: launch.update(route_block=2.5), r"route_block = 2.5, not an int >= 0"),
    (lambda launch: launch["sizes"].update(c_tmp=-1), r"sizes\['c_tmp'\] = -1, not an int >= 0"),
    (lambda launch: launch.update(kernels={}), "names no kernel digests"),
    (lambda launch: launch.update(kernels={"fused": 7}), "names no kernel digests"),
    (lambda launch: launch.update(kernels=["x"]), r"kernels = \['x'\], not an object"),
    (lambda launch: launch.update(sizes=5), "sizes = 5, not an object"),
    (lambda launch: launch.update(grids=[]), r"grids = \[\], not an object"),
    (lambda launch: launch.update(m_max="9"), "m_max = '9', not an int"),
])
def test_a_table_with_launch_fields_that_are_not_counts_is_refused(edit, message):
    raw = copy.deepcopy(_silu_entry())
    edit(raw["launches"][1])
    with pytest.raises(SchemaMismatchError, match=message):
        Entry.from_json(raw)


@functools.lru_cache(maxsize=1)
def _silu_entry() -> dict:
    return next(e for e in _table() if e["problem"] == "tiny-fused-silu" and not e["facts"].get("expert_map"))


def test_a_table_without_a_workspace_for_its_largest_launch_is_refused():
    raw = copy.deepcopy(_silu_entry())
    raw["workspaces"] = raw["workspaces"][:1]
    with pytest.raises(SchemaMismatchError, match="no workspace serves its 4096 tokens"):
        Entry.from_json(raw)
