"""Defaults precedence for sequence shards (the seed PR's review case): null means the SP degree,
a value from a config file wins over that, and the command line wins over both."""
from __future__ import annotations

import pytest

from config_helpers import compose_config

WORLD_8_WS_2 = ("cluster.procs_per_node=8", "parallel.tensor_parallel_num_weight_shards=2")


def layout_of(*overrides: str) -> tuple[int, int, int]:
    layout = compose_config(*overrides).layout
    return (layout.runtime_context_parallel_size, layout.batch_parallel_size,
            layout.data_parallel_size)


def test_unset_sequence_shards_mean_the_sp_degree():
    cfg = compose_config(*WORLD_8_WS_2)
    assert cfg.parallel.tensor_parallel_num_sequence_shards is None
    assert cfg.layout.gtp_remat_num_sequence_shards == 1
    assert layout_of(*WORLD_8_WS_2) == (1, 8, 4)


def test_unset_sequence_shards_with_sp_mean_tp():
    cfg = compose_config("cluster.procs_per_node=8", "parallel.tensor_model_parallel_size=2",
                         "parallel.sequence_parallel=true")
    assert cfg.layout.sp_degree == 2 and cfg.layout.gtp_remat_num_sequence_shards == 1
    assert cfg.layout.runtime_context_parallel_size == 1


@pytest.mark.parametrize("preset", [("experiment=seed_review",),
                                    ("parallel=gtp_seq2", "cluster.procs_per_node=8")])
def test_a_config_file_value_wins_over_the_default(preset):
    assert compose_config(*preset).parallel.tensor_parallel_num_sequence_shards == 2
    assert layout_of(*preset) == (2, 4, 4)


@pytest.mark.parametrize("preset", [("experiment=seed_review",),
                                    ("parallel=gtp_seq2", "cluster.procs_per_node=8")])
def test_the_command_line_wins_over_a_config_file(preset):
    assert layout_of(*preset, "parallel.tensor_parallel_num_sequence_shards=1") == (1, 8, 4)


def test_an_explicit_null_on_the_command_line_restores_the_default():
    assert layout_of("experiment=seed_review",
                     "parallel.tensor_parallel_num_sequence_shards=null") == (1, 8, 4)
