"""Simulating a pipeline schedule: each stage's actions (parallel.layout.pipeline_schedules) run
as a dataflow with given costs, giving a step's time, each stage's busy time and the bubble.

Pure Python, like the schedules: the tests prove with it that no schedule deadlocks and that
each meets its bubble; the plan's cost model and the benchmarks compare schedules by it.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel.layout.pipeline_schedules import (
    BACKWARD,
    FORWARD,
    INPUT,
    V_SHAPED,
    WEIGHT,
    Action,
    check_schedule,
    in_flight,
    model_chunk,
    stage_actions,
    stage_of,
)


@dataclass(frozen=True)
class Simulation:
    """What a schedule costs on one step: the time it takes and how idle and full each stage is."""

    makespan: float
    busy: tuple[float, ...]  # per stage, time spent computing
    bubble_fraction: float  # 1 - mean(busy) / makespan
    in_flight: tuple[int, ...]  # per stage, in_flight(stage_actions(...))


GRADIENT = "G"  # a chunk's input gradient is formed: its B or its I


def _input_of(action: Action, stage: int, pp: int, virtual: int, v_shape: bool
              ) -> tuple[str, int, int] | None:
    """(what, micro-batch, model chunk) that must finish before `action` can start; None for the
    forward of model chunk 0, whose input is the data. A W waits for its own I."""
    chunk = model_chunk(stage, action.chunk, pp, v_shape)
    if action.kind == FORWARD:
        return None if chunk == 0 else (FORWARD, action.microbatch, chunk - 1)
    if action.kind == WEIGHT:
        return (GRADIENT, action.microbatch, chunk)
    if chunk == pp * virtual - 1:
        return (FORWARD, action.microbatch, chunk)  # the loss: the last chunk's own forward
    return (GRADIENT, action.microbatch, chunk + 1)


def simulate_orders(orders: list[list[Action]], pp: int, virtual: int = 1,
                    forward_time: float = 1.0, backward_time: float = 2.0,
                    hop_time: float = 0.0, weight_time: float | None = None,
                    v_shape: bool = False, stage_scale: tuple[float, ...] | None = None
                    ) -> Simulation:
    """Run each stage's order as a dataflow: an action starts once its stage is free and its input
    has arrived (its producer finished, plus hop_time when that producer is another stage).
    A whole stage's F takes forward_time, B backward_time, of which W takes weight_time
    (default half) and I the rest; a chunk's, 1/virtual of those; stage_scale: each stage's
    actions take that multiple (stages of unequal work: the embedding's, the head's).
    Raises RuntimeError if the orders deadlock, naming what each stuck stage waits for."""
    if pp < 1 or len(orders) != pp:
        raise ValueError(f"got {len(orders)} stage orders for pp={pp}; need one per stage.")
    weight_time = backward_time / 2 if weight_time is None else weight_time
    duration = {FORWARD: forward_time / virtual, BACKWARD: backward_time / virtual,
                INPUT: (backward_time - weight_time) / virtual, WEIGHT: weight_time / virtual}
    finished: dict[tuple[str, int, int], float] = {}
    next_index = [0] * pp
    stage_free = [0.0] * pp
    busy = [0.0] * pp
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for stage, order in enumerate(orders):
            # Run this stage as far as its inputs allow before looking at the next one; the
            # times do not depend on the sweep order, only on each stage's list order.
            while next_index[stage] < len(order):
                action = order[next_index[stage]]
                needed = _input_of(action, stage, pp, virtual, v_shape)
                ready = 0.0
                if needed is not None:
                    if needed not in finished:
                        break
                    producer_stage = stage_of(needed[2], pp, v_shape)
                    ready = finished[needed] + (hop_time if producer_stage != stage else 0.0)
                start = max(stage_free[stage], ready)
                took = duration[action.kind] * (stage_scale[stage] if stage_scale else 1.0)
                stage_free[stage] = start + took
                busy[stage] += took
                what = action.kind if action.kind in (FORWARD, WEIGHT) else GRADIENT
                finished[(what, action.microbatch,
                          model_chunk(stage, action.chunk, pp, v_shape))] = stage_free[stage]
                next_index[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [f"stage {stage}: {order[next_index[stage]]} waits for "
                     f"{_input_of(order[next_index[stage]], stage, pp, virtual, v_shape)}"
                     for stage, order in enumerate(orders) if next_index[stage] < len(order)]
            raise RuntimeError("pipeline orders deadlock; " + "; ".join(stuck))
    makespan = max(stage_free)
    bubble = 1.0 - (sum(busy) / pp) / makespan if makespan > 0 else 0.0
    return Simulation(makespan=makespan, busy=tuple(busy), bubble_fraction=bubble,
                      in_flight=tuple(in_flight(order) for order in orders))


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a step under `schedule` with a backward twice the forward, split
    evenly into I and W: ideal_bubble_fraction for the 1F1B family and gpipe, about a third
    of 1F1B's for zb_h1 and less for zbv (where W costs what I does; less where it is less)."""
    return simulate(schedule, pp, microbatches, virtual).bubble_fraction


def simulate(schedule: str, pp: int, microbatches: int, virtual: int = 1,
             forward_time: float = 1.0, backward_time: float = 2.0,
             hop_time: float = 0.0, weight_time: float | None = None,
             stage_scale: tuple[float, ...] | None = None) -> Simulation:
    """Simulate one step of `schedule` over all pp stages (see simulate_orders)."""
    check_schedule(schedule, 0, pp, microbatches, virtual)  # before any stage's list is built
    orders = [stage_actions(schedule, stage, pp, microbatches, virtual) for stage in range(pp)]
    return simulate_orders(orders, pp, virtual, forward_time, backward_time, hop_time,
                           weight_time, schedule in V_SHAPED, stage_scale)
