"""Data parallel: the ranks left when TP x GTP_remat x CP x PP have taken theirs. Replicas of a
weight shard sum their gradients and split the optimizer state (weight_replica); every batch
lane reads its own micro-batches. Its term of the plan: trainer.plan.axis_costs.data.
"""
from __future__ import annotations

from parallel.layout.axes.axis import Axis, Group, LayoutError, multiples_near


def check_world_size(layout) -> None:
    tile, world = layout.model_and_context_parallel_size, layout.world_size
    if world % tile:
        raise LayoutError(
            f"world_size={world} (cluster.num_nodes x cluster.procs_per_node) is not divisible "
            f"by TP x GTP_remat x CP x PP = {layout.tp_size} x {layout.gtp_remat_size} x "
            f"{layout.context_parallel_size} x {layout.pp_size} = {tile}. Fix: use a world "
            f"size that is a multiple of {tile} ({multiples_near(world, tile)}), or lower those "
            f"degrees.")


def check_batch(layout) -> None:
    """A global batch is whole micro-batches of every batch lane; null takes one of each."""
    step, gbs = layout.micro_batch_times_batch_parallel_size, layout.global_batch_size
    if gbs is None:
        object.__setattr__(layout, "global_batch_size", step)  # frozen: resolved once, here
    elif gbs % step:
        raise LayoutError(
            f"train.global_batch_size={gbs} is not a multiple of train.micro_batch_size="
            f"{layout.micro_batch_size} x batch_parallel_size={layout.batch_parallel_size} = "
            f"{step}. Fix: set train.global_batch_size to {multiples_near(gbs, step)}, or "
            f"null for {step}.")


DATA = Axis(
    "data parallel", (), {"dp": "data_parallel_size"},
    (Group("weight_replica", ("cp", "dp"), "ranks holding the same weight shard: gradients "
           "summed, optimizer state sharded", "weight"),
     Group("batch_lane", ("batch", "dp"), "one rank per independent micro-batch stream; index "
           "= batch partition", "token"),
     Group("token_distinct", ("seq", "batch", "cp", "dp"), "every rank that sees different "
           "tokens: the loss is summed here", "token")),
    rules=(check_world_size, check_batch))
