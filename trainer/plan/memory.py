"""Bytes each rank holds under a layout: its parameters, gradients and optimizer state, the
weights it gathers for use, and (with trainer.plan.activations) its peak during a step.

The model's parameter shapes come from its config (trainer.parts.assembly.parameter_shapes, held
equal to the built model's by a test); the placement follows the model's plan and the Layout:
planned weights are split over TP and their rows over GTP_remat (padded), small tensors stay
whole, optimizer state is sharded over weight_replica. ModelWeights is the one place these
formulas are written: the dry run (trainer.plan.stage_plan) and the layout search
(trainer.plan.fit) both size a rank with it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from parallel.layout import Layout
from parallel.layout.pipeline_schedules import (
    model_chunk,
)
from parallel.layout.pipeline_schedules import stage_of as stage_of_chunk
from trainer.parts.assembly import (
    BLOCKS,
    EMBEDDING,
    kept_in_bf16,
    tp_style,
)
from trainer.parts.lora import is_adapter, whole_over_etp
from trainer.parts.mtp import MTP
from trainer.plan.muon import (
    HeldBuffer,
    HeldMatrix,
    MuonPlan,
    exchange_bytes,
    held_matrices,
    row_splits,
)

# (param, grad, optimizer) bytes per element. Weights, gradients and both AdamW moments are fp32
# under every train.precision: bf16 autocasts the compute (and halves activations); it does not
# change what a rank keeps between steps (but peft.base_precision=bf16 keeps the frozen
# matrices in BF16).
BYTES_PER_ELEMENT = (4, 4, 8)
BF16 = 2
EMBEDDING_WEIGHT = f"{EMBEDDING}.weight"
DEPTH_BLOCK = f"{MTP}.depths.0.block."  # the first multi-token prediction depth's block
UPDATE_TEMPORARIES = 2  # fp32 tensors of a part's size alive at once in AdamW's update


@dataclass(frozen=True)
class StageMemory:
    stage: int
    parameters: int  # elements this rank stores (its weight shards plus whole small tensors)
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    blocks: tuple[int, ...] = ()  # the blocks this stage holds
    # The optimizer update's transient: torch's AdamW forms sqrt(exp_avg_sq) and its quotient
    # by the bias correction beside each other, fp32 of the largest part this rank updates
    # (trainer.train.optim; the fp64 gradient norm is taken in chunks no larger).
    update_bytes: int = 0
    copy_elements: int = 0  # of `parameters`: a tied embedding's copy on the last stage
    buffer_bytes: int = 0  # the model's buffers here (a router's expert bias)
    muon_elements: int = 0  # of `parameters`: those optim=muon updates (one momentum each)
    # of `parameters`: frozen ones (peft=lora's base): no gradient, no optimizer state, and
    # outside the optimizer's flat buffers (each its own tensor, unpadded)
    frozen_elements: int = 0
    # train.objective=dpo under full fine-tuning: the reference, a frozen copy of this stage's
    # weights (in param_bytes, not in `parameters`: no checkpoint saves it)
    reference_elements: int = 0

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes

    @property
    def staging_bytes(self) -> int:
        """What checkpoint.async_save copies to host memory (trainer.checkpoint.saver): each
        parameter and its two Adam moments or its Muon momentum (a copy has none), and the
        buffers; nothing of a frozen one."""
        p_bytes = BYTES_PER_ELEMENT[0]
        # a frozen weight is not saved (peft=lora's checkpoints: the adapters), nor a frozen
        # embedding's copy
        copies = self.copy_elements * (3 if self.frozen_elements else 2)
        return p_bytes * (3 * self.parameters - copies - self.muon_elements
                          - 3 * self.frozen_elements) + self.buffer_bytes

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes,
                "staging_bytes": self.staging_bytes}


@dataclass(frozen=True)
class StageWeights:
    """One rank of a pipeline stage: what it keeps between steps, and the weights it gathers
    over GTP_remat to use them (TP-local elements, padding included)."""

    memory: StageMemory
    chunks: tuple[range, ...]  # its blocks by model chunk
    block_gathered: int  # one block's 2-D weights (the largest block's)
    ends_gathered: int  # the embedding's or the head's, the larger (0: neither is here)
    # a multi-token prediction depth's block's 2-D weights, and the largest of them (each
    # gathered on its own: the depths' blocks are not bundled); 0: no depth is here
    depth_gathered: int = 0
    depth_largest: int = 0
    gathered_by_block: tuple[int, ...] = ()  # each of its blocks' 2-D weights, in order
    muon_buffers: tuple[HeldBuffer, ...] = ()  # optim=muon: its buffers as the ranks hold them


# The optimizer's flat buffers (trainer.train.optim.ShardedOptimizer), each padded on its own:
# sharded weights, weights every rank holds whole (a router), norms (no decay), and experts
# (split over EP and ETP; their parts spread over expert DP, the others' over weight_replica).
# Under optim=muon its matrices of the sharded, whole and expert ones are three buffers more,
# with one momentum per element where AdamW keeps two moments.
SHARDED, WHOLE, NORMS, EXPERTS, MUON_SHARDED, MUON_WHOLE, MUON_EXPERTS = BUFFERS = range(7)
TO_MUON = {SHARDED: MUON_SHARDED, WHOLE: MUON_WHOLE, EXPERTS: MUON_EXPERTS}
BUFFER_NAMES = ("sharded", "whole", "norms", "experts", "muon_sharded", "muon_whole",
                "muon_experts")
MUON_STATE_BYTES = 4  # Muon's momentum (fp32) per element


def local_numel(name: str, shape: tuple[int, ...], layout: Layout, muon: bool = False
                ) -> tuple[int, int]:
    """(elements this rank stores of parameter `name`, the optimizer buffer it is in): the TP
    slice of a planned weight, its rows padded to a multiple of GTP_remat as parallel.sharding
    pads them; experts (3-D) split over EP and ETP; a weight the plan keeps whole, and norms,
    whole. muon: a matrix optim=muon takes (its buffer is Muon's counterpart)."""
    numel, buffer = _local_numel(name, shape, layout)
    return numel, TO_MUON[buffer] if muon else buffer


def _local_numel(name: str, shape: tuple[int, ...], layout: Layout) -> tuple[int, int]:
    module = name.removesuffix(".weight")
    if len(shape) == 3:  # parallel.experts: dim 0 over EP, each expert over ETP (a LoRA
        # factor beside a split one: whole over ETP)
        split = layout.ep_size if whole_over_etp(name) else layout.expert_split_size
        return math.prod(shape) // split, EXPERTS
    if module == EMBEDDING:
        style = "column"  # vocab-parallel: the rows (vocabulary) split over TP
    elif len(shape) == 2:
        style = tp_style(module)
    else:
        style = "whole"
    if style == "whole":
        return math.prod(shape), WHOLE if len(shape) >= 2 else NORMS
    rows, cols = layout.tp_local_shape(*shape, style == "column")
    return layout.shard_rows(rows) * cols, SHARDED


def stage_of(name: str, layout: Layout, num_layers: int) -> int:
    """The pipeline stage that holds parameter `name` (Layout.pipeline_layers: blocks by model
    chunk; the embedding on the first stage, the final norm and head on the last)."""
    prefix = f"{BLOCKS}."
    if name.startswith(prefix):
        block = int(name[len(prefix):].split(".", 1)[0])
        chunk = next(i for i, blocks in enumerate(layout.pipeline_layers(num_layers))
                     if block in blocks)
        return chunk % layout.pp_size
    return 0 if name.startswith(f"{EMBEDDING}.") else layout.pp_size - 1


class ModelWeights:
    """A model's parameters as a rank of any layout holds them. Blocks of the same shapes are
    read once (a stage sums its blocks by kind), so the search can size thousands of layouts;
    the embedding sits on the first stage, the final norm and head on the last. Tied
    embeddings across stages: the last stage holds a copy of the embedding's shard and its
    gradient, outside the optimizer, and its head gathers that weight; so does it for
    multi-token prediction's depths (trainer.parts.mtp), which embed the tokens ahead."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], num_layers: int,
                 tie_word_embeddings: bool = False, buffer_bytes: list[int] | None = None,
                 muon: MuonPlan | None = None, lora: bool = False, reference: bool = False,
                 base_bf16: bool = False):
        """buffer_bytes: each block's buffers (model_buffer_bytes), whole on every rank;
        muon: optim=muon's matrices (None: AdamW on every parameter); lora: only the adapters
        train (peft=lora; `shapes` has them), the rest is frozen; reference: a frozen copy
        of every weight beside them (DPO's reference under full fine-tuning); base_bf16:
        peft.base_precision=bf16, the frozen matrices (not the embedding) held in bf16."""
        self.reference, self.base_bf16 = reference, base_bf16
        prefix = f"{BLOCKS}."
        self.muon = muon
        names = muon.names if muon else frozenset()
        blocks: list[dict[str, tuple]] = [{} for _ in range(num_layers)]
        self.outside: list[tuple[str, tuple[int, ...], bool]] = []  # (name, shape, frozen)
        for name, shape in shapes.items():
            frozen = lora and not is_adapter(name)
            if name.startswith(prefix):
                index, rest = name[len(prefix):].split(".", 1)
                blocks[int(index)][rest] = (shape, name in names, frozen)
            else:
                self.outside.append((name, shape, frozen))
        kinds: dict[tuple, int] = {}
        self.kind_of = [kinds.setdefault(tuple(b.items()), len(kinds)) for b in blocks]
        self.kinds = list(kinds)
        self.num_layers, self.tied = num_layers, tie_word_embeddings
        self.mtp = any(name.startswith(f"{MTP}.") for name in shapes)
        self.embedding = shapes[EMBEDDING_WEIGHT]
        self.embedding_frozen = lora
        self.buffer_bytes = buffer_bytes or [0] * num_layers

    def stages(self, layout: Layout, v_shape: bool = False) -> list[StageWeights]:
        """Each pipeline stage's rank, exactly as the trainer allocates it: shards padded by
        rows (GTP_remat), experts split over EP, and the optimizer's flat buffers (SHARDED,
        WHOLE, NORMS, EXPERTS) each padded to a multiple of its replicas (weight_replica, or
        expert DP), each replica updating one part (trainer.train.optim.FlatBuffer)."""
        g, pp = layout.gtp_remat_size, layout.pp_size
        # per block kind: (elements per buffer, gathered elements, Muon matrices, frozen ones)
        kinds = []
        for kind in self.kinds:
            local = [(*local_numel(f"{BLOCKS}.0.{name}", shape, layout, muon), frozen)
                     for name, (shape, muon, frozen) in kind]
            kinds.append(([sum(n for n, b, f in local if b == buffer and not f)
                           for buffer in BUFFERS],
                          sum(n * g for n, b, _ in local if b in (SHARDED, MUON_SHARDED)),
                          [(b, self._held(f"{BLOCKS}.0.{name}", shape, b, layout))
                           for (name, (shape, _, _)), (_, b, _) in zip(kind, local)
                           if b in TO_MUON.values()],
                          sum(n for n, _, f in local if f),
                          sum(n for (n, _, _), (name, (shape, _, _)) in zip(local, kind)
                              if kept_in_bf16(f"{BLOCKS}.0.{name}", shape))))
        embedding = local_numel(EMBEDDING_WEIGHT, self.embedding, layout)[0]
        p_bytes, g_bytes, o_bytes = BYTES_PER_ELEMENT
        all_chunks, out = layout.pipeline_layers(self.num_layers), []
        last = stage_of_chunk(len(all_chunks) - 1, pp, v_shape)  # the head's (a V's: 0)
        for stage in range(pp):
            chunks = tuple(all_chunks[model_chunk(stage, c, pp, v_shape)]
                           for c in range(layout.virtual_pipeline_size))
            blocks = tuple(i for chunk in chunks for i in chunk)
            held = [kinds[self.kind_of[i]] for i in blocks]
            buffers = [sum(k[0][buffer] for k in held) for buffer in BUFFERS]
            matrices = [m for k in held for m in k[2]]  # (Muon buffer, its matrices)
            frozen = sum(k[3] for k in held)
            half = sum(k[4] for k in held) if self.base_bf16 else 0  # of them in bf16
            ends, depth = [], []
            for name, shape, is_frozen in self.outside:
                if stage == (0 if name.startswith(f"{EMBEDDING}.") else last):
                    muon = self.muon is not None and name in self.muon.names
                    numel, buffer = local_numel(name, shape, layout, muon)
                    if is_frozen:
                        frozen += numel
                        half += numel if self.base_bf16 and kept_in_bf16(name, shape) else 0
                    else:
                        buffers[buffer] += numel
                    if muon:
                        matrices.append((buffer, self._held(name, shape, buffer, layout)))
                    if buffer in (SHARDED, MUON_SHARDED) and name.startswith(f"{MTP}."):
                        depth += [numel * g] if name.startswith(DEPTH_BLOCK) else []
                    elif buffer in (SHARDED, MUON_SHARDED):
                        ends.append(numel * g)
            copy = 0
            # the head uses the embedding's weight, or multi-token prediction's depths embed
            if (self.tied or self.mtp) and stage == last:
                ends.append(embedding * g)
                copy = embedding if last != 0 else 0
            experts = (EXPERTS, MUON_EXPERTS)
            own = {b: layout.optimizer_part(n, b in experts) for b, n in enumerate(buffers) if n}
            flat = sum(part * layout.optimizer_replicas(b in experts) for b, part in own.items())
            muon = set(TO_MUON.values())
            state = sum(part * (MUON_STATE_BYTES if b in muon else o_bytes)
                        for b, part in own.items())
            muon_buffers = tuple(self._buffer(b, own[b], matrices, layout)
                                 for b in sorted(muon) if b in own)
            # AdamW's update, then each Muon buffer's (one after another)
            update = max([UPDATE_TEMPORARIES * g_bytes * part for b, part in own.items()
                          if b not in muon] + [exchange_bytes(h, self.muon.steps, g_bytes,
                                                              self.muon.ns_bytes)
                                                for h in muon_buffers], default=0)
            # a frozen embedding's copy on the last stage has no gradient either
            copy_grad = 0 if self.embedding_frozen else copy
            reference = sum(buffers) + copy + frozen if self.reference else 0
            memory = StageMemory(stage, sum(buffers) + copy + frozen,
                                 (flat + copy + frozen + reference) * p_bytes
                                 - half * (p_bytes - BF16),
                                 (flat + copy_grad) * g_bytes, state, blocks, update, copy,
                                 sum(self.buffer_bytes[i] for i in blocks),
                                 sum(buffers[b] for b in muon), frozen, reference)
            out.append(StageWeights(memory, chunks, max((k[1] for k in held), default=0),
                                    max(ends, default=0), sum(depth), max(depth, default=0),
                                    tuple(k[1] for k in held), muon_buffers))
        return out

    def _held(self, name: str, shape: tuple[int, ...], buffer: int, layout: Layout
              ) -> list[HeldMatrix]:
        style = {MUON_EXPERTS: "expert", MUON_WHOLE: "whole"}.get(buffer)
        style = style or tp_style(name.removesuffix(".weight"))
        return held_matrices(name, shape, style, layout,
                             row_splits(name, shape, self.muon.plan, self.muon.split))

    @staticmethod
    def _buffer(buffer: int, part: int, matrices: list, layout: Layout) -> HeldBuffer:
        """A Muon buffer of this stage: its matrices over its tile (TP x GTP_remat, or ETP
        for experts) and its replicas."""
        experts = buffer == MUON_EXPERTS
        return HeldBuffer(BUFFER_NAMES[buffer], experts,
                          layout.etp_size if experts else layout.weight_tile_size,
                          layout.optimizer_replicas(experts), part,
                          tuple(m for b, ms in matrices if b == buffer for m in ms))


def memory_per_stage(shapes: dict[str, tuple[int, ...]], num_layers: int, layout: Layout,
                     tie_word_embeddings: bool = False, muon: MuonPlan | None = None,
                     lora: bool = False, base_bf16: bool = False, v_shape: bool = False
                     ) -> list[StageMemory]:
    """What one rank of each pipeline stage keeps between steps (lora: only the adapters in
    `shapes` train; base_bf16: the frozen matrices in bf16; v_shape: a V's stages, zbv's)."""
    return [s.memory for s in ModelWeights(shapes, num_layers, tie_word_embeddings, muon=muon,
                                           lora=lora, base_bf16=base_bf16).stages(
        layout, v_shape)]


def unsharded_memory(shapes: dict[str, tuple[int, ...]], muon: MuonPlan | None = None,
                     lora: bool = False, base_bf16: bool = False) -> StageMemory:
    """The same model in one process: the reference the per-rank figures divide."""
    numel = sum(math.prod(shape) for shape in shapes.values())
    taken = sum(math.prod(s) for n, s in shapes.items() if muon and n in muon.names)
    frozen = sum(math.prod(s) for n, s in shapes.items() if lora and not is_adapter(n))
    half = sum(math.prod(s) for n, s in shapes.items() if base_bf16 and kept_in_bf16(n, s))
    p_bytes, g_bytes, o_bytes = BYTES_PER_ELEMENT
    blocks = sorted({int(name.split(".")[1]) for name in shapes if name.startswith(f"{BLOCKS}.")})
    return StageMemory(0, numel, numel * p_bytes - half * (p_bytes - BF16),
                       (numel - frozen) * g_bytes,
                       (numel - taken - frozen) * o_bytes + taken * MUON_STATE_BYTES,
                       tuple(blocks), muon_elements=taken, frozen_elements=frozen)
