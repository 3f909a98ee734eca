"""The parallel layout: every derived size and every rank group (contract: docs/layout.md).

Pure integer arithmetic over the rank axes of parallel.layout.axes (tp, seq, batch, cp, dp, pp;
and in the expert view etp, ep, edp, pp), no torch and no config library. Its inputs, and the
rules that relate them, are the axes' (each axis's module of parallel.layout.axes); the sizes
they derive are here. The resolver plugin, the dry run and the trainer all ask a Layout; nothing
else re-derives a size or a group.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

from parallel.layout.axes import (
    AXES,
    EXPERT_AXES,
    EXPERT_RANK_AXES,
    GROUPS,
    LAYOUT_KEYS,
    RANK_AXES,
    REGISTRY,
    LayoutError,
    multiples_near,
)
from parallel.layout.axes.context import zigzag_chunks
from parallel.layout.axes.pipeline import split_layers
from parallel.layout.pipeline_schedules import model_chunk

__all__ = ["AXES", "GROUP_AXES", "GROUP_NAMES", "GROUP_PURPOSE", "CONFIG_KEY", "Layout",
           "LayoutError", "RankCoords", "multiples_near"]

# Rank axes (fastest first), groups and inputs: parallel.layout.axes, one entry per parallel axis.
GROUP_AXES: dict[str, tuple[str, ...]] = {g.name: g.axes for g in GROUPS if g.axes is not None}
GROUP_ORDER = {g.name: g.order for g in GROUPS}  # "dense" or "expert" (parallel.layout.axes.expert)
ORDERS = {"dense": (AXES, RANK_AXES), "expert": (EXPERT_AXES, EXPERT_RANK_AXES)}
# "embedding" is not an axis product: it is the first and last stage of each pp group.
GROUP_NAMES = tuple(g.name for g in GROUPS)
GROUP_PURPOSE = {g.name: g.purpose for g in GROUPS}

# The config key a user sets for each input, used in every error message.
CONFIG_KEY = {key.name: key.config_key for key in LAYOUT_KEYS}

DERIVED_KEYS = (
    "world_size", "sp_degree", "gtp_remat_size", "gtp_remat_num_sequence_shards",
    "gtp_remat_num_batch_shards", "data_parallel_size", "batch_parallel_size",
    "runtime_context_parallel_size", "num_weight_replicas", "num_microbatches",
    "global_batch_size", "expert_data_parallel_size",
)


# A rank's index on each rank axis.
RankCoords = NamedTuple("RankCoords", [(axis, int) for axis in AXES])


@dataclass(frozen=True)
class Layout:
    """A validated layout. None inputs are replaced by their effective values at construction:
    weight shards -> TP, sequence shards -> SP degree, global batch -> micro x batch_parallel
    (parallel.layout.axes.data.check_batch). Construction runs every axis's rules."""

    world_size: int
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    tensor_parallel_num_weight_shards: int | None = None
    tensor_parallel_num_sequence_shards: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # null: TP
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None  # model chunks per stage; null = 1
    num_layers_in_first_pipeline_stage: int | None = None  # null: the even split
    num_layers_in_last_pipeline_stage: int | None = None
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    seq_length: int | None = None

    @classmethod
    def from_config(cls, parallel: Any, cluster: Any, train: Any) -> Layout:
        """From the parallel, cluster and train config nodes (DictConfig or dataclass): each
        input of parallel.layout.axes read from its section."""
        for key in ("num_nodes", "procs_per_node"):
            value = getattr(cluster, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"cluster.{key}={value!r} must be an integer >= 1.")
        sections = {"parallel": parallel, "train": train}
        return cls(cluster.num_nodes * cluster.procs_per_node,
                   **{key.name: getattr(sections[key.section], key.name)
                      for key in LAYOUT_KEYS if key.section})

    def __post_init__(self) -> None:
        for key in LAYOUT_KEYS:  # each input's type and range (parallel.layout.axes.Key.check)
            key.check(getattr(self, key.name))
        if self.tensor_parallel_num_weight_shards is None:
            object.__setattr__(self, "tensor_parallel_num_weight_shards", self.tp_size)
        if self.tensor_parallel_num_sequence_shards is None:
            object.__setattr__(self, "tensor_parallel_num_sequence_shards", self.sp_degree)
        for axis in REGISTRY:  # each axis's rules, in the registry's order (parallel.layout.axes)
            for rule in axis.rules:
                rule(self)

    # -------------------------------------------------------------------------- derived sizes

    @property
    def tp_size(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp_size(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def virtual_pipeline_size(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def ep_size(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp_size(self) -> int:
        return self.expert_tensor_parallel_size or self.tp_size

    @cached_property
    def expert_split_size(self) -> int:
        """Ranks one MoE layer's expert weights are split over (ETP x EP): each holds that
        fraction of them."""
        return self.etp_size * self.ep_size

    @cached_property
    def expert_data_parallel_size(self) -> int:
        """Ranks of a stage holding the same experts (the expert view's dp)."""
        return self.world_size // (self.etp_size * self.ep_size * self.pp_size)

    @cached_property
    def sp_degree(self) -> int:
        return self.tp_size if self.sequence_parallel else 1

    @cached_property
    def gtp_remat_size(self) -> int:
        return self.tensor_parallel_num_weight_shards // self.tp_size

    @cached_property
    def gtp_remat_num_sequence_shards(self) -> int:
        return self.tensor_parallel_num_sequence_shards // self.sp_degree

    @cached_property
    def gtp_remat_num_batch_shards(self) -> int:
        return self.gtp_remat_size // self.gtp_remat_num_sequence_shards

    @cached_property
    def model_and_context_parallel_size(self) -> int:
        """The ranks of one data-parallel replica: TP x GTP_remat x CP x PP."""
        return self.tp_size * self.gtp_remat_size * self.context_parallel_size * self.pp_size

    @cached_property
    def data_parallel_size(self) -> int:
        return self.world_size // self.model_and_context_parallel_size

    @cached_property
    def batch_parallel_size(self) -> int:
        return self.data_parallel_size * self.gtp_remat_num_batch_shards

    @cached_property
    def runtime_context_parallel_size(self) -> int:
        return self.context_parallel_size * self.gtp_remat_num_sequence_shards

    @cached_property
    def context_local_length(self) -> int:
        """Tokens of each sequence one rank keeps: its two zigzag chunks (before SP splits
        them again over TP between layers)."""
        return self.seq_length // self.runtime_context_parallel_size

    @cached_property
    def residual_local_length(self) -> int:
        """Tokens of each sequence the residual stream holds on a rank between blocks (what
        crosses pipeline stages): its context-local tokens, split again over TP with SP."""
        return self.context_local_length // self.sp_degree

    @cached_property
    def num_weight_replicas(self) -> int:
        return self.context_parallel_size * self.data_parallel_size

    @cached_property
    def micro_batch_tokens(self) -> int:
        """Tokens of one micro-batch over every rank that holds some of them (its samples of
        every batch lane, whole): what a mixture of experts balances and caps over."""
        return self.micro_batch_times_batch_parallel_size * self.seq_length

    @cached_property
    def micro_batch_times_batch_parallel_size(self) -> int:
        """Samples of one micro-batch on every batch lane: a global batch is a multiple of it
        (Megatron's micro_batch_times_data_parallel_size)."""
        return self.micro_batch_size * self.batch_parallel_size

    @cached_property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_times_batch_parallel_size

    @cached_property
    def weight_tile_size(self) -> int:
        """TP x GTP_remat: the ranks that together hold one full copy of the weights."""
        return self.tp_size * self.gtp_remat_size

    def tp_local_shape(self, rows: int, cols: int, column: bool) -> tuple[int, int]:
        """A TP-split weight's (rows, cols) on one TP rank: a column split divides its rows
        (outputs), a row split its columns (inputs)."""
        tp = self.tp_size
        return (rows // tp, cols) if column else (rows, cols // tp)

    def shard_rows(self, tp_local_rows: int) -> int:
        """Rows of a TP-local weight that one gtp_remat rank stores: padded up to a multiple of
        GTP_remat, so every rank of the group holds the same number (parallel.sharding)."""
        return -(-tp_local_rows // self.gtp_remat_size)

    def optimizer_part(self, numel: int, experts: bool = False) -> int:
        """Elements of a flat buffer of `numel` that one weight_replica rank updates (of an
        experts' buffer: one expert_data_parallel rank): padded up to a multiple of the
        replicas (ZeRO-1 over weight_replica, or expert DP)."""
        return -(-numel // self.optimizer_replicas(experts))

    def optimizer_replicas(self, experts: bool = False) -> int:
        """The ranks one flat buffer's parts are spread over."""
        return self.expert_data_parallel_size if experts else self.num_weight_replicas

    def pipeline_layers(self, num_layers: int) -> list[range]:
        """The blocks of each model chunk, in model order (axes.pipeline.split_layers;
        raises naming the keys where they do not split)."""
        cache = self.__dict__.setdefault("_layers_cache", {})  # frozen: not through setattr
        if num_layers not in cache:
            cache[num_layers] = split_layers(self, num_layers)
        return list(cache[num_layers])

    def stage_chunks(self, stage: int, num_layers: int, v_shape: bool = False) -> list[range]:
        """The blocks of each of `stage`'s virtual chunks, in chunk order (v_shape: a V's
        placement, pipeline_schedules.model_chunk)."""
        chunks = self.pipeline_layers(num_layers)
        return [chunks[model_chunk(stage, c, self.pp_size, v_shape)]
                for c in range(self.virtual_pipeline_size)]

    def derived(self) -> dict[str, int]:
        """The values the config's read-only `layout` node carries, in DERIVED_KEYS order."""
        return {key: getattr(self, key) for key in DERIVED_KEYS}

    # ------------------------------------------------------------------- ranks and coordinates

    @cached_property
    def axis_sizes(self) -> dict[str, int]:
        """Each rank axis's size in the dense view."""
        return {axis: self._sizes[axis] for axis in AXES}

    @cached_property
    def axis_strides(self) -> dict[str, int]:
        return {axis: self._strides[axis] for axis in AXES}

    @cached_property
    def expert_axis_sizes(self) -> dict[str, int]:
        """Each rank axis's size in the expert view (etp, ep, edp, pp)."""
        return {axis: self._sizes[axis] for axis in EXPERT_AXES}

    @cached_property
    def _sizes(self) -> dict[str, int]:  # both views' (a name is in one view, but pp)
        return {axis: getattr(self, size) for _, sizes in ORDERS.values()
                for axis, size in sizes.items()}

    @cached_property
    def _strides(self) -> dict[str, int]:  # each axis's in its view (pp's is the same in both)
        strides = {}
        for axes, _ in ORDERS.values():
            stride = 1
            for axis in axes:
                strides[axis] = stride
                stride *= self._sizes[axis]
        return strides

    def expert_coords(self, rank: int) -> dict[str, int]:
        """A rank's index on each rank axis of the expert view."""
        return self._coords(rank, EXPERT_AXES)

    def _coords(self, rank: int, axes: tuple[str, ...]) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is outside world size {self.world_size}")
        return {a: rank // self._strides[a] % self._sizes[a] for a in axes}

    def coords(self, rank: int) -> RankCoords:
        """A rank's index on each rank axis of the dense view."""
        return RankCoords(**self._coords(rank, AXES))

    def rank(self, coords: RankCoords) -> int:
        for axis, index in zip(AXES, coords):
            if not 0 <= index < self.axis_sizes[axis]:
                raise IndexError(f"{axis} index {index} outside size {self.axis_sizes[axis]}")
        return sum(index * self.axis_strides[a] for a, index in zip(AXES, coords))

    # ------------------------------------------------------------------------------- groups

    def _offsets(self, axes: tuple[str, ...]) -> list[int]:
        """Rank offsets of a group's members from its lowest rank; list index = position."""
        offsets = [0]
        for axis in axes:  # fastest first, so each later axis is an outer loop: ascending
            stride = self._strides[axis]
            offsets = [i * stride + o for i in range(self._sizes[axis]) for o in offsets]
        return offsets

    def _axes_of(self, name: str) -> tuple[str, ...]:
        if name not in GROUP_AXES:
            raise KeyError(f"unknown group {name!r}; groups are {', '.join(GROUP_NAMES)}")
        return GROUP_AXES[name]

    def groups(self, name: str) -> list[list[int]]:
        """Every group of this kind, in increasing order of its lowest rank."""
        if name == "embedding":
            return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in self.groups("pp")]
        axes = self._axes_of(name)
        view = ORDERS[GROUP_ORDER[name]][0]
        bases = self._offsets(tuple(a for a in view if a not in axes))
        bases.sort()
        offsets = self._offsets(axes)
        return [[base + o for o in offsets] for base in bases]

    def all_groups(self) -> dict[str, list[list[int]]]:
        return {name: self.groups(name) for name in GROUP_NAMES}

    def group(self, name: str, rank: int) -> list[int]:
        """The group of this kind that holds `rank`; for "embedding", [] on a middle stage."""
        if name == "embedding":
            pp = self.group("pp", rank)
            members = [pp[0], pp[-1]] if len(pp) > 1 else pp
            return members if rank in members else []
        axes = self._axes_of(name)
        coords = self._coords(rank, ORDERS[GROUP_ORDER[name]][0])
        base = rank - sum(coords[a] * self._strides[a] for a in axes)
        return [base + o for o in self._offsets(axes)]

    def position(self, name: str, rank: int) -> int:
        """`rank`'s index inside its group: the mixed-radix index of the grouped axes."""
        if name == "embedding":
            members = self.group(name, rank)
            if not members:
                raise ValueError(f"rank {rank} is a middle pipeline stage: it is in no "
                                 f"embedding group")
            return members.index(rank)
        axes = self._axes_of(name)
        coords, index, radix = self._coords(rank, ORDERS[GROUP_ORDER[name]][0]), 0, 1
        for axis in axes:
            index += coords[axis] * radix
            radix *= self._sizes[axis]
        return index

    def runtime_cp_rank(self, rank: int) -> int:
        """seq_idx + ns * cp_idx: which pair of zigzag chunks of each sequence this rank keeps."""
        return self.position("context", rank)

    def batch_partition(self, rank: int) -> int:
        """batch_idx + nb * dp_idx: which independent micro-batch stream this rank reads."""
        return self.position("batch_lane", rank)

    def weight_shard(self, rank: int) -> int:
        """Which 1/G slice of its TP-local weights this rank stores (position in gtp_remat)."""
        return self.position("gtp_remat", rank)

    def micro_batch_samples(self, lane: int, micro: int) -> range:
        """Indices, within the global batch, of batch lane `lane`'s micro-batch `micro`. The
        global batch is read as [num_microbatches, batch_parallel_size, micro_batch_size]."""
        if not (0 <= lane < self.batch_parallel_size and 0 <= micro < self.num_microbatches):
            raise IndexError(f"lane {lane} / micro-batch {micro} outside "
                             f"{self.batch_parallel_size} lanes x {self.num_microbatches}")
        start = (micro * self.batch_parallel_size + lane) * self.micro_batch_size
        return range(start, start + self.micro_batch_size)

    def context_chunk_ids(self, rank: int) -> tuple[int, int]:
        """With runtime CP = C > 1 a sequence is cut into 2C chunks and runtime CP rank r keeps
        chunks r and 2C-1-r (in that local order), so every rank gets the same share of
        causal-attention work."""
        return zigzag_chunks(self.runtime_cp_rank(rank), self.runtime_context_parallel_size)

    def context_chunks(self, rank: int) -> list[range]:
        """Token positions of a sequence that `rank` keeps (its chunks, see context_chunk_ids)."""
        if self.seq_length is None:
            raise ValueError("context_chunks needs seq_length")
        cp, seq = self.runtime_context_parallel_size, self.seq_length
        if cp == 1:
            return [range(seq)]
        chunk = seq // (2 * cp)
        return [range(i * chunk, (i + 1) * chunk) for i in self.context_chunk_ids(rank)]

    def group_span(self, name: str) -> int:
        """Consecutive ranks one group of this kind reaches across, from its lowest rank to its
        highest: within an NVLink domain of that many ranks, its collectives stay on NVLink."""
        return self._spans[name]

    @cached_property
    def _spans(self) -> dict[str, int]:
        return {name: 1 + sum((self._sizes[a] - 1) * self._strides[a] for a in axes)
                for name, axes in GROUP_AXES.items()}

    def weight_tiles_crossing(self, domain_size: int) -> list[list[int]]:
        """Weight tiles (TP x GTP_remat consecutive ranks) that span more than one NVLink
        domain of `domain_size` consecutive ranks: their gathers would leave NVLink."""
        if domain_size < 1:
            raise LayoutError(f"cluster.gpus_per_nvlink_domain={domain_size} must be >= 1.")
        size = self.weight_tile_size
        return [[start, start + size - 1] for start in range(0, self.world_size, size)
                if start // domain_size != (start + size - 1) // domain_size]
