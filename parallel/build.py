"""What parallelize's steps share while they apply a layout to one rank's model.

Each parallel axis applies itself as steps (parallel.layout.axes: Axis.steps), in three phases:

    cut     on the single-device model, before anything else: what this rank runs of it
            (a pipeline stage keeps its blocks only)
    shard   still on the meta device: the parallel layers replace the model's own, each holding
            this rank's shard (TP/SP layers with GTP_remat-sharded weights)
    wire    after this rank's parameters are allocated: what joins them at run time (the
            weight-gather bundles, context-parallel attention, the pipeline's chunk views)

A step reads the layout, the groups and the options from the Build and changes the model;
parallel.parallelize runs the phases (each in the registry's order) and wraps the result in a
ParallelModel, which finds what the steps made on the model itself (its parallel layers, their
bundles). The Build knows no axis but the pipeline's cut: every layout runs a part of the
model (the whole of it, as one chunk, without PP), so that part's types live here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import torch
from torch import nn

from parallel.groups import Groups
from parallel.layout import Layout
from parallel.layout.axes import REGISTRY
from parallel.layout.parallel_plan import ParallelPlan
from parallel.sharding import CommDtypes
from parallel.weight_grads import DeferredWeightGrads

PHASES = ("cut", "shard", "wire")


@dataclass(frozen=True)
class StagePart:
    """What one rank runs: its stage's chunks (block ranges, in virtual chunk order)."""

    chunks: list[range]
    first: bool  # holds the model's first chunk (the embedding)
    last: bool  # holds the model's last chunk (final norm, head, loss)

    def runs(self, chunk: int) -> tuple[bool, bool]:
        """(embedding, head) for this stage's virtual chunk `chunk`."""
        return self.first and chunk == 0, self.last and chunk == len(self.chunks) - 1


@dataclass(frozen=True)
class Pruned:
    holders: list[str]  # modules kept only to hold a weight a kept module shares (a copy)
    shared: list[str]  # weights this rank shares with the other end of the pipeline


@dataclass(frozen=True)
class CommOptions:
    """How the parallel layers communicate; none of these changes what is computed. Weights
    are always gathered in the compute dtype (bf16 under autocast: half the bytes, the same
    values). Each field is an axis's (Axis.comm_options, which names its config key)."""

    grad_reduce_in_compute_dtype: bool = False  # else gradients are summed in fp32
    overlap_param_gather: bool = False  # the next block's gather runs while this one computes
    overlap_grad_reduce: bool = False  # a block's reduce-scatter runs during earlier blocks'
    cp_comm_type: str = "p2p"  # context parallel attention: p2p (ring), all_gather or a2a
    pipeline_schedule: str = "1f1b"  # parallel.layout.pipeline_schedules.SCHEDULES
    moe_token_dispatcher_type: str = "alltoall"  # parallel.experts.DISPATCHERS

    def dtypes(self, compute_dtype: torch.dtype) -> CommDtypes:
        if compute_dtype == torch.float32:  # no autocast: messages in the masters' dtype
            return CommDtypes()
        return CommDtypes(compute_dtype,
                          compute_dtype if self.grad_reduce_in_compute_dtype else None)


def comm_options(value: Callable[[str], Any]) -> CommOptions:
    """CommOptions from the axes' registry: each axis's options, read by their config keys
    (`value`: config key -> its value; an enum as its string)."""
    read = {name: value(key) for axis in REGISTRY for name, key in axis.comm_options.items()}
    return CommOptions(**{name: v.value if isinstance(v, Enum) else v
                          for name, v in read.items()})


@dataclass
class Build:
    """One rank's model as the steps leave it, and what they made for the ParallelModel."""

    model: nn.Module
    plan: ParallelPlan
    layout: Layout
    groups: Groups
    rank: int
    options: CommOptions
    dtypes: CommDtypes
    # What every layout has, set by the pipeline's steps: this rank's part of the model (its
    # chunks; without PP the whole model as one), what the cut kept only as a copy (tied
    # embeddings), and one view of the model per chunk (none without PP: the model itself).
    part: StagePart | None = None
    pruned: Pruned = field(default_factory=lambda: Pruned([], []))
    chunks: list[nn.Module] = field(default_factory=list)
    # Where the schedule splits the backward (zero bubble): the linears' weight gradients wait
    # there for W (parallel.weight_grads); None: every backward is whole.
    weight_grads: DeferredWeightGrads | None = None

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sp_degree > 1
