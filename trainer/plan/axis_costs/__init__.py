"""Each parallel axis's rules for the model and its terms of the plan, one module an axis, named
as its entry of parallel.layout.axes is: what the axis asks of the model's shapes, and what it
adds to
a rank's memory and to a step's time. No torch: the checks, the dry run and the layout search use
them at compose time. The block's own tensors (what a block keeps, whatever the layout) are in
trainer.plan.activations; the plan's composition of the terms in trainer.plan.memory and
trainer.plan.cost.
"""
from __future__ import annotations

from parallel.layout import Layout
from trainer.config import ModelConfig
from trainer.plan.axis_costs import context, expert, pipeline, tensor
from trainer.plan.options import EngineOptions

# The axes that ask something of the model, in parallel.layout.axes.REGISTRY's order (GTP_remat pads
# a weight's rows and data parallel splits no tensor: they ask nothing).
MODEL_RULES = (tensor.check_model, context.check_model, expert.check_model,
               pipeline.check_model)


def check_model_fits_layout(model: ModelConfig, layout: Layout, options: EngineOptions) -> None:
    """Every axis's rules for the model under this layout and these options: a ValueError
    names the keys and the fix."""
    for rule in MODEL_RULES:
        rule(model, layout, options)
