"""The `cuteaot` command line without CuTeDSL or a GPU (issue 17, items 6 and 10)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from cuteaot.codegen.cli import LINE_WIDTH, _parser
from cuteaot.codegen.cli import main as cli
from cuteaot.runtime.manifest import SCHEMA_VERSION
from tests.handmade_bundle import SYMBOL, long_facts, read, write_bundle

# A serving machine: torch + cuda-bindings + cuteaot, but neither PyYAML nor CuTeDSL.  The
# blocker refuses those imports, then runs the CLI as `python -m cuteaot.codegen.cli` would.
SERVING_MACHINE = """
import runpy, sys
EXTRA = ("yaml", "cutlass")
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in EXTRA:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: serving machine)", name=name)
        return None
for loaded in [m for m in sys.modules if m.partition(".")[0] in EXTRA]:
    del sys.modules[loaded]
sys.meta_path.insert(0, Blocker())
runpy.run_module("cuteaot.codegen.cli", run_name="__main__", alter_sys=True)
"""


def _serving(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SERVING_MACHINE, *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def bundle(tmp_path):
    return write_bundle(tmp_path / "out" / "handmade")


def test_verify_and_inspect_run_without_yaml_and_cutlass(bundle):
    proc = _serving("verify", str(bundle))
    assert proc.returncode == 0, proc.stderr
    assert "OK — schema 2, 6 cubins match their sha256, 0 resolution entries resolve" in proc.stdout
    proc = _serving("inspect", str(bundle))
    assert proc.returncode == 0, proc.stderr
    assert "sm_90a: 2 kernels" in proc.stdout
    proc = _serving("inspect", "--plans", str(bundle))  # the plans read runtime modules only, too
    assert proc.returncode == 0, proc.stderr
    assert "no resolution entries (the bundle's problems: none)" in proc.stdout


def test_build_without_the_codegen_extra_says_what_to_install(tmp_path):
    proc = _serving("build", "specs/tiny.yaml", "--out", str(tmp_path))
    assert proc.returncode == 1
    assert "cuteaot build: needs the codegen extra (module 'yaml' is not installed)" in proc.stderr
    assert "pip install 'cuteaot[codegen]'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("jobs", ["0", "-1", "two"])
def test_jobs_must_be_a_positive_count(jobs, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["build", "specs/tiny.yaml", f"--jobs={jobs}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: cuteaot build" in err
    assert f"cuteaot build: error: argument --jobs/-j: expected a number of worker processes (1 or more), got" in err


@pytest.mark.parametrize("shard", ["abc", "4/4", "1/0", "-1/4", "1/"])
def test_shard_errors_name_the_command_and_the_option(shard, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["build", "specs/tiny.yaml", f"--shard={shard}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: cuteaot build" in err and "cuteaot build: error: argument --shard: expected i/N" in err
    assert repr(shard) in err


def test_valid_jobs_and_shard_parse():
    args = _parser().parse_args(["build", "specs/tiny.yaml", "-j", "3", "--shard", "1/4"])
    assert args.jobs == 3 and args.shard == (1, 4)
    assert _parser().parse_args(["build", "specs/tiny.yaml"]).jobs is None


def test_version_prints_package_and_schema_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"cuteaot \S.*, manifest schema_version {SCHEMA_VERSION}", out), out


def test_verify_of_a_folder_without_manifest_says_how_to_build(tmp_path, capsys):
    empty = tmp_path / "not-a-bundle"
    empty.mkdir()
    assert cli(["verify", str(empty)]) == 1
    err = capsys.readouterr().err
    assert f"cuteaot verify: BundleNotFoundError: {empty} has no manifest.json" in err
    assert "cuteaot build SPEC --out DIR" in err and "make kernels" not in err


def test_verify_of_the_output_root_names_the_bundles_in_it(bundle, capsys):
    assert cli(["verify", str(bundle.parent)]) == 1
    err = capsys.readouterr().err
    assert f"{bundle.parent} has no manifest.json" in err and str(bundle) in err


def test_inspect_orders_arches_by_compute_capability(bundle, capsys):
    assert cli(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    headings = re.findall(r"^(sm_\w+): \d+ kernels", out, flags=re.M)
    assert headings == ["sm_90a", "sm_100a", "sm_120a"]


def test_inspect_lines_fit_and_rows_are_told_apart_by_key(bundle, capsys):
    assert cli(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= LINE_WIDTH
    for k in read(bundle)["kernels"]:  # every kernel's key prefix and family lead its row
        assert re.search(rf"^{k['key'][:12]}  {k['family']} ", out, flags=re.M)
    assert SYMBOL[:30] not in out  # the symbol is the same for all; it is not a column
    assert "cuteaot inspect -v" in out  # the facts were cut: say where the full ones are


def test_inspect_verbose_prints_full_facts_and_symbol_wrapped(bundle, capsys):
    assert cli(["inspect", "-v", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= LINE_WIDTH
    wrapped = out.replace("\n" + " " * 8, "\0")  # continuation lines are indented by 8
    facts = " ".join(f"{k}={v}" for k, v in sorted(long_facts(1).items()))
    assert f"    facts: {facts}\n" in wrapped.replace("\0", " ")  # facts wrap between words
    assert f"    symbol: {SYMBOL}\n" in wrapped.replace("\0", "")  # a symbol is one long word
    for k in read(bundle)["kernels"]:
        assert k["file"] in out


@pytest.mark.parametrize("spec_name", ["tiny-gemm.yaml", "tiny-fused.yaml"])
def test_plans_of_a_planned_table_cover_every_entry_and_token_range(spec_name):
    """`inspect --plans` on the spec's own table (the build's planner, nothing compiled): one block per entry,
    GEMM entries (routes and each variant's main loop) and every layer variant (its options in the title)."""
    pytest.importorskip("yaml", reason="planning reads the spec (cuteaot[codegen])")
    from cuteaot.codegen.cli import _plans
    from cuteaot.codegen.spec import load_spec
    from cuteaot.codegen.table import plan_bundle
    from tests.conftest import ROOT

    spec = load_spec(ROOT / "specs" / spec_name)
    planned = plan_bundle(spec)
    manifest = {
        "targets": [{"name": t.name, "arch": t.arch} for t in spec.targets],
        "kernels": [{"arch": arch, "key": key.digest, "family": key.family, "facts": dict(key.facts)}
                    for arch, keys in planned.keys.items() for key in keys],
        "resolution": [entry.to_json() for entry in planned.entries],
    }
    text, found = _plans(manifest, None)
    assert found
    blocks = text.split("\n\n")
    assert len(blocks) == len(planned.entries)
    for block, entry in zip(blocks, planned.entries):
        title, _, _, *rows = block.splitlines()
        assert title.startswith(f"{entry.problem} on {entry.profile} ("), title
        assert [row.split(None, 1)[0] for row in rows] == [
            f"{x.m_min}" if x.m_min == x.m_max else f"{x.m_min}-{x.m_max}" for x in entry.launches]
        for row, launch in zip(rows, entry.launches):
            plan = row.split(None, 1)[1]
            if entry.op == "gemm":
                assert plan.startswith("direct routes" if launch.direct else f"b{launch.route_block} "), row
            else:
                assert plan.split()[0] in ("decode", "micro", "packed", "split"), row
        facts = entry.facts.to_json()
        for option in ("expert_map", "calibration", "deterministic", "bias", "router_weight_on_input"):
            assert (f" {option}" in title) == bool(facts.get(option)), (option, title)
    # a shard (kernels elsewhere), a kernel of a family this cuteaot lacks, kernels in the wrong roles: said
    # in the row, never a traceback
    first = planned.entries[0].launches[0]
    digests = list(first.kernels.values())
    shard = dict(manifest, shard={"index": 0, "count": 2},
                 kernels=[k for k in manifest["kernels"] if k["key"] != digests[0]])
    assert f"kernel {digests[0][:12]} is not in this shard" in _plans(shard, None)[0]
    renamed = dict(manifest, kernels=[dict(k, family="w4a16_next") if k["key"] == digests[0] else k
                                      for k in manifest["kernels"]])
    assert "kernel family 'w4a16_next' is unknown to this cuteaot" in _plans(renamed, None)[0]
    emptied = dict(manifest, kernels=[dict(k, facts={}) if k["key"] == digests[0] else k
                                      for k in manifest["kernels"]])
    assert "the table's kernels do not fit this launch" in _plans(emptied, None)[0]
    text, found = _plans(manifest, ["nope"])
    assert not found and text.startswith("no resolution entries for nope (the bundle's problems: ")
    text, found = _plans(manifest, [spec.moe[0].name, "nope"])  # one known, one not: both said
    assert not found and text.startswith(f"{spec.moe[0].name} on ") and "no resolution entries for nope" in text


def test_verify_of_the_manifest_file_says_to_pass_its_folder(bundle, capsys):
    assert cli(["verify", str(bundle / "manifest.json")]) == 1
    assert f"{bundle / 'manifest.json'} is a file; pass the bundle folder that holds manifest.json ({bundle})" in \
        capsys.readouterr().err


def test_problem_needs_plans_and_an_unknown_problem_fails(bundle, capsys):
    with pytest.raises(SystemExit) as exc:
        cli(["inspect", "--problem", "x", str(bundle)])
    assert exc.value.code == 2 and "--problem selects entries of --plans; add --plans" in capsys.readouterr().err
    assert cli(["inspect", "--plans", "--problem", "x", str(bundle)]) == 1
    assert "no resolution entries for x" in capsys.readouterr().out


def test_inspect_into_a_closed_pipe_ends_quietly(bundle):
    """`cuteaot inspect ... | head -1`: no BrokenPipeError traceback once the reader has gone."""
    shell = f"{sys.executable} -m cuteaot.codegen.cli inspect -v {bundle} | head -1"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", shell], capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("bundle ") and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_help_shows_the_flow_and_every_positional_says_what_it_is(capsys):
    with pytest.raises(SystemExit):
        cli(["--help"])
    text = capsys.readouterr().out
    assert "cuteaot spec path/to/model -o specs/my-model.yaml" in text and "imports nothing else" not in text
    for command in ("build", "list", "merge", "inspect", "verify"):
        with pytest.raises(SystemExit):
            cli([command, "--help"])
        text = capsys.readouterr().out
        positional = text.split("positional arguments:")[1].split("options:")[0]
        assert all(len(line.split(None, 1)) == 2 for line in positional.strip().splitlines()), (command, positional)
