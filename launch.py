"""The single entry point: compose the config, validate it, then dry-run or train.

    python launch.py [overrides] [dry_run=true]
    python launch.py [overrides] --cfg job --resolve   # print the composed config with `layout`

Heavy imports (torch) wait until the config is known to be valid, so a bad layout fails fast.
"""
from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import trainer.config  # noqa: F401  (registers the schemas with Hydra's ConfigStore)
from parallel.layout import Layout
from trainer.accounting import RunPlan
from trainer.config import Config, ConfigError, unknown_keys
from trainer.schedule import LrSchedule
from trainer.resolvers import build_layout


def settle(cfg: DictConfig) -> tuple[Config, Layout]:
    """The one conversion from DictConfig to typed objects, and the layout they imply."""
    # Layout first: a rule violation then prints as its own line, not wrapped by OmegaConf.
    layout = build_layout(cfg.parallel, cfg.cluster, cfg.train)
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigError(
            f"Unknown config key(s): {', '.join(unknown)}. Fix: check the spelling against "
            f"`python launch.py --cfg job`; keys cannot be added with +key=value.")
    settings: Config = OmegaConf.to_object(cfg)
    if settings.layout != layout.derived():
        raise ConfigError(
            f"layout={settings.layout} does not match what parallel.*, cluster.* and train.* "
            f"give ({layout.derived()}). `layout` is derived and read-only: remove the override "
            f"and set the parallel.* keys instead.")
    try:  # the run's sample accounting and schedule, before any process starts
        RunPlan.from_config(settings.train, settings.checkpoint, layout)
        LrSchedule.from_config(settings.schedule, settings.train.train_samples)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return settings, layout


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    settings, layout = settle(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if settings.dry_run:
        from trainer.dry_run import dry_run

        dry_run(settings, layout, run_dir)
        return
    from trainer.run import run_single_process

    run_single_process(cfg, settings, layout, run_dir)


if __name__ == "__main__":
    main()
