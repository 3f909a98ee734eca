"""Each parallel axis's terms of the plan, one module an axis (parallel.axes registers the axes
themselves): what the axis adds to a rank's memory and to a step's time. No torch: the dry run
and the layout search use them at compose time. The block's own tensors (what a block keeps,
whatever the layout) are in trainer.plan.activations; the plan's composition of the terms in
trainer.plan.memory and trainer.plan.cost.
"""
