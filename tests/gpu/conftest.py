"""Accuracy reporting of the GPU tests: a fixture collects, the terminal summary reports.

Tests record the worst relative error they saw per case (`worst_errors.record(key, err)`);
after the session pytest prints one table, and with CUTEAOT_RESULTS=<file> it also appends one
JSON line per case ({"test": key, "worst_rel_err": err}; docs/benchmarks.md quotes them).  The
report is a hook, not a test: it cannot pass or fail, so it is not counted as one.
"""

from __future__ import annotations

import json
import os

import pytest


class WorstErrors:
    """The largest relative error recorded per case, in the order the cases were first seen."""

    def __init__(self) -> None:
        self.worst: dict[str, float] = {}

    def record(self, key: str, err: float) -> None:
        self.worst[key] = max(self.worst.get(key, 0.0), float(err))


_WORST = pytest.StashKey[WorstErrors]()


@pytest.fixture(scope="session")
def worst_errors(pytestconfig: pytest.Config) -> WorstErrors:
    """The session's recorder (kept on the config, where the terminal summary finds it)."""
    if _WORST not in pytestconfig.stash:
        pytestconfig.stash[_WORST] = WorstErrors()
    return pytestconfig.stash[_WORST]


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    worst = config.stash[_WORST].worst if _WORST in config.stash else {}
    if not worst:
        return
    terminalreporter.section("worst relative error vs the float32 reference")
    for key, err in worst.items():
        terminalreporter.write_line(f"  {key:32s} {err:.2e}")
    path = os.environ.get("CUTEAOT_RESULTS")
    if path:
        with open(path, "a") as f:
            for key, err in worst.items():
                f.write(json.dumps({"test": key, "worst_rel_err": err}) + "\n")
