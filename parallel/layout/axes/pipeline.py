"""Pipeline parallel: the model's blocks cut into stages over pp, each stage's blocks into
virtual chunks for the interleaved schedule. Here its keys, rules and the split of the blocks;
its steps: parallel.pipeline.steps (schedules: parallel.layout.pipeline_schedules); its terms of the
plan: trainer.plan.axis_costs.pipeline.
"""
from __future__ import annotations

from parallel.layout.axes.axis import Axis, Group, Key, LayoutError, multiples_near, off

VIRTUAL = Key("virtual_pipeline_model_parallel_size", null="its default",
              effective="virtual_pipeline_size")
FIRST = Key("num_layers_in_first_pipeline_stage", null="its default", searched=False)
LAST = Key("num_layers_in_last_pipeline_stage", null="its default", searched=False)


def check_pipeline(layout) -> None:
    pp, v, m = layout.pp_size, layout.virtual_pipeline_size, layout.num_microbatches
    step = layout.micro_batch_times_batch_parallel_size
    if v > 1 and pp == 1:
        raise LayoutError(
            f"{VIRTUAL.config_key}={v} interleaves pipeline stages, but "
            f"parallel.pipeline_model_parallel_size=1. Fix: set {VIRTUAL.config_key}=null, or "
            f"PP > 1.")
    if v > 1 and m % pp:
        raise LayoutError(
            f"{VIRTUAL.config_key}={v}: virtual chunks run micro-batches in groups of PP "
            f"(interleaved_1f1b's rule, which zbv's V keeps here), so their number ({m} = "
            f"train.global_batch_size {layout.global_batch_size} / (train.micro_batch_size "
            f"{layout.micro_batch_size} x batch_parallel_size {layout.batch_parallel_size})) "
            f"must be divisible by "
            f"parallel.pipeline_model_parallel_size={pp}. Fix: set train.global_batch_size "
            f"to {multiples_near(layout.global_batch_size, pp * step)}.")
    for key in (FIRST, LAST):
        if getattr(layout, key.name) is not None and pp == 1:
            raise LayoutError(f"{key.config_key}={getattr(layout, key.name)} needs "
                              f"parallel.pipeline_model_parallel_size > 1. Fix: set it to null.")


def split_layers(layout, num_layers: int) -> list[range]:
    """The blocks of each model chunk, in model order (chunk c = virtual index x PP + stage):
    contiguous ranges. The ends take num_layers_in_first/last_pipeline_stage when set, the
    other stages split the rest evenly, and each stage's blocks split evenly over its virtual
    chunks. A split that does not divide raises, naming the keys."""
    pp, v = layout.pp_size, layout.virtual_pipeline_size
    set_ends = [(stage, key, getattr(layout, key.name))
                for stage, key in ((0, FIRST), (pp - 1, LAST))
                if pp > 1 and getattr(layout, key.name) is not None]
    fixed = {stage: n for stage, _, n in set_ends}
    rest, free = num_layers - sum(fixed.values()), pp - len(fixed)
    given = f" (model.num_layers={num_layers}" + "".join(
        f", {key.config_key}={n}" for _, key, n in set_ends) + ")"
    ends = " and ".join(key.config_key for _, key, _ in set_ends) or \
        "parallel.num_layers_in_first/last_pipeline_stage"
    if rest < 0 or (free == 0 and rest):
        raise LayoutError(
            f"the fixed stage layer counts add up to {sum(fixed.values())}, "
            f"{'more than' if rest < 0 else 'not'} the model's{given}. Fix: change {ends} "
            f"so that they do.")
    if free and rest % free:
        raise LayoutError(
            f"{rest} layers do not split evenly over the {free} pipeline stage(s) without a "
            f"fixed count{given}. Fix: set parallel.pipeline_model_parallel_size so that "
            f"they do, or {ends} to move layers to the first or last stage.")
    per_stage = [fixed.get(s, rest // free if free else 0) for s in range(pp)]
    for stage, n in enumerate(per_stage):
        if n < v or n % v:
            raise LayoutError(
                f"pipeline stage {stage} gets {n} layer(s){given}, which do not split into "
                f"{v} model chunk(s) of at least one layer ({VIRTUAL.config_key}={v}). Fix: "
                f"change {VIRTUAL.config_key}, parallel.pipeline_model_parallel_size or the "
                f"stage layer counts.")
    out, start = [], 0
    for chunk in range(pp * v):
        size = per_stage[chunk % pp] // v
        out.append(range(start, start + size))
        start += size
    return out


PIPELINE = Axis(
    "pipeline parallel", (off("pipeline_model_parallel_size"), VIRTUAL, FIRST, LAST),
    {"pp": "pp_size"},
    (Group("model_parallel", ("tp", "seq", "batch", "pp"), "TP x GTP_remat x PP: one model "
           "replica", "weight"),
     Group("pp", ("pp",), "pipeline stages, first to last", "weight"),
     Group("embedding", None, "first and last pipeline stage (tied embedding gradients)",
           "weight")),
    {"cut": "parallel.pipeline.steps:cut_to_stage", "wire": "parallel.pipeline.steps:chunk_views"},
    (check_pipeline,),
    expert_rank_axes={"pp": "pp_size"},  # the same stages in both views
    comm_options={"pipeline_schedule": "parallel.pipeline_schedule"})
