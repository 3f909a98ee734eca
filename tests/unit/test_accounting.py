"""RunPlan: a run is whole global batches, evaluation is whole micro-batches per batch lane, the
intervals are positive, and every count is independent samples, so layouts that only change who
reads a sample (sequence shards, CP) give the same steps. Also that trainer.compose.runspec.settle
turns each rule
into one line before anything starts."""
from __future__ import annotations

import pytest

from parallel.layout import Layout
from trainer.compose.runspec import settle
from trainer.config import CheckpointConfig, ConfigError, Precision, TrainConfig
from trainer.plan.accounting import RunPlan

from config_helpers import compose_config


def train_config(**overrides) -> TrainConfig:
    values = dict(micro_batch_size=4, global_batch_size=None, seq_length=32,
                  precision=Precision.fp32, seed=1, train_samples=64, eval_interval=4,
                  eval_samples=8, rampup_batch_size=None)
    return TrainConfig(**{**values, **overrides})


def checkpoint_config(save_interval: int | None = None) -> CheckpointConfig:
    return CheckpointConfig(dir=None, save_interval=save_interval, load=None)


def plan(layout: Layout, save_interval: int | None = None, **train) -> RunPlan:
    cfg = train_config(micro_batch_size=layout.micro_batch_size,
                       global_batch_size=layout.global_batch_size,
                       seq_length=layout.seq_length, **train)
    return RunPlan.from_config(cfg, checkpoint_config(save_interval), layout)


def one_process(micro: int = 4, gbs: int | None = None) -> Layout:
    return Layout(1, micro_batch_size=micro, global_batch_size=gbs, seq_length=32)


# ------------------------------------------------------------------------------ valid plans

def test_a_valid_plan_counts_steps_of_the_global_batch():
    p = plan(one_process(micro=4, gbs=12), train_samples=96, eval_samples=8, eval_interval=5)
    assert (p.global_batch_size, p.train_steps, p.eval_interval) == (12, 8, 5)


def test_the_eval_layout_is_the_training_layout_with_eval_samples_as_its_global_batch():
    layout = Layout(8, tensor_parallel_num_weight_shards=2, micro_batch_size=2,
                    global_batch_size=32, seq_length=32)  # batch_parallel_size 8, 2 micro-batches
    p = plan(layout, train_samples=320, eval_samples=48, eval_interval=10)
    assert p.eval_layout.global_batch_size == 48
    assert p.eval_layout.num_microbatches == 3  # 48 / (2 x 8)
    for key in ("world_size", "batch_parallel_size", "runtime_context_parallel_size",
                "micro_batch_size", "seq_length", "gtp_remat_size"):
        assert getattr(p.eval_layout, key) == getattr(layout, key), key
    assert layout.global_batch_size == 32  # the training layout itself is untouched


def test_without_eval_interval_there_is_no_eval_layout_and_eval_samples_is_not_checked():
    p = plan(one_process(micro=4), train_samples=64, eval_interval=None, eval_samples=3)
    assert p.eval_interval is None and p.eval_layout is None and p.train_steps == 16


def test_save_interval_null_and_positive_are_valid():
    assert plan(one_process(), save_interval=None).train_steps == 16
    assert plan(one_process(), save_interval=1).train_steps == 16


# ------------------------------------------------------------------------------ the rules

@pytest.mark.parametrize("samples,nearest", [(66, "64 or 68"), (3, "4"), (0, "4"), (-8, "4")])
def test_train_samples_must_be_a_positive_multiple_of_the_global_batch(samples, nearest):
    with pytest.raises(ValueError) as error:
        plan(one_process(micro=4), train_samples=samples)
    message = str(error.value)
    assert f"train.train_samples={samples}" in message
    assert "global batch size 4" in message
    assert f"Fix: set train.train_samples to {nearest}." in message


