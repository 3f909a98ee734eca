"""Compose the project's config the way launch.py does, without a process, and wait for a
launch.py process (tests import it as `config_helpers`; the tests folder is on sys.path through
tests/conftest.py)."""
from __future__ import annotations

import subprocess
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import trainer.config  # noqa: F401  (registers the schemas)

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"


def compose_config(*overrides: str, hydra_node: bool = False) -> DictConfig:
    """The composed config for these command-line overrides (unresolved, like in launch.py)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=list(overrides),
                       return_hydra_config=hydra_node)


def finish(process: subprocess.Popen, timeout: float = 180) -> subprocess.CompletedProcess:
    """Wait for a process started with text pipes; kill it if it outlives the timeout."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
