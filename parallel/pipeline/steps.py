"""The pipeline axis's steps of parallelize (parallel.layout.axes: PIPELINE.steps).

cut (first, on the single-device model): this rank's part of the model, its stage's chunks
(without PP the whole model as one chunk); with PP the model is pruned to them before anything
is allocated, so a rank never holds another stage's weights.
wire: one view of the model per chunk, which the runner calls in the schedule's order.
"""
from __future__ import annotations

from parallel.build import Build, StagePart
from parallel.layout.pipeline_schedules import V_SHAPED, last_stage
from parallel.pipeline.stages import chunk_view, prune, shared_weights


def cut_to_stage(build: Build) -> None:
    layout, plan = build.layout, build.plan
    stage = layout.coords(build.rank).pp
    blocks = len(getattr(build.model, plan.blocks))
    schedule = build.options.pipeline_schedule
    build.part = StagePart(layout.stage_chunks(stage, blocks, schedule in V_SHAPED), stage == 0,
                           stage == last_stage(schedule, layout.pp_size,
                                               layout.virtual_pipeline_size))
    if layout.pp_size > 1:
        build.pruned = prune(build.model, plan, build.part, shared_weights(build.model))


def chunk_views(build: Build) -> None:
    if build.layout.pp_size > 1:
        build.chunks = [chunk_view(build.model, build.plan, build.part, chunk)
                        for chunk in range(len(build.part.chunks))]
