"""Compose the project's config the way launch.py does, without a process; wait for a
launch.py process; run a page's launch.py command as written (tests import it as
`config_helpers`; the tests folder is on sys.path through tests/conftest.py)."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
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



def page_command(page: Path, heading: str) -> list[str]:
    """The first bash fence after `heading` on a page, as argv."""
    section = page.read_text().split(heading, 1)[1]
    fence = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return shlex.split(fence.replace("\\\n", " "))


def run_logged(argv: list[str], run_dir: Path, timeout: float = 300) -> list[dict]:
    """A `python launch.py ...` command run as written, its folder moved to run_dir and every
    step logged: the steps it logged (metrics.jsonl's lines with a loss)."""
    assert argv[:2] == ["python", "launch.py"], argv
    done = subprocess.run([sys.executable, *argv[1:], f"hydra.run.dir={run_dir}",
                           "logger.log_interval=1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "loss" in m]
