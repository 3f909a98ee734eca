"""settle: the one conversion of a composed DictConfig into a RunSpec, with every check that
needs no process and no torch. launch.py settles once per process (the dry run, the parent of
local ranks, each torchrun/submitit rank); the validating sweeper settles every point of a sweep
before any job starts. Nothing below a RunSpec re-derives what it holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from parallel.layout import Layout
from trainer.auto.search import Choice
from trainer.checks import check_layout_inputs, check_values
from trainer.compose.resolvers import AutoLayoutError, auto_choice, build_layout
from trainer.config import Config, ConfigError, unknown_keys
from trainer.data.source import DataSource
from trainer.parts.lora import check_peft
from trainer.plan.accounting import RunPlan
from trainer.plan.axis_costs import check_model_fits_layout
from trainer.plan.lr_schedule import LrSchedule, WeightDecaySchedule
from trainer.plan.muon import muon_plan
from trainer.plan.options import EngineOptions
from trainer.plan.stage_plan import memory_plan


@dataclass(frozen=True)
class RunSpec:
    """A run, checked: the typed config and everything derived from it before any rank starts.
    Frozen and picklable: launch.py hands the same value to every rank it starts."""

    config: Config
    layout: Layout
    plan: RunPlan  # steps, evaluation batches, intervals
    schedule: LrSchedule
    weight_decay: WeightDecaySchedule  # Megatron's get_wd() over consumed samples
    data: DataSource  # where the tokens are, and what is known of them before opening
    # The memory plan (trainer.plan.memory): layout.json's `memory` and the measured run's
    # comparison read it here, so nothing after settle plans the memory again.
    memory: dict[str, Any]
    auto: Optional[Choice] = None  # parallel=auto: the search that chose the layout


def settle(cfg: DictConfig) -> RunSpec:
    node = cfg._get_node("layout", validate_access=False)
    if node is None or node._value() != Config.layout:  # an override replaced the resolver
        raise ConfigError(
            "layout is derived from parallel.*, cluster.* and train.* and is read-only. Fix: "
            "remove the override of layout (or ~layout) and set the parallel.* keys instead.")
    # Hydra's own node (a sweep point carries it) is not ours; `layout` is left out too, since
    # resolving it would run the layout's rules before the key and value checks below.
    cfg = cfg.copy()
    with open_dict(cfg):
        for key in ("hydra", "layout"):
            if cfg._get_node(key, validate_access=False) is not None:
                del cfg[key]  # not pop(), which would resolve the value it returns
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
    except AutoLayoutError as error:  # the search ran inside OmegaConf, which adds key lines
        raise ConfigError(str(error).splitlines()[0]) from None
    if missing:
        raise ConfigError(f"Missing config value(s) (???): {', '.join(missing)}. Fix: set them "
                          f"on the command line, e.g. {missing[0]}=VALUE, or in a config file.")
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigError(
            f"Unknown config key(s): {', '.join(unknown)}. Fix: check the spelling against "
            f"`python launch.py --cfg job`; keys cannot be added with +key=value.")
    auto = auto_choice(cfg)  # parallel=auto: the search, before its values are read
    try:
        check_layout_inputs(cfg.parallel, cfg.cluster, cfg.train)  # before the Layout's rules
    except ValueError as error:
        raise ConfigError(str(error)) from None
    # Layout first among the rest: a rule violation prints as its own line.
    layout = build_layout(cfg.parallel, cfg.cluster, cfg.train)
    with open_dict(cfg):
        cfg.layout = layout.derived()  # resolved from the one Layout, not by the resolver again
    config: Config = OmegaConf.to_object(cfg)
    try:
        check_values(config, layout)
        options = EngineOptions.from_config(config)
        check_model_fits_layout(config.model, layout, options)
        plan = RunPlan.from_config(config.train, config.checkpoint, layout)
        schedule = LrSchedule.from_config(config.schedule, config.train.train_samples)
        weight_decay = WeightDecaySchedule.from_config(config.optim, config.train.train_samples)
        data = DataSource.from_config(config.data, config.model, config.train)
        if config.logger.sample_prompts and data.tokenizer_file() is None:
            raise ValueError(f"logger.sample_prompts={list(config.logger.sample_prompts)} needs "
                             f"the data's tokenizer, and data.path={config.data.path} (a Megatron "
                             f"dataset) records none. Fix: set logger.sample_prompts=null, and "
                             f"sample a checkpoint with python -m trainer.generate --tokenizer.")
        check_peft(config.model, config.peft, config.optim, layout, config.train.precision)
        memory = memory_plan(config.model, layout, options, muon_plan(config.model, config.optim),
                             config.peft, config.train.objective == "dpo" and not config.peft)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return RunSpec(config, layout, plan, schedule, weight_decay, data, memory, auto)