def test_the_train_samples_message_names_the_global_batch_with_its_micro_batches():
    with pytest.raises(ValueError) as error:
        plan(one_process(micro=4, gbs=12), train_samples=100)
    assert "global batch size 12" in str(error.value)
    assert "to 96 or 108" in str(error.value)


@pytest.mark.parametrize("samples,nearest", [(20, "16 or 32"), (8, "16"), (0, "16")])
def test_eval_samples_must_be_whole_micro_batches_on_every_batch_lane(samples, nearest):
    # World 4 with weight shards 2 and sequence shards 1: batch_parallel_size 4, micro 4 -> 16.
    layout = Layout(4, tensor_parallel_num_weight_shards=2, micro_batch_size=4, seq_length=32)
    assert layout.batch_parallel_size == 4
    with pytest.raises(ValueError) as error:
        plan(layout, train_samples=64, eval_samples=samples)
    message = str(error.value)
    assert f"train.eval_samples={samples}" in message
    assert "train.micro_batch_size x batch_parallel_size = 4 x 4 = 16" in message
    assert f"Fix: set train.eval_samples to {nearest}." in message


@pytest.mark.parametrize("interval", [0, -1])
def test_eval_interval_must_be_at_least_one(interval):
    with pytest.raises(ValueError, match=rf"train.eval_interval={interval} must be >= 1"):
        plan(one_process(), eval_interval=interval)


@pytest.mark.parametrize("interval", [0, -4])
def test_save_interval_must_be_at_least_one(interval):
    with pytest.raises(ValueError, match=rf"checkpoint.save_interval={interval} must be >= 1"):
        plan(one_process(), save_interval=interval)


# ------------------------------------------------------------------- independent samples

SEED_REVIEW_LAYOUTS = {  # world 8, weight shards 2, the same train.global_batch_size = 32
    "sequence shards 1": ["parallel.tensor_parallel_num_sequence_shards=1"],
    "sequence shards 2": ["parallel.tensor_parallel_num_sequence_shards=2"],
    "cp 2": ["parallel.tensor_parallel_num_sequence_shards=1", "parallel.context_parallel_size=2"],
}


def seed_review(*overrides: str):
    return settle(compose_config(
        "cluster.procs_per_node=8", "parallel.tensor_parallel_num_weight_shards=2",
        "train.micro_batch_size=2", "train.global_batch_size=32", "train.train_samples=320",
        "train.eval_samples=32", "schedule.lr_warmup_samples=32",
        "schedule.lr_warmup_fraction=null", *overrides))


def test_counts_are_independent_samples_whatever_the_sequence_split():
    plans, layouts = {}, {}
    for name, overrides in SEED_REVIEW_LAYOUTS.items():
        spec = seed_review(*overrides)
        settings, layout = spec.config, spec.layout
        layouts[name] = layout
        plans[name] = RunPlan.from_config(settings.train, settings.checkpoint, layout)
    # Sequence shards 1: DP 4 x 2 batch shards = 8 lanes, 2 micro-batches of 2 per step.
    assert (layouts["sequence shards 1"].batch_parallel_size,
            layouts["sequence shards 1"].num_microbatches,
            layouts["sequence shards 1"].runtime_context_parallel_size) == (8, 2, 1)
    # Sequence shards 2 (runtime CP 2) and CP 2: 4 lanes, 4 micro-batches of 2 per step.
    for name in ("sequence shards 2", "cp 2"):
        assert (layouts[name].batch_parallel_size, layouts[name].num_microbatches,
                layouts[name].runtime_context_parallel_size) == (4, 4, 2), name
    # ... yet every layout trains the same samples in the same number of steps.
    assert {(p.global_batch_size, p.train_steps) for p in plans.values()} == {(32, 10)}
    assert {p.eval_layout.global_batch_size for p in plans.values()} == {32}


# ------------------------------------------------------------------------- through settle

