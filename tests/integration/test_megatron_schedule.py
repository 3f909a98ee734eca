"""A run of launch.py, read from its metrics.jsonl, against Megatron's own loop replayed with
megatron-core's scheduler and ramp-up calculator (test tooling): every step's global batch,
learning rate and weight decay, from the first step (which trains at lr_warmup_init) to the
last, with a batch ramp-up, warmup from an initial lr, WSD with a cosine anneal and a linear
weight decay. Then the same run stopped mid-ramp under one layout and resumed under another
continues Megatron's sequence exactly."""
from __future__ import annotations

import os
import subprocess
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_launch import command, make_dataset, metrics

from config_helpers import ROOT

with warnings.catch_warnings():  # megatron-core says once that TE and Apex are missing
    warnings.simplefilter("ignore")
    from megatron.core.num_microbatches_calculator import (
        RampupBatchsizeNumMicroBatchesCalculator,
    )
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

GLOBAL, RAMP, LANES = 8, (2, 2, 24), 2  # 3 increments of 8 samples
LR, MIN_LR, INIT, WARMUP, DECAY, ANNEAL = 2e-3, 1e-4, 5e-4, 10, 60, 20
START_WD, END_WD = 0.0, 0.1
RUN = ("train.seq_length=32", "train.eval_interval=null", "logger.log_interval=1",
       f"train.global_batch_size={GLOBAL}", f"train.rampup_batch_size=[{','.join(map(str, RAMP))}]",
       "schedule.lr_decay_style=WSD", f"schedule.lr={LR}", f"schedule.min_lr={MIN_LR}",
       f"schedule.lr_warmup_init={INIT}", "schedule.lr_warmup_fraction=null",
       f"schedule.lr_warmup_samples={WARMUP}", f"schedule.lr_decay_samples={DECAY}",
       f"schedule.lr_wsd_decay_samples={ANNEAL}", "schedule.lr_wsd_decay_style=cosine",
       "optim.weight_decay_incr_style=linear", f"optim.start_weight_decay={START_WD}",
       f"optim.end_weight_decay={END_WD}", "cluster.timeout_s=30")


def megatron_loop(train_samples: int, steps: int | None = None) -> list[tuple]:
    """(consumed before, global batch, lr, weight decay) of each iteration of Megatron's
    sample-based training: the calculator updated with the samples consumed before the
    iteration, the scheduler stepped by its global batch after the update."""
    calc = RampupBatchsizeNumMicroBatchesCalculator(GLOBAL, 1, LANES, False, 1, *RAMP)
    optimizer = SimpleNamespace(param_groups=[{}])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=INIT, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP,
        lr_decay_steps=DECAY, lr_decay_style="WSD", start_wd=START_WD, end_wd=END_WD,
        wd_incr_steps=train_samples, wd_incr_style="linear", wsd_decay_steps=ANNEAL,
        lr_wsd_decay_style="cosine")
    consumed, rows = 0, []
    while consumed < train_samples and (steps is None or len(rows) < steps):
        calc.update(consumed, consistency_check=True)
        batch = calc.get_current_global_batch_size()
        group = optimizer.param_groups[0]
        rows.append((consumed, batch, group["lr"], group["weight_decay"]))
        scheduler.step(increment=batch)
        consumed += batch
    return rows


TRAIN = sum(batch for _, batch, _, _ in megatron_loop(10**6, steps=14))  # past the ramp


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


def launch(dataset: Path, run_dir: Path, *overrides: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK")}
    out = subprocess.run(command(*RUN, f"data.path={dataset}", f"hydra.run.dir={run_dir}",
                                 *overrides), cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr


def logged(run_dir: Path) -> list[tuple]:
    return [(m["consumed_samples"] - m["global_batch_size"], m["global_batch_size"], m["lr"],
             m["weight_decay"]) for m in metrics(run_dir)]


def assert_megatron(got: list[tuple], expected: list[tuple]) -> None:
    assert [row[:2] for row in got] == [row[:2] for row in expected]
    for mine, theirs in zip(got, expected):
        assert mine[2:] == pytest.approx(theirs[2:], rel=1e-12, abs=0), mine[0]


def test_every_step_of_a_run_equals_megatron(dataset, tmp_path):
    launch(dataset, tmp_path, f"cluster.procs_per_node={LANES}", "train.micro_batch_size=1",
           f"train.train_samples={TRAIN}")
    expected = megatron_loop(TRAIN)
    assert expected[0][2] == INIT and len({batch for _, batch, _, _ in expected}) == 4
    assert_megatron(logged(tmp_path), expected)
    assert (tmp_path / "launch.log").read_text().count("batch ramp-up 2 to 8 by 2 every 8") == 1


def test_a_resume_mid_ramp_under_another_layout_continues_megatron(dataset, tmp_path):
    """Saved mid-ramp by one process (micro-batches of 2), resumed by two ranks (of 1)."""
    expected = megatron_loop(TRAIN)
    mid = expected[4][0]  # the samples consumed after 4 steps, still ramping
    assert mid < RAMP[2]
    launch(dataset, tmp_path, "cluster.procs_per_node=1", "train.micro_batch_size=2",
           f"train.train_samples={mid}")
    launch(dataset, tmp_path, f"cluster.procs_per_node={LANES}", "train.micro_batch_size=1",
           f"train.train_samples={TRAIN}")
    # The weight decay's span is train.train_samples (Megatron's wd_incr_steps): the first part
    # ran with its own, so its steps match a Megatron run of that length.
    first, second = megatron_loop(mid), expected[4:]
    assert_megatron(logged(tmp_path), first + second)
