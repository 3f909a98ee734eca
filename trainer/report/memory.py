"""Bytes each rank holds for parameters, gradients and optimizer state under a layout.

The model's parameter shapes come from its config (trainer.model.plan.parameter_shapes, held
equal to the built model's by a test); the placement follows the model's plan and the Layout:
planned weights are split over TP and their rows over GTP_remat (padded), small tensors stay
whole, optimizer state is sharded over weight_replica.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from parallel.layout import Layout
from parallel.pipeline.schedules import in_flight, stage_actions
from trainer.config import ModelConfig
from trainer.model.plan import (
    BLOCKS,
    EMBEDDING,
    parameter_shapes,  # noqa: F401  (the shapes every plan sizes from)
    tp_style,
)
from trainer.report.activations import stage_activation_bytes, step_memory
from trainer.train.options import EngineOptions


@dataclass(frozen=True)
class StageMemory:
    stage: int
    parameters: int  # elements this rank stores (its weight shards plus whole small tensors)
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    blocks: tuple[int, ...] = ()  # the blocks this stage holds

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes}


def local_numel(name: str, shape: tuple[int, ...], layout: Layout) -> tuple[int, bool]:
    """(elements this rank stores of parameter `name`, whether it is sharded): the TP slice of
    a planned weight, its rows padded to a multiple of GTP_remat as parallel.sharding pads
    them; anything else (norms) whole."""
    module = name.removesuffix(".weight")
    if module == EMBEDDING:
        style = "column"  # vocab-parallel: the rows (vocabulary) split over TP
    elif len(shape) == 2:
        style = tp_style(module)
    else:
        return math.prod(shape), False
    rows, cols = shape
    tp = layout.tp_size
    rows, cols = (rows // tp, cols) if style == "column" else (rows, cols // tp)
    return layout.shard_rows(rows) * cols, True


# (param, grad, optimizer) bytes per element. Weights, gradients and both AdamW moments are fp32
# under every train.precision: bf16 autocasts the compute (and halves activations); it does not
# change what a rank keeps between steps.
BYTES_PER_ELEMENT = (4, 4, 8)


def stage_of(name: str, layout: Layout, num_layers: int) -> int:
    """The pipeline stage that holds parameter `name` (Layout.pipeline_layers: blocks by model
    chunk; the embedding on the first stage, the final norm and head on the last)."""
    return stage_map(layout, num_layers)(name)


def stage_map(layout: Layout, num_layers: int):
    """stage_of for many names: the block split asked of the Layout once."""
    pp, prefix = layout.pp_size, f"{BLOCKS}."
    block_stage = {block: chunk % pp for chunk, blocks in
                   enumerate(layout.pipeline_layers(num_layers)) for block in blocks}

    def of(name: str) -> int:
        if name.startswith(prefix):
            return block_stage[int(name[len(prefix):].split(".", 1)[0])]
        return 0 if name.startswith(f"{EMBEDDING}.") else pp - 1
    return of


def memory_per_stage(shapes: dict[str, tuple[int, ...]], num_layers: int, layout: Layout,
                     tie_word_embeddings: bool = False) -> list[StageMemory]:
    """Per-rank memory for one rank of each pipeline stage, exactly as the trainer allocates
    it: shards padded by rows (GTP_remat), and the optimizer's two flat buffers (sharded
    weights, replicated tensors) padded to a multiple of the weight replicas, each replica
    updating one part (train.optim.FlatBuffer). Tied embeddings across stages: the last stage
    holds a copy of the embedding's shard and its gradient, outside the optimizer."""
    p_bytes, g_bytes, o_bytes = BYTES_PER_ELEMENT
    # sharded, replicated elements of each stage
    per_stage = [{True: 0, False: 0} for _ in range(layout.pp_size)]
    of = stage_map(layout, num_layers)
    for name, shape in shapes.items():
        numel, sharded = local_numel(name, shape, layout)
        per_stage[of(name)][sharded] += numel
    out = []
    for stage, kinds in enumerate(per_stage):
        copy = 0
        if tie_word_embeddings and layout.pp_size > 1 and stage == layout.pp_size - 1:
            name = f"{EMBEDDING}.weight"
            copy = local_numel(name, shapes[name], layout)[0]
        parts = [layout.optimizer_part(n) for n in kinds.values() if n]
        buffers = sum(parts) * layout.num_weight_replicas
        blocks = tuple(i for chunk in layout.stage_chunks(stage, num_layers) for i in chunk)
        out.append(StageMemory(stage, sum(kinds.values()) + copy,
                               (buffers + copy) * p_bytes, (buffers + copy) * g_bytes,
                               sum(parts) * o_bytes, blocks))
    return out


def step_per_stage(shapes: dict[str, tuple[int, ...]], model: ModelConfig, layout: Layout,
                   options: EngineOptions, state: list[StageMemory]) -> list[dict[str, int]]:
    """Each stage's activations and transients of one micro-batch (trainer.report.activations)
    and its planned peak: state plus all of them."""
    gathered = {name: local_numel(name, shape, layout)[0] * layout.gtp_remat_size
                for name, shape in shapes.items() if len(shape) == 2}
    first_block = [n for n in gathered if n.startswith(f"{BLOCKS}.0.")]
    of = stage_map(layout, model.num_layers)
    outside = {n: of(n) for n in gathered if not n.startswith(f"{BLOCKS}.")}
    if model.tie_word_embeddings:  # the head uses the embedding's weight on the last stage
        outside[f"{EMBEDDING}.weight.head"] = layout.pp_size - 1
        gathered[f"{EMBEDDING}.weight.head"] = gathered[f"{EMBEDDING}.weight"]
    m = layout.num_microbatches
    out = []
    for stage in state:
        last = stage.stage == layout.pp_size - 1
        chunks = layout.stage_chunks(stage.stage, model.num_layers)
        actions = stage_actions(options.pipeline_schedule, stage.stage, layout.pp_size, m,
                                layout.virtual_pipeline_size)
        kept = stage_activation_bytes(model, layout, options, chunks, last, actions)
        positions = [i for chunk in chunks for i in range(len(chunk))]  # within each chunk
        step = step_memory(model, layout, options, positions,
                           sum(gathered[n] for n in first_block),
                           max(gathered[n] for n in first_block),
                           max([gathered[n] for n, s in outside.items() if s == stage.stage],
                               default=0), kept, last, stage.stage == 0)
        out.append({**asdict(step), "peak_bytes": stage.total_bytes + step.transient_bytes,
                    "in_flight": in_flight(actions)})
    return out


def unsharded_memory(shapes: dict[str, tuple[int, ...]]) -> StageMemory:
    """The same model in one process: the reference the per-rank figures divide."""
    numel = sum(math.prod(shape) for shape in shapes.values())
    p_bytes, g_bytes, o_bytes = BYTES_PER_ELEMENT
    blocks = sorted({int(name.split(".")[1]) for name in shapes if name.startswith(f"{BLOCKS}.")})
    return StageMemory(0, numel, numel * p_bytes, numel * g_bytes, numel * o_bytes,
                       tuple(blocks))

