"""A candidate layout's planned peak per rank, the same bytes as the dry run's memory plan
(trainer.plan.memory, held equal by tests/unit/test_auto.py) but summed per block instead of
per parameter: the search sizes thousands of layouts, the dry run one.
"""
from __future__ import annotations

from functools import lru_cache

from parallel.layout import Layout
from parallel.pipeline.schedules import FORWARD, message_counts, stage_actions
from trainer.config import ModelConfig
from trainer.plan.activations import (
    Tokens,
    chunk_activation_bytes,
    compute_bytes,
    head_activation_bytes,
)
from trainer.plan.memory import ModelWeights, StageWeights, stage_peak, stage_step
from trainer.plan.options import EngineOptions


@lru_cache(maxsize=4096)
def _alive(stage: int, pp: int, m: int, v: int) -> tuple[tuple[int, int], ...]:
    """The interleaved schedule's (micro-batch, chunk) pairs alive after each forward, as
    (all of them, those of the last chunk), keeping only pairs no other exceeds in both. The
    order of forwards does not depend on m and repeats every pp x v of them, so after the
    warm-up ((v + 1) x pp forwards at most) two periods show every count there is: 4 x pp
    micro-batches stand for any larger m."""
    total = last = 0
    seen: set[tuple[int, int]] = set()
    for action in stage_actions("interleaved_1f1b", stage, pp, min(m, 4 * pp), v):
        step = 1 if action.kind == FORWARD else -1
        total += step
        last += step if action.chunk == v - 1 else 0
        if step == 1:
            seen.add((total, last))
    return tuple(a for a in seen if not any(b != a and b[0] >= a[0] and b[1] >= a[1]
                                            for b in seen))


@lru_cache(maxsize=4096)
def _messages(schedule: str, stage: int, pp: int, m: int, v: int) -> frozenset[tuple[int, int]]:
    """message_counts of a stage's schedule; as in _alive, 4 x pp micro-batches show every
    count a larger m has (the pattern repeats after the warm-up)."""
    actions = stage_actions(schedule, stage, pp, min(m, 4 * pp), v)
    return frozenset(message_counts(actions, stage, pp, v))


def kept_bytes(per_chunk: list[int], schedule: str, stage: int, layout: Layout) -> int:
    """stage_activation_bytes' peak over the schedule without walking every action, for a
    stage's chunks (equal but for the head on the last): 1f1b keeps min(PP - stage, m)
    micro-batches at most, gpipe all m."""
    pp, m, v = layout.pp_size, layout.num_microbatches, layout.virtual_pipeline_size
    if schedule == "gpipe":
        return m * per_chunk[0]
    if schedule == "1f1b":
        return min(pp - stage, m) * per_chunk[0]
    chunk, extra = per_chunk[0], per_chunk[-1] - per_chunk[0]
    assert all(b == chunk for b in per_chunk[:-1]), "a stage's chunks are equal"
    return max(total * chunk + last * extra for total, last in _alive(stage, pp, m, v))


class PeakPlanner:
    """planned_peak for one model over many layouts: the model's weights read once, and each
    layout's stages once for all of its options."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], m: ModelConfig):
        self.m = m
        self.weights = ModelWeights(shapes, m.num_layers, m.tie_word_embeddings)

    def stages(self, layout: Layout) -> list[StageWeights]:
        return self.weights.stages(layout)

    def peak(self, layout: Layout, stages: list[StageWeights],
             options: EngineOptions) -> tuple[int, int]:
        """(the largest planned peak of any stage's rank in bytes, that stage)."""
        worst, last_stage = (-1, 0), layout.pp_size - 1
        for stage in sorted({0, min(1, last_stage), last_stage}):  # the middle stages hold
            weights = stages[stage]  # what stage 1 does, less
            per_chunk = [chunk_activation_bytes(self.m, layout, options, len(chunk))
                         for chunk in weights.chunks]
            if stage == last_stage:
                per_chunk[-1] += head_activation_bytes(self.m, Tokens.of(layout),
                                                       compute_bytes(options.precision))
            kept = kept_bytes(per_chunk, options.pipeline_schedule, stage, layout)
            messages = _messages(options.pipeline_schedule, stage, layout.pp_size,
                                 layout.num_microbatches, layout.virtual_pipeline_size)
            step = stage_step(self.m, layout, options, weights, kept, set(messages))
            worst = max(worst, (stage_peak(weights, step), stage))
        return worst

    def state_floor(self, stages: list[StageWeights]) -> int:
        """The largest stage's state alone: a layout over budget here is over with any
        option."""
        return max(s.memory.total_bytes for s in stages)


def planned_peak(shapes: dict[str, tuple[int, ...]], m: ModelConfig, layout: Layout,
                 options: EngineOptions) -> tuple[int, int]:
    """(the largest planned peak of any stage's rank in bytes, that stage)."""
    planner = PeakPlanner(shapes, m)
    return planner.peak(layout, planner.stages(layout), options)
