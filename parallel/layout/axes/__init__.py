"""The registry of parallel axes. Each axis is a module of this package that names, in one
place, the config keys it adds to the layout (Megatron's names), the rank axes it owns, the
groups over them, the rules that relate its degrees to the others' and the steps that apply it
to a model (axis.py: what an entry is made of). parallel.layout builds its rank order, groups
and input checks from the registry and runs the rules; the compose-time checks, layout.json,
the dry run and the layout search read the keys from it, and parallel.parallelize runs the
steps, instead of listing them.

Rank axes run fastest first in the registry's order, the seed's tp-cp-ep-dp-pp with GTP_remat's
sequence and batch shards inside the weight tile: tp, seq, batch, cp, dp, pp (EP adds no axis to
this dense view: it splits dp's ranks). The expert view orders the same world as etp, ep, edp,
pp (Megatron-Core's two rank generators; parallel.layout.axes.expert). A group over some rank
axes of one view holds all ranks that agree on every other axis of it; it belongs to the axis of
its slowest rank axis. Pure Python (no torch, no config library): compose time imports it.
"""
from __future__ import annotations

from parallel.layout.axes.axis import Axis, Group, Key, LayoutError, multiples_near
from parallel.layout.axes.context import CONTEXT
from parallel.layout.axes.data import DATA
from parallel.layout.axes.expert import EXPERT
from parallel.layout.axes.gtp_remat import GTP_REMAT
from parallel.layout.axes.pipeline import PIPELINE
from parallel.layout.axes.tensor import TENSOR

__all__ = ["AXES", "BATCH", "COMM_KEYS", "EXPERT_AXES", "EXPERT_RANK_AXES", "GROUPS",
           "LAYOUT_KEYS", "PARALLEL_KEYS", "RANK_AXES", "REGISTRY", "WORLD", "Axis", "Group",
           "Key", "LayoutError", "group_names", "multiples_near"]

REGISTRY = (TENSOR, GTP_REMAT, CONTEXT, EXPERT, DATA, PIPELINE)

# The layout's other inputs: the world and the batch.
WORLD = Key("world_size", section="", fix="world_size = cluster.num_nodes x "
            "cluster.procs_per_node; set those to 1 or more")
BATCH = (Key("micro_batch_size", section="train"),
         Key("global_batch_size", section="train", null="train.micro_batch_size x "
             "batch_parallel_size"),
         Key("seq_length", section="train", null="a layout of degrees alone (no sequence checks)",
             fix="set it to the tokens of one sample"))

RANK_AXES = {a: size for axis in REGISTRY for a, size in axis.rank_axes.items()}
AXES = tuple(RANK_AXES)
EXPERT_RANK_AXES = {a: size for axis in REGISTRY for a, size in axis.expert_rank_axes.items()}
EXPERT_AXES = tuple(EXPERT_RANK_AXES)
PARALLEL_KEYS = tuple(key for axis in REGISTRY for key in axis.keys)
LAYOUT_KEYS = (WORLD, *PARALLEL_KEYS, *BATCH)  # the Layout's fields, in its order
# The config keys of the axes' communication options (parallel.build.CommOptions).
COMM_KEYS = tuple(key for axis in REGISTRY for key in axis.comm_options.values())
# Products of dense rank axes first (the weight view's, then the token view's), then of expert
# rank axes, then the others.
GROUPS = tuple(sorted((g for axis in REGISTRY for g in axis.groups),
                      key=lambda g: (g.axes is None, g.order != "dense", g.view != "weight")))


def group_names(view: str, order: str = "dense") -> tuple[str, ...]:
    """The groups of one view ("weight" or "token") over one rank order, in the registry's
    order."""
    return tuple(g.name for axis in REGISTRY for g in axis.groups
                 if g.view == view and g.order == order)
