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
from trainer.model.plan import PLAN
from trainer.model.transformer import Transformer
from trainer.spec.checks import check_model_fits_layout
from trainer.train.optim import ShardedAdamW

# What model.name and optim.name select (trainer.spec.checks lists the names, without torch).
ARCHITECTURES = {"llama": Transformer}
OPTIMIZERS = {"adamw": ShardedAdamW}


@dataclass
class Engine:
    layout: Layout
    groups: Groups
    model: ParallelModel
    optimizer: ShardedAdamW


COMPUTE_DTYPE = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16}


def build_engine(model_cfg: ModelConfig, optim_cfg: OptimConfig, seed: int, layout: Layout,
                 device: torch.device, precision: Precision = Precision.fp32) -> Engine:
    """Collective over the default process group."""
    check_model_fits_layout(model_cfg, layout)
    groups = build_groups(layout, CommStats())
    model = ARCHITECTURES[model_cfg.name](model_cfg)
    model.init_weights(seed)
    parallel = parallelize(model, PLAN, layout, groups, torch.distributed.get_rank(),
                           COMPUTE_DTYPE[precision]).to(device)
    return Engine(layout, groups, parallel, OPTIMIZERS[optim_cfg.name](parallel, optim_cfg, layout))
