"""Data parallel's (weight replicas') cost entry: the optimizer's flat buffers reduce-scattered
and gathered over weight_replica once a step (time). (Its memory term is Layout.optimizer_part,
in trainer.plan.memory.ModelWeights; the search does not choose DP: it is the ranks left.)"""
from __future__ import annotations

from parallel.layout import Layout
from parallel.layout.axes.data import DATA
from trainer.parts.tokens import FP32
from trainer.plan.axis_costs.entry import AxisCosts, Micro
from trainer.plan.hardware import Hardware


def optimizer_seconds(layout: Layout, hw: Hardware, elements: float) -> float:
    """A stage holding `elements` weight elements: its gradients reduce-scattered and its
    weights gathered, fp32, each rank's share of the weight tile."""
    link = hw.link(layout, "weight_replica")
    return 2 * link.ring(layout.num_weight_replicas, elements / layout.weight_tile_size * FP32)


def step_s(k: Micro, micro_s: float, elements: list[int]) -> float:
    """The slowest of the planned stages' optimizer reductions."""
    slowest = 0.0
    for stage_elements in elements:
        slowest = max(slowest, optimizer_seconds(k.layout, k.hw, stage_elements))
    return slowest


COSTS = AxisCosts(
    DATA.name, step_kind="optimizer reduce", step_s=step_s,
    floor_step_s=lambda k, blocks: optimizer_seconds(k.layout, k.hw,
                                                     min(blocks) * k.grad_weights),
    labels=lambda lay, values: ((5, f"DP={lay.data_parallel_size}"),))
