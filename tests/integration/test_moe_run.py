"""A mixture of experts from the command line (model=tiny_moe, DeepSeek-V3's router with its
expert bias): metrics.jsonl reports the balance and a run resumed from
its checkpoint continues exactly as an uninterrupted one, the expert bias included."""
from __future__ import annotations

import subprocess
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_launch import command, make_dataset, metrics

from config_helpers import ROOT

RUN = ("model=tiny_moe", "model.moe_router_score_function=sigmoid",
       "model.moe_router_enable_expert_bias=true", "model.moe_router_bias_update_rate=0.01",
       "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4",
       "train.eval_interval=null", "logger.log_interval=1", "schedule.lr_decay_samples=64",
       "schedule.lr_warmup_fraction=null", "schedule.lr_warmup_samples=8")
BIAS = "model.layers.0.mlp.router.expert_bias"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory)


def launch(dataset, run_dir, *overrides: str) -> None:
    out = subprocess.run(command(*RUN, f"data.path={dataset}", f"hydra.run.dir={run_dir}",
                                 *overrides), cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def bias(checkpoint) -> torch.Tensor:
    value = {BIAS: torch.empty(8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(value, checkpoint_id=checkpoint, no_dist=True)
    return value[BIAS]


def test_a_resumed_mixture_of_experts_continues_exactly(dataset, tmp_path):
    launch(dataset, tmp_path / "whole", "train.train_samples=64")
    launch(dataset, tmp_path / "parts", "train.train_samples=32")
    launch(dataset, tmp_path / "parts", "train.train_samples=64")  # resumes at step 8
    whole, parts = metrics(tmp_path / "whole"), metrics(tmp_path / "parts")
    assert [m["step"] for m in parts] == list(range(1, 17))
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_imbalance_per_layer"):
        assert [m[key] for m in parts] == [m[key] for m in whole], key
    assert whole[-1]["moe_imbalance"] >= 1 and "1" in whole[-1]["moe_imbalance_per_layer"]
    final = bias(tmp_path / "whole" / "checkpoints" / "step_00000016")
    assert final.abs().max() > 0  # the bias moved, and the resumed run ends with the same
    assert torch.equal(bias(tmp_path / "parts" / "checkpoints" / "step_00000016"), final)
