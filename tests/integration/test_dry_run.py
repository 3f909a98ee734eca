"""Every experiment preset dry-runs (in process, through launch.settle like a real run)."""
from __future__ import annotations

import json

import pytest
import torch

from trainer.compose.runspec import settle
from trainer.model.transformer import Transformer
from trainer.report.dry_run import dry_run

from config_helpers import CONF_DIR, compose_config

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_dry_runs(experiment, tmp_path, capsys):
    spec = settle(compose_config(f"experiment={experiment}"))
    layout = spec.layout
    record = dry_run(spec, tmp_path)
    assert json.loads((tmp_path / "layout.json").read_text())["derived"] == layout.derived()
    assert record["warnings"] == []  # the presets keep each weight tile inside one domain
    # The one-process count is checked against the torch module itself (not the plan's own
    # shapes), and each rank's share against that count: sharding over the tile shrinks a
    # rank's parameters by about the tile size; norms stay whole, so allow a little more.
    with torch.device("meta"):
        numel = sum(p.numel() for p in Transformer(spec.config.model).parameters())
    assert record["memory"]["unsharded"]["parameters"] == numel
    tile = layout.tp_size * layout.gtp_remat_size
    assert record["memory"]["per_stage"][0]["parameters"] <= 1.05 * numel / tile
    assert f"gtp-trainer dry run: {experiment}" in capsys.readouterr().out


def test_seed_presets_give_the_seed_numbers():
    ws64 = settle(compose_config("experiment=seed_ws64_tp2_sp")).layout
    assert (ws64.gtp_remat_size, ws64.gtp_remat_num_sequence_shards,
            ws64.gtp_remat_num_batch_shards) == (32, 8, 4)
    big = settle(compose_config("experiment=seed_128rank_cp2")).layout
    assert (big.world_size, big.data_parallel_size, big.batch_parallel_size,
            big.runtime_context_parallel_size, big.num_weight_replicas) == (128, 1, 1, 128, 2)
