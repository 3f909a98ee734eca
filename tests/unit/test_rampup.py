"""Batch-size ramp-up against Megatron-Core's own RampupBatchsizeNumMicroBatchesCalculator
(megatron-core, a test tool): the global batch and number of micro-batches at every consumed
sample count of a run, the steps Megatron's loop takes (update with the samples consumed before
each iteration, then add that iteration's global batch), and every compose-time rule the
calculator would otherwise assert mid-run, as one line."""
from __future__ import annotations

import warnings

import pytest

from parallel.layout import Layout
from trainer.compose.runspec import settle
from trainer.config import CheckpointConfig, ConfigError, Precision, TrainConfig
from trainer.plan.accounting import RunPlan
from trainer.plan.rampup import BatchRamp

from config_helpers import compose_config

with warnings.catch_warnings():  # megatron-core says once that TE and Apex are missing
    warnings.simplefilter("ignore")
    from megatron.core.num_microbatches_calculator import (
        RampupBatchsizeNumMicroBatchesCalculator,
    )


def megatron(ramp: list[int], layout: Layout) -> RampupBatchsizeNumMicroBatchesCalculator:
    start, increment, samples = ramp
    return RampupBatchsizeNumMicroBatchesCalculator(
        layout.global_batch_size, layout.micro_batch_size, layout.batch_parallel_size,
        False, 1, start, increment, samples)  # rank 1: it logs nothing


def megatron_steps(ramp: list[int], layout: Layout, train_samples: int) -> list[tuple]:
    """(consumed before, global batch, micro-batches) of each iteration of Megatron's loop."""
    calc, consumed, steps = megatron(ramp, layout), 0, []
    while consumed < train_samples:
        calc.update(consumed, consistency_check=True)
        steps.append((consumed, calc.get_current_global_batch_size(), calc.get()))
        consumed += calc.get_current_global_batch_size()
    return steps


def layout(gbs: int, micro: int = 2, **degrees) -> Layout:
    world = degrees.pop("world", 1)
    return Layout(world, micro_batch_size=micro, global_batch_size=gbs, seq_length=32, **degrees)


def plan(ramp: list[int], lay: Layout, train_samples: int) -> RunPlan:
    train = TrainConfig(micro_batch_size=lay.micro_batch_size,
                        global_batch_size=lay.global_batch_size, seq_length=32,
                        precision=Precision.fp32, seed=1, train_samples=train_samples,
                        rampup_batch_size=ramp, eval_interval=None, eval_samples=8)
    return RunPlan.from_config(train, CheckpointConfig(save_interval=None), lay)


def our_steps(p: RunPlan, lay: Layout) -> list[tuple]:
    consumed, steps = 0, []
    while consumed < p.train_samples:
        step_layout = p.step_layout(lay, consumed)
        steps.append((consumed, step_layout.global_batch_size, step_layout.num_microbatches))
        consumed += step_layout.global_batch_size
    return steps


def megatron_end(ramp: list[int], lay: Layout, steps: int) -> int:
    """The samples Megatron's loop has consumed after `steps` iterations."""
    consumed, calc = 0, megatron(ramp, lay)
    for _ in range(steps):
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
    return consumed


RAMPS = [  # (ramp, layout, steps of the run: past the ramp's end, so whole global batches)
    ([4, 4, 100], layout(32), 14),  # 7 increments of 14.29 samples (a float per increment)
    ([2, 2, 64], layout(8), 32),
    ([16, 16, 1000], layout(64, micro=4, world=4), 40),  # 4 batch lanes
    ([6, 6, 97], layout(24, micro=3, world=2), 12),  # 3 increments of 32.33 samples
    ([8, 8, 1], layout(16, micro=4, world=2), 7),  # the ramp ends after its first steps
    ([4, 12, 300], layout(40, micro=4), 60),  # an increment of 3 micro-batches
    ([8, 8, 200], layout(32, micro=2, world=2, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2), 25),  # interleaved: m % PP
]
CASES = [(ramp, lay, megatron_end(ramp, lay, steps)) for ramp, lay, steps in RAMPS]


@pytest.mark.parametrize("ramp,lay,train_samples", CASES)
def test_every_step_equals_megatron(ramp, lay, train_samples):
    p = plan(ramp, lay, train_samples)
    expected = megatron_steps(ramp, lay, train_samples)
    assert our_steps(p, lay) == expected
    assert p.train_steps == len(expected) == p.steps_from(0)
    assert sum(batch for _, batch, _ in expected) == train_samples
    assert expected[0][1] == ramp[0] and expected[-1][1] == lay.global_batch_size


@pytest.mark.parametrize("ramp,lay,train_samples", CASES)
def test_the_batch_at_any_count_equals_megatron(ramp, lay, train_samples):
    """Also at counts no run of this layout consumes (a resume under another layout)."""
    ours, theirs = BatchRamp.from_config(ramp, lay), megatron(ramp, lay)
    for consumed in range(0, ramp[2] + 3 * lay.global_batch_size):
        theirs.update(consumed, consistency_check=False)
        assert ours.global_batch(consumed) == theirs.get_current_global_batch_size(), consumed


