"""settle: the one conversion of a composed DictConfig into typed objects and its Layout, with
every check that needs no process, no data and no torch. launch.py calls it for a run; the
validating sweeper calls it for every point of a sweep before any job starts.
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf, open_dict

from parallel.layout import Layout
from trainer.accounting import RunPlan
from trainer.config import Config, ConfigError, unknown_keys
from trainer.resolvers import build_layout
from trainer.schedule import LrSchedule


def settle(cfg: DictConfig) -> tuple[Config, Layout]:
    if "hydra" in cfg:  # a sweep point's config carries Hydra's own node; it is not ours
        cfg = cfg.copy()
        with open_dict(cfg):
            del cfg["hydra"]
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
    try:  # the run's sample accounting and schedule
        RunPlan.from_config(settings.train, settings.checkpoint, layout)
        LrSchedule.from_config(settings.schedule, settings.train.train_samples)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return settings, layout
