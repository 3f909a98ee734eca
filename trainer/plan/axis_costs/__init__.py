"""The cost side of each parallel axis, one module an axis, named as its entry of
parallel.layout.axes is, each registering one AxisCosts (entry.py): what the axis asks of the
model's shapes, what it adds to a rank's memory and to a step's time, its candidates for the
layout search and its words in what a person reads. REGISTRY holds them in
parallel.layout.axes.REGISTRY's order; the checks, trainer.plan.cost, trainer.auto.search and the
dry run loop over it. No torch: compose time imports it.
"""
from __future__ import annotations

from parallel.layout import Layout
from parallel.layout.axes import REGISTRY as AXES
from trainer.config import ModelConfig
from trainer.plan.axis_costs import context, data, expert, gtp_remat, pipeline, tensor
from trainer.plan.axis_costs.entry import AxisCosts
from trainer.plan.options import EngineOptions

REGISTRY: tuple[AxisCosts, ...] = (tensor.COSTS, gtp_remat.COSTS, context.COSTS, expert.COSTS,
                                   data.COSTS, pipeline.COSTS)
BY_AXIS = {costs.axis: costs for costs in REGISTRY}
assert tuple(BY_AXIS) == tuple(axis.name for axis in AXES), "one entry an axis, in its order"

# The axes that ask something of the model, in the registry's order (GTP_remat pads a weight's
# rows and data parallel splits no tensor: they ask nothing).
MODEL_RULES = tuple(costs.check_model for costs in REGISTRY if costs.check_model)


def _search_order() -> tuple[AxisCosts, ...]:
    """The registry in the order the layout search asks it: each entry whose candidates read a
    later axis's choices (chosen_after) right after that axis."""
    order = [costs for costs in REGISTRY if costs.chosen_after is None]
    for costs in REGISTRY:
        if costs.chosen_after is not None:
            order.insert(order.index(BY_AXIS[costs.chosen_after]) + 1, costs)
    return tuple(order)


SEARCH_ORDER = _search_order()


def check_model_fits_layout(model: ModelConfig, layout: Layout, options: EngineOptions) -> None:
    """Every axis's rules for the model under this layout and these options: a ValueError
    names the keys and the fix."""
    for rule in MODEL_RULES:
        rule(model, layout, options)


def describe_inputs(layout: Layout) -> str:
    """The axes' inputs as the dry run's inputs line shows them ("TP=2 SP=on weight_shards=8
    ... PP=4"), in the registry's order."""
    return " ".join(costs.inputs(layout) for costs in REGISTRY if costs.inputs)


def describe_layout(layout: Layout, values: dict) -> list[str]:
    """The axes' labels of a search candidate (trainer.auto.search.Candidate.describe), each at
    its place in the line."""
    labels = [label for costs in REGISTRY if costs.labels
              for label in costs.labels(layout, values)]
    return [text for _, text in sorted(labels)]