@pytest.mark.parametrize("ramp,lay,train_samples", CASES)
def test_a_resume_at_any_step_continues_megatron_steps(ramp, lay, train_samples):
    p, expected = plan(ramp, lay, train_samples), megatron_steps(ramp, lay, train_samples)
    for i, (consumed, _, _) in enumerate(expected):
        assert p.steps_from(consumed) == len(expected) - i
        assert p.last_step(consumed) is None
        p.check_resume(lay, consumed, "the checkpoint", lay.global_batch_size, False)


def test_a_resume_under_another_layout_mid_ramp_keeps_megatron_batches():
    """Saved by 1 batch lane at step 5, resumed by 2: the batches that follow are still the
    ramp's at the consumed count, now split over 2 lanes (fewer micro-batches each)."""
    one, two = layout(32, micro=2), layout(32, micro=2, world=2)
    before = megatron_steps([4, 4, 100], one, 424)
    resumed = plan([4, 4, 100], two, 424)
    consumed = before[5][0]
    after = [(c, g) for c, g, _ in our_steps(resumed, two) if c >= consumed]
    assert after == [(c, g) for c, g, _ in before[5:]]


def test_a_run_ending_inside_the_ramp_takes_exactly_its_samples():
    """Megatron's update_train_iters would take one more ramp step here (it counts steps while
    consumed <= train_samples); a run here ends at train.train_samples, whole steps."""
    lay = layout(32)
    steps = megatron_steps([4, 4, 100], lay, 10**6)
    inside = steps[6][0]  # still ramping
    assert inside < 100
    p = plan([4, 4, 100], lay, inside)
    assert our_steps(p, lay) == steps[:6]


def test_the_plan_counts_the_ramp_in_its_steps():
    lay = layout(8)
    p = plan([2, 2, 64], lay, 160)
    assert p.steps_from(0) == len(megatron_steps([2, 2, 64], lay, 160)) == 32
    assert p.ramp == BatchRamp(2, 2, 64, 8)


# ------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("overrides,named", [
    ("train.rampup_batch_size=[4,4]", ("train.rampup_batch_size=[4, 4]", "three")),
    ("train.rampup_batch_size=[0,4,100]", ("[0, 4, 100]", ">= 1")),
    ("train.rampup_batch_size=[4,4,0]", ("[4, 4, 0]", ">= 1")),
    ("train.rampup_batch_size=[32,4,100]", ("[32, 4, 100]", "train.global_batch_size=32")),
    ("train.rampup_batch_size=[4,5,100]", ("[4, 5, 100]", "28", "increments of 5")),
    ("train.rampup_batch_size=[6,2,100]", ("[6, 2, 100]", "global batch of 6", "= 4")),
    ("train.rampup_batch_size=[4,6,100] train.global_batch_size=16",
     ("[4, 6, 100]", "global batch of 10", "multiples of")),
    ("train.rampup_batch_size=[4,4,100] train.train_samples=1001",
     ("train.train_samples=1001", "after the ramp-up's steps end at 104", "1000 or 1032")),
    ("train.rampup_batch_size=[4,4,100] train.train_samples=30",
     ("train.train_samples=30", "inside a step of the batch ramp-up", "24 or 32")),
])
def test_compose_time_refusals_name_the_key(overrides, named):
    cfg = compose_config("train.micro_batch_size=4", "train.global_batch_size=32",
                         "train.train_samples=424", *overrides.split())
    with pytest.raises(ConfigError) as err:
        settle(cfg)
    message = str(err.value)
    assert all(text in message for text in named), message
    assert "Fix:" in message and "\n" not in message


def test_the_shipped_default_has_no_ramp():
    assert settle(compose_config()).plan.ramp is None


def test_the_dry_run_says_the_ramp_and_plans_the_largest_batch():
    from trainer.report.dry_run import format_report
    from trainer.report.record import layout_record

    spec = settle(compose_config("train.micro_batch_size=4", "train.global_batch_size=32",
                                 "train.train_samples=424", "train.rampup_batch_size=[4,4,100]"))
    record = layout_record(spec)
    assert record["training"] == {
        "train_samples": 424, "train_steps": len(megatron_steps([4, 4, 100], spec.layout, 424)),
        "global_batch_size": 32,
        "rampup_batch_size": [4, 4, 100], "lr_schedule": spec.schedule.describe(),
        "weight_decay": "weight decay 0.1"}
    assert record["derived"]["num_microbatches"] == 8  # the plan's: the largest batch's
    line = format_report(spec, record).splitlines()[3]
    assert line.startswith("training: 20 steps, batch ramp-up 4 to 32 by 4 every 14.2857 samples")
    assert "memory planned at 32 (8 micro-batches)" in line