@pytest.mark.parametrize("overrides,expected", [
    (["train.train_samples=66"], "train.train_samples=66 is not a positive multiple of the "
                                 "global batch size 8"),
    (["train.eval_samples=12"], "train.eval_samples=12 is not a positive multiple"),
    (["train.eval_interval=0"], "train.eval_interval=0 must be >= 1"),
    (["checkpoint.save_interval=0"], "checkpoint.save_interval=0 must be >= 1"),
])
def test_settle_turns_a_plan_error_into_one_line(overrides, expected):
    cfg = compose_config("train.train_samples=64", "schedule.lr_warmup_samples=8",
                         "schedule.lr_warmup_fraction=null", *overrides)
    with pytest.raises(ConfigError) as error:
        settle(cfg)
    message = str(error.value)
    assert expected in message
    assert "\n" not in message
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_settle_accepts_the_default_config_and_its_plan():
    spec = settle(compose_config())
    settings, layout = spec.config, spec.layout
    p = RunPlan.from_config(settings.train, settings.checkpoint, layout)
    assert (p.global_batch_size, p.train_steps) == (8, 2048)  # conf/train/default.yaml


# ---------------------------------------------------------------------- progress is samples

def test_steps_left_and_the_last_steps_batch_count_samples_from_any_resume_point():
    layout = Layout(2, micro_batch_size=1, global_batch_size=4, seq_length=32)  # 2 lanes
    p = plan(layout, train_samples=48, eval_interval=None)
    assert [p.steps_from(c) for c in (0, 32, 6, 46, 48)] == [12, 4, 11, 1, 0]
    assert p.step_layout(layout, 40) is layout
    last = p.step_layout(layout, 46)  # 2 samples left: one micro-batch on each lane
    assert (last.global_batch_size, last.num_microbatches) == (2, 1)
    p.check_resume(layout, 6, "ckpt", 2, again_ok=False)  # ten steps of 4, then one of 2
    p.check_resume(layout, 48, "ckpt", 4, again_ok=True)  # a finished run's relaunch


def test_a_resume_that_cannot_end_at_train_samples_is_refused_with_the_numbers():
    layout = Layout(2, micro_batch_size=2, global_batch_size=8, seq_length=32)  # steps of 4
    p = plan(layout, train_samples=48, eval_interval=None)
    with pytest.raises(ValueError) as error:
        p.check_resume(layout, 6, "checkpoint.load=X", 2, again_ok=False)
    assert str(error.value) == (
        "checkpoint.load=X has consumed 6 samples: the 42 left to train.train_samples=48 are 5 "
        "step(s) of train.global_batch_size=8 and a last one of 2 sample(s), which is no global "
        "batch of this layout (train.global_batch_size=2 is not a multiple of "
        "train.micro_batch_size=2 x batch_parallel_size=2 = 4.). Fix: resume with a "
        "train.micro_batch_size and layout where train.micro_batch_size x batch_parallel_size = "
        "4 divides the 42 samples left (the checkpoint was saved at train.global_batch_size=2).")
    with pytest.raises(ValueError, match="has consumed 48 samples, equal to train.train_samples"):
        p.check_resume(layout, 48, "checkpoint.load=X", 8, again_ok=False)
    with pytest.raises(ValueError, match="has consumed 56 samples, past train.train_samples=48"):
        p.check_resume(layout, 56, "X", 8, again_ok=True)


def test_interleaved_pipelines_take_a_last_step_only_in_groups_of_pp_micro_batches():
    layout = Layout(2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                    micro_batch_size=1, global_batch_size=8, seq_length=32)
    p = plan(layout, train_samples=48, eval_interval=None)
    p.check_resume(layout, 6, "X", 2, again_ok=False)  # 2 micro-batches left: one group of PP
    with pytest.raises(ValueError) as error:
        p.check_resume(layout, 5, "X", 1, again_ok=False)
    assert "a last one of 3 sample(s)" in str(error.value)
    assert "batch_parallel_size x PP (interleaved) = 2 divides the 43 samples" in str(error.value)
