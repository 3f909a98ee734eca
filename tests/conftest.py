"""Puts the tests folder on sys.path (pytest's default import mode does it for a folder with a
conftest.py), so every test can import the shared helper config_helpers. Marks the fast subset
(`python -m pytest -m fast`, docs/testing.md) and, where CI asks, writes the slowest tests."""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# The fast subset: these folders (one process, no ranks, no training run)...
FAST_FOLDERS = ("unit", "config")
# ...less their slowest tests (node-id prefixes), measured with --durations: keep the subset
# under 3 minutes on 2 CPU cores.
SLOW = (
    "tests/unit/test_blend.py::test_launch_trains_on_a_blend_and_resumes_its_stream",
    "tests/unit/test_megatron_data.py::test_launch_trains_on_a_megatron_prefix",
    "tests/unit/test_tokenizers.py::test_training_checks_the_vocabulary_and_trains",
    "tests/unit/test_gpu_script.py",
    "tests/config/test_bad_inputs.py",  # 224 command lines, each a process: about 3 minutes
    "tests/unit/test_doc_commands.py::test_a_fence_marked_tested_here_runs_as_shown",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TESTS).parts
        in_folder = len(parts) > 1 and parts[0] in FAST_FOLDERS
        if in_folder and not item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.fast)


def pytest_terminal_summary(terminalreporter):
    """With GTP_DURATIONS_FILE set (.ci/run sets it), the 50 slowest tests, each test's setup,
    call and teardown summed, go to that file as well as to the log's --durations list."""
    path = os.environ.get("GTP_DURATIONS_FILE")
    if not path:
        return
    seconds: dict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if hasattr(report, "duration") and hasattr(report, "nodeid"):
                seconds[report.nodeid] += report.duration
    slowest = sorted(seconds.items(), key=lambda item: -item[1])[:50]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(f"{s:8.2f}s  {nodeid}\n" for nodeid, s in slowest))
    terminalreporter.write_line(f"the 50 slowest tests: {path}")
