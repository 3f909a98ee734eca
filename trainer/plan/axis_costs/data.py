"""Data parallel's (weight replicas') term of time: the optimizer's flat buffers reduce-scattered
and gathered over weight_replica once a step. (Its memory term is Layout.optimizer_part, in
trainer.plan.memory.ModelWeights.)"""
from __future__ import annotations

from parallel.layout import Layout
from trainer.plan.hardware import Hardware
from trainer.plan.tokens import FP32


def optimizer_seconds(layout: Layout, hw: Hardware, elements: float) -> float:
    """A stage holding `elements` weight elements: its gradients reduce-scattered and its
    weights gathered, fp32, each rank's share of the weight tile."""
    link = hw.link(layout, "weight_replica")
    return 2 * link.ring(layout.num_weight_replicas, elements / layout.weight_tile_size * FP32)
