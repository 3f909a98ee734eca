"""Build one rank's training engine from the typed config: groups, model, optimizer.

The model is built whole from the seed on every rank, then cut by parallelize, so every layout
starts from the same full weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.comm import CommStats
from parallel.groups import Groups, build_groups
from parallel.layout import Layout
from parallel.parallelize import ParallelModel, parallelize
from trainer.config import ModelConfig, OptimConfig, Precision
from trainer.model import Transformer, check_model_config
from trainer.optim import ShardedAdamW


@dataclass
class Engine:
    layout: Layout
    groups: Groups
    model: ParallelModel
    optimizer: ShardedAdamW


def check_model_fits_layout(model: ModelConfig, layout: Layout) -> None:
    """Shapes tensor parallel must split evenly (GTP pads rows, so it needs nothing)."""
    check_model_config(model)
    tp = layout.tp_size
    for key in ("num_heads", "ffn_hidden_size", "vocab_size"):
        value = getattr(model, key)
        if value % tp:
            raise ValueError(
                f"model.{key}={value} is not divisible by parallel.tensor_model_parallel_size="
                f"{tp}. Fix: choose a TP degree that divides it, or change the model.")
    if layout.pp_size > 1:
        raise ValueError(
            f"parallel.pipeline_model_parallel_size={layout.pp_size}: pipeline stages are not "
            f"supported in training yet (dry runs accept them). Fix: set it to 1.")


COMPUTE_DTYPE = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16}


def build_engine(model_cfg: ModelConfig, optim_cfg: OptimConfig, seed: int, layout: Layout,
                 device: torch.device, precision: Precision = Precision.fp32) -> Engine:
    """Collective over the default process group."""
    check_model_fits_layout(model_cfg, layout)
    groups = build_groups(layout, CommStats())
    model = Transformer(model_cfg)
    model.init_weights(seed)
    parallel = parallelize(model, layout, groups, torch.distributed.get_rank(),
                           COMPUTE_DTYPE[precision]).to(device)
    return Engine(layout, groups, parallel, ShardedAdamW(parallel, optim_cfg))
