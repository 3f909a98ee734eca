"""The benchmark figures people read are one run's: bench/results.json's table is what
bench/table.py makes of its figures, docs/benchmarks.md's table is that table, and the run was
of a commit."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import table  # noqa: E402  (bench/table.py: no torch)

RESULTS = json.loads((ROOT / "bench" / "results.json").read_text())


def test_the_table_in_results_is_made_from_its_figures():
    assert RESULTS["table"] == table.rows(RESULTS["figures"])


def test_the_benchmarks_page_shows_the_table_of_results():
    assert table.page_section(table.PAGE.read_text()) == table.markdown(RESULTS)
    assert table.BEGIN not in (ROOT / "README.md").read_text()  # one table, on its page


def test_the_run_was_of_a_commit():
    assert RESULTS["commit"] and "uncommitted" not in RESULTS["commit"], RESULTS["commit"]
    assert RESULTS["measured"].endswith("UTC")


@pytest.mark.parametrize("value,goal,expected", [
    (1.04, "<= 1.05", True), (1.06, "<= 1.05", False), (50, ">= 50", True),
    (49.9, ">= 50", False), (4.99, "< 5 s", True), (5.0, "< 5 s", False),
    (0.8, "0.8-1.2", True), (1.21, "0.8-1.2", False), (1.004, "1.00", True),
    (1.006, "1.00", False), (0.5, "0.50", True), (0.93, "-", None),
])
def test_a_goal_is_met_or_not(value, goal, expected):
    assert table.met(value, goal) is expected
