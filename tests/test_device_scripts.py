"""The device scripts name GPU tests by pytest node id (benchmarks/scripts/*.sh, e.g. the racecheck list of
`serving_session.sh layers`): a test renamed or reparametrized here would leave a device call running nothing for
that id, so every id they name must be one that pytest collects."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks" / "scripts").glob("*.sh"))
ASSIGNMENT = re.compile(r"(?<![\w$])([A-Z])=([^\s;]+)")  # the scripts' one-letter path variables: T=tests/gpu; F=$T/...
NODE_ID = re.compile(r"(\$[A-Z]::[^\s\"']+|(?:\$[A-Z]|tests/)[^\s\"':]*\.py::[^\s\"']+)")  # $F::test, tests/...py::test


def named_node_ids(script: Path) -> set[str]:
    text = script.read_text()
    variables: dict[str, str] = {}

    def expand(word: str) -> str:
        return re.sub(r"\$([A-Z])", lambda m: variables.get(m[1], m[0]), word)

    for name, value in ASSIGNMENT.findall(text):
        variables[name] = expand(value)
    return {expand(node) for node in NODE_ID.findall(text)}


def test_the_parser_reads_the_racecheck_list():
    ids = named_node_ids(ROOT / "benchmarks" / "scripts" / "serving_session.sh")
    assert "tests/gpu/test_moe_fused_gpu.py::test_nvfp4_nf3_hybrid_layer" in ids
    assert "tests/gpu/test_moe_fused_gpu.py::test_gated_fc1_epilogue[silu-bf16]" in ids
    assert not [i for i in ids if "$" in i], ids


def test_every_node_id_a_device_script_names_is_collected():
    named = {node: script.name for script in SCRIPTS for node in named_node_ids(script)}
    assert named
    files = sorted({node.split("::")[0] for node in named})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    collected = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    missing = sorted(f"{node} ({script})" for node, script in named.items() if node not in collected)
    assert not missing, f"node ids no test answers to: {missing}\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
