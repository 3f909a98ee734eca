"""Hydra callback: the checks of a plain run (no -m) that need the composed config but must come
before Hydra creates the run folder, which it does before launch.py's main runs. Registered in
conf/config.yaml (hydra.callbacks). Imports no torch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.checks import check_writable


class RunChecks(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        message = run_refusal(config)
        if message:
            # Hydra turns an exception a callback raises into a warning and runs on; SystemExit
            # is no Exception, so it stops the command: the message on stderr, exit code 1.
            raise SystemExit(message)


def run_refusal(config: DictConfig) -> Optional[str]:
    """Why this run must not start, in one line; None if it may."""
    launcher = config.hydra.runtime.choices.get("hydra/launcher")
    if launcher not in (None, "basic"):
        return (f"hydra/launcher={launcher} applies only to -m sweeps: without -m Hydra ignores "
                f"it and this command would train here, on this machine. Fix: add -m to "
                f"launch it (python launch.py -m hydra/launcher={launcher} ...), or drop "
                f"hydra/launcher={launcher} to run here.")
    try:
        run_dir = str(OmegaConf.select(config, "hydra.run.dir"))
    except OmegaConfBaseException:
        return None  # Hydra resolves it again next and reports what is wrong with it
    try:
        check_writable("hydra.run.dir", run_dir, Path(run_dir), "Hydra creates the run folder")
    except ValueError as error:
        return str(error)
    return None
