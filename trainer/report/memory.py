"""Bytes each rank holds for parameters, gradients and optimizer state under a layout.

The model's parameter shapes come from the real model built on the meta device (no memory, no
GPU); the placement rules are the contract's: 2-D weights are split over TP x GTP_remat, small
tensors stay whole, optimizer state is sharded over weight_replica.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from parallel.layout import Layout
from trainer.config import ModelConfig


@dataclass(frozen=True)
class StageMemory:
    stage: int
    parameters: int  # elements this rank stores (its weight shards plus whole small tensors)
    param_bytes: int
    grad_bytes: int
    optim_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes}


def parameter_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    import torch

    from trainer.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(model_cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def stage_of(name: str, num_layers: int, num_stages: int) -> int:
    """Contiguous, balanced split of the blocks; embedding first, final norm and head last."""
    if name.startswith("layers."):
        return int(name.split(".")[1]) * num_stages // num_layers
    return 0 if name.startswith("embed.") else num_stages - 1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# (param, grad, optimizer) bytes per element. Weights, gradients and both AdamW moments are fp32
# under every train.precision: bf16 autocasts the compute (and halves activations); it does not
# change what a rank keeps between steps.
BYTES_PER_ELEMENT = (4, 4, 8)


def memory_per_stage(shapes: dict[str, tuple[int, ...]], num_layers: int,
                     layout: Layout) -> list[StageMemory]:
    """Per-rank memory for one rank of each pipeline stage (every rank of a stage holds the
    same amount, up to the rounding of uneven shards, which is rounded up here)."""
    weight_tile = layout.tp_size * layout.gtp_remat_size
    replicas = layout.num_weight_replicas
    p_bytes, g_bytes, o_bytes = BYTES_PER_ELEMENT
    stored = [0] * layout.pp_size
    optim = [0] * layout.pp_size
    for name, shape in shapes.items():
        numel = math.prod(shape)
        local = _ceil_div(numel, weight_tile) if len(shape) >= 2 else numel
        stage = stage_of(name, num_layers, layout.pp_size)
        stored[stage] += local
        optim[stage] += _ceil_div(local, replicas)
    return [StageMemory(s, stored[s], stored[s] * p_bytes, stored[s] * g_bytes,
                        optim[s] * o_bytes) for s in range(layout.pp_size)]


def unsharded_memory(shapes: dict[str, tuple[int, ...]]) -> StageMemory:
    """The same model in one process: the reference the per-rank figures divide."""
    numel = sum(math.prod(shape) for shape in shapes.values())
    p_bytes, g_bytes, o_bytes = BYTES_PER_ELEMENT
    return StageMemory(0, numel, numel * p_bytes, numel * g_bytes, numel * o_bytes)

