"""Sample accounting of a run: steps, evaluation batches and intervals, checked before any
process starts. Counts are independent samples (global batches), never ranks: CP, sequence
shards and TP change who reads a sample, not how many samples a step consumes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from parallel.layout import Layout, multiples_near
from trainer.config import CheckpointConfig, TrainConfig


@dataclass(frozen=True)
class RunPlan:
    global_batch_size: int
    train_steps: int
    eval_interval: int | None  # steps
    eval_layout: Layout | None  # the layout whose global batch is one evaluation

    @classmethod
    def from_config(cls, train: TrainConfig, checkpoint: CheckpointConfig,
                    layout: Layout) -> RunPlan:
        gbs = layout.global_batch_size
        if train.train_samples < 1 or train.train_samples % gbs:
            raise ValueError(
                f"train.train_samples={train.train_samples} is not a positive multiple of the "
                f"global batch size {gbs} (train.micro_batch_size x batch_parallel_size x "
                f"micro-batches): a run is whole steps. Fix: set train.train_samples to "
                f"{multiples_near(train.train_samples, gbs)}.")
        eval_layout = None
        if train.eval_interval is not None:
            if train.eval_interval < 1:
                raise ValueError(f"train.eval_interval={train.eval_interval} must be >= 1 "
                                 f"(steps). Fix: set it to a number of steps, or null for no "
                                 f"evaluation.")
            lanes = layout.micro_batch_size * layout.batch_parallel_size
            if train.eval_samples < 1 or train.eval_samples % lanes:
                raise ValueError(
                    f"train.eval_samples={train.eval_samples} is not a positive multiple of "
                    f"train.micro_batch_size x batch_parallel_size = {layout.micro_batch_size} x "
                    f"{layout.batch_parallel_size} = {lanes}: every batch lane reads whole "
                    f"micro-batches. Fix: set train.eval_samples to "
                    f"{multiples_near(train.eval_samples, lanes)}.")
            eval_layout = replace(layout, global_batch_size=train.eval_samples)
        if checkpoint.save_interval is not None and checkpoint.save_interval < 1:
            raise ValueError(f"checkpoint.save_interval={checkpoint.save_interval} must be >= 1 "
                             f"(steps). Fix: set it to a number of steps, or null to save only "
                             f"at the end.")
        return cls(gbs, train.train_samples // gbs, train.eval_interval, eval_layout)

