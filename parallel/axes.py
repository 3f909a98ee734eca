"""The registry of parallel axes: each axis names, in one place, the config keys it adds to the
layout (Megatron's names), the rank axes it owns, the groups over them and the steps that apply
it to a model. parallel.layout builds its rank order, groups and input checks from it; the
compose-time checks, layout.json, the dry run and the layout search read the keys from it, and
parallel.parallelize runs its steps, instead of listing them.

Rank axes run fastest first in the registry's order, the seed's tp-cp-dp-pp with GTP_remat's
sequence and batch shards inside the weight tile: tp, seq, batch, cp, dp, pp. A group over some
rank axes holds all ranks that agree on every other axis; it belongs to the axis of its slowest
rank axis. Pure Python (no torch, no config library): compose time imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


class LayoutError(ValueError):
    """A parallel layout that breaks a rule of the contract; the message names keys and fix."""


@dataclass(frozen=True)
class Key:
    """One input of the layout: a Layout field, set by the config key `section.name`."""

    name: str
    section: str = "parallel"
    flag: bool = False  # true/false; otherwise an integer >= 1
    null: Optional[str] = None  # what null means (None: null is not allowed)
    fix: str = ""  # the fix of a value below 1

    @property
    def config_key(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    def check(self, value: Any) -> None:
        """The value's type and range; a LayoutError names the key and the fix."""
        if value is None and self.null is not None:
            return
        if self.flag:
            if not isinstance(value, bool):
                raise LayoutError(f"{self.config_key}={value!r} must be true or false.")
            return
        fix = self.fix or (f"set it to 1 or more, or {self.config_key}=null for {self.null}"
                           if self.null else f"set {self.config_key} to 1 or more")
        if not isinstance(value, int) or isinstance(value, bool):
            raise LayoutError(f"{self.config_key}={value!r} must be an integer >= 1. Fix: {fix}.")
        if value < 1:
            raise LayoutError(f"{self.config_key}={value} must be >= 1. Fix: {fix}.")


@dataclass(frozen=True)
class Group:
    name: str
    axes: Optional[tuple[str, ...]]  # None: not a product of rank axes (see Layout.groups)
    purpose: str
    view: str  # "weight" (who holds which weight shard) or "token" (who sees which tokens)


@dataclass(frozen=True)
class Axis:
    name: str
    keys: tuple[Key, ...]
    rank_axes: dict[str, str]  # fastest first: each rank axis and the Layout size of it
    groups: tuple[Group, ...]
    # How parallelize applies it: phase (parallel.build.PHASES) -> "module:function" of its
    # step, named here and imported only when a rank is built (this module imports no torch).
    steps: dict[str, str] = field(default_factory=dict)


def _off(name: str) -> Key:
    return Key(name, fix=f"set parallel.{name}=1 (off)")


TENSOR = Axis(
    "tensor parallel", (_off("tensor_model_parallel_size"), Key("sequence_parallel", flag=True)),
    {"tp": "tp_size"},
    (Group("tp", ("tp",), "tensor parallel: splits each weight column/row-wise; SP splits "
           "activations over it", "weight"),),
    {"shard": "parallel.tensor:shard_layers"})

GTP_REMAT = Axis(
    "GTP_remat weight and sequence shards",
    (Key("tensor_parallel_num_weight_shards", null="its default"),
     Key("tensor_parallel_num_sequence_shards", null="its default")),
    {"seq": "gtp_remat_num_sequence_shards", "batch": "gtp_remat_num_batch_shards"},
    (Group("gtp_remat", ("seq", "batch"), "weight sharding beyond TP: all-gathers weights before "
           "use, reduce-scatters their gradients", "weight"),
     Group("weight_tile", ("tp", "seq", "batch"), "TP x GTP_remat ranks that together hold one "
           "full copy of the weights", "weight")),
    {"wire": "parallel.bundle:bundle_blocks"})

CONTEXT = Axis(
    "context parallel", (_off("context_parallel_size"),), {"cp": "context_parallel_size"},
    (Group("context", ("seq", "cp"), "runtime CP (configured CP x sequence shards): split one "
           "sequence, exchange K/V", "token"),),
    {"wire": "parallel.context:inject_attention"})

DATA = Axis(
    "data parallel", (), {"dp": "data_parallel_size"},
    (Group("weight_replica", ("cp", "dp"), "ranks holding the same weight shard: gradients "
           "summed, optimizer state sharded", "weight"),
     Group("batch_lane", ("batch", "dp"), "one rank per independent micro-batch stream; index "
           "= batch partition", "token"),
     Group("token_distinct", ("seq", "batch", "cp", "dp"), "every rank that sees different "
           "tokens: the loss is summed here", "token")))

PIPELINE = Axis(
    "pipeline parallel",
    (_off("pipeline_model_parallel_size"),
     Key("virtual_pipeline_model_parallel_size", null="its default"),
     Key("num_layers_in_first_pipeline_stage", null="its default"),
     Key("num_layers_in_last_pipeline_stage", null="its default")),
    {"pp": "pp_size"},
    (Group("model_parallel", ("tp", "seq", "batch", "pp"), "TP x GTP_remat x PP: one model "
           "replica", "weight"),
     Group("pp", ("pp",), "pipeline stages, first to last", "weight"),
     Group("embedding", None, "first and last pipeline stage (tied embedding gradients)",
           "weight")),
    {"cut": "parallel.pipeline.steps:cut_to_stage", "wire": "parallel.pipeline.steps:chunk_views"})

REGISTRY = (TENSOR, GTP_REMAT, CONTEXT, DATA, PIPELINE)

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
PARALLEL_KEYS = tuple(key for axis in REGISTRY for key in axis.keys)
LAYOUT_KEYS = (WORLD, *PARALLEL_KEYS, *BATCH)  # the Layout's fields, in its order
# Products of rank axes first (the weight view's, then the token view's), then the others.
GROUPS = tuple(sorted((g for axis in REGISTRY for g in axis.groups),
                      key=lambda g: (g.axes is None, g.view != "weight")))


def group_names(view: str) -> tuple[str, ...]:
    """The groups of one view ("weight" or "token"), in the registry's order."""
    return tuple(g.name for axis in REGISTRY for g in axis.groups if g.view == view)
