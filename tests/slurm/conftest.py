"""Fixtures for tests against a real SLURM cluster (bring one up with .ci/slurm/up.sh). Finds the
cluster through its env.sh or skips every test here (fails them under CI=true); marks them
`slurm` and gives each a default timeout. Self-contained: nothing outside tests/slurm imports
from here."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DEFAULT_TIMEOUT_S = 240  # a test's own waits are bounded tighter; this catches the unforeseen
NO_CLUSTER = "no SLURM cluster: run .ci/slurm/up.sh"


def _no_cluster(why: str) -> None:
    """Skip, except under CI=true: there a suite that skipped would let CI pass untested."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{NO_CLUSTER} ({why}); CI=true needs the cluster", pytrace=False)
    pytest.skip(f"{NO_CLUSTER} ({why})")
_SHELL_VARS = {"_", "SHLVL", "PWD", "OLDPWD"}  # bash sets these itself; not the cluster's


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: needs a running SLURM cluster (.ci/slurm/up.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Called with every collected item, not only this folder's.
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slurm)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT_S))


def _env_file() -> Path:
    return Path(os.environ.get("GTP_SLURM_DIR", "/tmp/gtp-slurm")) / "env.sh"


def _sourced(env_file: Path) -> dict[str, str]:
    """The variables that env.sh sets or changes, as a shell sees them after sourcing it."""
    out = subprocess.run(["bash", "-c", '. "$1" && env -0', "bash", str(env_file)],
                         capture_output=True, timeout=5, check=True)
    after = dict(kv.split("=", 1) for kv in out.stdout.decode().split("\0") if "=" in kv)
    return {k: v for k, v in after.items() if k not in _SHELL_VARS and os.environ.get(k) != v}


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """The environment a SLURM client needs (SLURM_CONF, PATH with the sacct stand-in, ...), as the
    variables to add to os.environ. Skips (fails under CI=true) when no cluster answers `sinfo`
    within 5 s."""
    env_file = _env_file()
    if not env_file.is_file():
        _no_cluster(f"{env_file} not found")
    try:
        env = _sourced(env_file)
        # `scontrol ping` fails at once when slurmctld is down; sinfo would retry for ~9 s.
        for command in (["scontrol", "ping"], ["sinfo", "-h", "-o", "%P %a"]):
            out = subprocess.run(command, env={**os.environ, **env}, capture_output=True,
                                 text=True, timeout=5)
            if out.returncode != 0 or not out.stdout.strip():
                said = (out.stdout + out.stderr).strip().splitlines() or ["no output"]
                _no_cluster(f"{' '.join(command)}: {said[0]}")
    except (OSError, subprocess.SubprocessError) as e:
        _no_cluster(f"{type(e).__name__}: {e}")
    return env


@pytest.fixture(scope="session")
def slurm_partition(slurm_env: dict[str, str]) -> str:
    """The cluster's default partition (sinfo marks it with '*'), else its first one."""
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], env={**os.environ, **slurm_env},
                         capture_output=True, text=True, timeout=5, check=True)
    names = out.stdout.split()
    return next((n.rstrip("*") for n in names if n.endswith("*")), names[0])


@pytest.fixture
def slurm_client(slurm_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """os.environ points at the cluster for one test: submitit runs sbatch, sacct and scancel as
    subprocesses of this process, and sbatch passes this environment on to the job."""
    for key, value in slurm_env.items():
        monkeypatch.setenv(key, value)
    return slurm_env
