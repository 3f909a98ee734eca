"""A candidate layout's planned peak per rank, the same bytes as the dry run's memory plan
(trainer.plan.memory, held equal by tests/unit/test_auto.py) but summed per block instead of
per parameter: the search sizes thousands of layouts, the dry run one.
"""
from __future__ import annotations

from parallel.layout import Layout
from parallel.layout.pipeline_schedules import V_SHAPED
from trainer.config import ModelConfig
from trainer.plan.axis_costs.pipeline import schedule_messages
from trainer.plan.memory import ModelWeights, StageWeights
from trainer.plan.muon import MuonPlan
from trainer.plan.options import EngineOptions
from trainer.plan.stage_plan import stage_kept, stage_peak, stage_step


class PeakPlanner:
    """planned_peak for one model over many layouts: the model's weights read once, and each
    layout's stages once for all of its options."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], m: ModelConfig,
                 muon: MuonPlan | None = None, lora: bool = False, reference: bool = False,
                 base_bf16: bool = False):
        self.m = m
        self.weights = ModelWeights(shapes, m.num_layers, m.tie_word_embeddings, muon=muon,
                                    lora=lora, reference=reference, base_bf16=base_bf16)

    def stages(self, layout: Layout, schedule: str = "1f1b") -> list[StageWeights]:
        return self.weights.stages(layout, schedule in V_SHAPED)

    def peak(self, layout: Layout, stages: list[StageWeights],
             options: EngineOptions) -> tuple[int, int]:
        """(the largest planned peak of any stage's rank in bytes, that stage)."""
        schedule, pp = options.pipeline_schedule, layout.pp_size
        worst = (-1, 0)
        for stage in sorted({0, min(1, pp - 1), pp - 1}):  # the middle stages hold
            weights = stages[stage]  # what stage 1 does, less
            kept = stage_kept(self.m, layout, options, weights)
            messages = schedule_messages(schedule, stage, layout.pp_size,
                                         layout.num_microbatches, layout.virtual_pipeline_size)
            step = stage_step(self.m, layout, options, weights, kept, set(messages))
            worst = max(worst, (stage_peak(weights, step), stage))
        return worst

    def state_floor(self, stages: list[StageWeights]) -> int:
        """The largest stage's state alone: a layout over budget here is over with any
        option."""
        return max(s.memory.total_bytes for s in stages)


def planned_peak(shapes: dict[str, tuple[int, ...]], m: ModelConfig, layout: Layout,
                 options: EngineOptions, muon: MuonPlan | None = None) -> tuple[int, int]:
    """(the largest planned peak of any stage's rank in bytes, that stage)."""
    planner = PeakPlanner(shapes, m, muon)
    return planner.peak(layout, planner.stages(layout, options.pipeline_schedule), options)
