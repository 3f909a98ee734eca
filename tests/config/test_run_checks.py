"""The checks of a plain run that Hydra's own steps would otherwise pass by or turn into a
traceback, made by the callback in trainer/compose/callbacks.py before Hydra creates the run
folder: a run folder that cannot be written, and hydra/launcher=... without -m (which Hydra
ignores: the run would train here). One line, exit code 1, torch never imported.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from config_helpers import ROOT
from disk_helpers import tmpfs


def launch(no_torch: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join([str(no_torch), str(ROOT)])
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args, "dry_run=true"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def one_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "torch imported" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Fix:" in lines[0], out.stderr
    return lines[0]


@pytest.fixture
def read_only(tmp_path) -> Path:
    """A read-only tmpfs: the tests run as root, whom chmod does not stop."""
    with tmpfs(tmp_path / "ro", "ro,size=1m") as folder:
        yield folder


def test_a_run_folder_on_a_read_only_file_system_is_one_line(no_torch, read_only):
    line = one_line(launch(no_torch, f"hydra.run.dir={read_only}/run"))
    assert f"hydra.run.dir={read_only}/run" in line and "can write" in line


def test_a_run_folder_where_nothing_can_be_made_is_one_line(no_torch):
    line = one_line(launch(no_torch, "hydra.run.dir=/proc/forbidden/run"))
    assert "hydra.run.dir=/proc/forbidden/run" in line


@pytest.mark.parametrize("launcher", ["slurm", "slurm_cpu", "local_submitit"])
def test_a_launcher_without_m_is_refused_not_ignored(no_torch, tmp_path, launcher):
    run_dir = tmp_path / "run"
    line = one_line(launch(no_torch, f"hydra/launcher={launcher}", f"hydra.run.dir={run_dir}"))
    assert f"hydra/launcher={launcher} applies only to -m sweeps" in line and "add -m" in line
    assert not run_dir.exists(), "the run folder was created"


def test_logger_tensorboard_without_its_package_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    from trainer.checks import check_logger
    from trainer.config import LoggerConfig, LoggerName

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as on a machine without the extra
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    logger = LoggerConfig(LoggerName.tensorboard, 64, None, None, 32)
    with pytest.raises(ValueError, match=r"^logger=tensorboard needs the tensorboard package.*"
                                         r"pip install -e '\.\[tensorboard\]'"):
        check_logger(logger)
    monkeypatch.setattr(importlib.util, "find_spec", real)
    check_logger(logger)  # installed here (the test extra)
