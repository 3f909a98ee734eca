"""Hydra plugin: the basic sweeper, but every point, the launcher and the job folders are
validated before any job starts (trainer.compose.sweeps). Selected in conf/config.yaml as
hydra/sweeper=gtp_validating. No `from __future__ import annotations` here: Hydra loads plugin
modules outside sys.modules, where dataclasses cannot resolve string annotations."""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser


@dataclass
class ValidatingSweeperConf:
    _target_: str = "hydra_plugins.gtp_trainer_sweeper.ValidatingSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None


ConfigStore.instance().store(group="hydra/sweeper", name="gtp_validating",
                             node=ValidatingSweeperConf, provider="gtp-trainer")


class ValidatingSweeper(BasicSweeper):
    def sweep(self, arguments: List[str]) -> Any:
        from trainer.compose.sweeps import check_launcher, check_sweep

        check_launcher(self.config)  # first: cheaper than composing every point
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        points = [point for batch in self.split_arguments(overrides, None) for point in batch]
        loader = self.hydra_context.config_loader
        check_sweep(lambda point: loader.load_sweep_config(self.config, point), points)
        return super().sweep(arguments)
