"""Every config option composes, the `layout` node resolves, and user mistakes are errors."""
from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ReadonlyConfigError, ValidationError

from parallel.layout import DERIVED_KEYS, Layout
from trainer.compose.resolvers import LayoutResolutionError
from trainer.config import unknown_keys

from config_helpers import CONF_DIR, compose_config

SCHEMA_GROUPS = ("model", "parallel", "cluster", "train", "data", "optim", "schedule", "logger",
                 "checkpoint")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_every_group_required_by_the_design_has_options():
    for group in (*SCHEMA_GROUPS, "experiment", "debug", "hydra/launcher"):
        assert options(group), f"conf/{group} has no options"


@pytest.mark.parametrize("group,option", [(g, o) for g in SCHEMA_GROUPS for o in options(g)])
def test_every_group_option_composes_and_resolves(group, option):
    overrides = [f"{group}={option}"]
    if group == "parallel" and option != "default":
        overrides.append("cluster.procs_per_node=8")  # room for the option's shards
    cfg = compose_config(*overrides)
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert set(container["layout"]) == set(DERIVED_KEYS)


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes_and_resolves(experiment):
    cfg = compose_config(f"experiment={experiment}")
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert cfg.run_name == experiment


@pytest.mark.parametrize("launcher", options("hydra/launcher"))
def test_every_launcher_preset_composes_from_cluster_keys(launcher):
    cfg = compose_config(f"hydra/launcher={launcher}", "cluster.num_nodes=2",
                         "cluster.procs_per_node=4", hydra_node=True)
    node = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert node["nodes"] == 2 and node["tasks_per_node"] == 4


def test_layout_node_matches_layout_and_is_read_only():
    cfg = compose_config("cluster.procs_per_node=16", "parallel.tensor_model_parallel_size=2",
                         "parallel.sequence_parallel=true",
                         "parallel.tensor_parallel_num_weight_shards=8",
                         "parallel.tensor_parallel_num_sequence_shards=4",
                         "parallel.context_parallel_size=2")
    expected = Layout(16, 2, True, 8, 4, 2, 1, micro_batch_size=cfg.train.micro_batch_size,
                      seq_length=cfg.train.seq_length).derived()
    assert OmegaConf.to_container(cfg.layout) == expected
    assert list(cfg.layout) == list(DERIVED_KEYS)
    with pytest.raises(ReadonlyConfigError):
        cfg.layout.world_size = 3


def test_layout_follows_later_overrides():
    cfg = compose_config("cluster.procs_per_node=4")
    assert cfg.layout.data_parallel_size == 4
    cfg.parallel.tensor_parallel_num_weight_shards = 4
    assert cfg.layout.data_parallel_size == 1 and cfg.layout.batch_parallel_size == 4


def test_invalid_layout_raises_the_rule_message_through_the_compose_api():
    cfg = compose_config("cluster.procs_per_node=4", "parallel.tensor_parallel_num_weight_shards=3")
    with pytest.raises(LayoutResolutionError, match=r"world_size=4 .* not divisible by .*= 3"):
        OmegaConf.resolve(cfg)


def test_world_size_is_a_config_value_not_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "64")
    monkeypatch.setenv("SLURM_NTASKS", "64")
    cfg = compose_config("cluster.num_nodes=2", "cluster.procs_per_node=3")
    assert cfg.layout.world_size == 6


def test_nvlink_domain_defaults_to_procs_per_node():
    assert compose_config("cluster.procs_per_node=4").cluster.gpus_per_nvlink_domain == 4


@pytest.mark.parametrize("override,error", [
    ("parallel.bogus=1", ConfigCompositionException),
    ("parallel.context_parallel_size=two", ConfigCompositionException),
    ("parallel.sequence_parallel=maybe", ConfigCompositionException),
    ("train.precision=fp8", ConfigCompositionException),
    ("schedule.lr_decay_style=cosin", ConfigCompositionException),
])
def test_unknown_keys_and_wrong_types_are_errors(override, error):
    with pytest.raises(error):
        compose_config(override)


def test_keys_added_with_plus_are_found():
    # Hydra opens typed nodes for `+key=value`; launch.py rejects what unknown_keys() finds.
    cfg = compose_config("+parallel.bogus=1", "+nonsense=1", "+model.extra.deep=2")
    assert unknown_keys(cfg) == ["model.extra", "parallel.bogus", "nonsense"]
    assert unknown_keys(compose_config("experiment=seed_review")) == []


def test_unknown_key_in_a_preset_is_an_error(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "typo.yaml").write_text(
        "# @package _global_\nparallel:\n  context_paralel_size: 2\n")
    with pytest.raises((ConfigCompositionException, ConfigKeyError, ValidationError)):
        compose_config(f"hydra.searchpath=[file://{tmp_path}]", "experiment=typo")


def test_dry_run_is_off_by_default():
    assert compose_config().dry_run is False
