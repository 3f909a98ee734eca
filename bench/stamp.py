"""Where a benchmark's figures come from: the commit (marked when the working tree differs from
it), the time and the machine. bench/run.py stamps results.json with them, and bench/gpu_mfu.py
its own file (a GPU's figures are never part of a CPU run's results)."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    """HEAD's commit, marked when the working tree differs from it (then the figures are of
    code that no commit holds)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short=12", "HEAD") + (" (with uncommitted changes)" if dirty else "")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machine() -> str:
    return f"{platform.machine()}, {platform.python_version()}, {os.cpu_count()} CPUs"
