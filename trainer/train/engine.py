"""Build one rank's training engine from the typed config: groups, model, optimizer.

The model is built on the meta device and parallelized there, so a rank allocates only its own
shards; each is then filled from the model's initial values at its place in the full weight
(trainer.model.init), so every layout starts from the same full weights as one process.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta

import torch

from parallel.build import comm_options
from parallel.comm import CommStats
from parallel.groups import Groups, build_groups
from parallel.layout import Layout
from parallel.parallelize import ParallelModel, parallelize
from trainer.config import ModelConfig, OptimConfig, PeftConfig, Precision
from trainer.model.lora import add_adapters, freeze_base, keep_base_in
from trainer.model.transformer import Transformer
from trainer.parts.assembly import parallel_plan, parameter_shapes
from trainer.parts.matrices import muon_names
from trainer.plan.axis_costs import check_model_fits_layout
from trainer.plan.muon import row_splits
from trainer.plan.options import EngineOptions
from trainer.train import routing
from trainer.train.compile import compile_blocks
from trainer.train.optim import MuonChoice, ShardedOptimizer
from trainer.train.qk_clip import QkClip
from trainer.train.recompute import apply_recompute

# Every optim.name (trainer.checks lists them, without torch) is the sharded optimizer: AdamW
# alone, or Muon on the hidden matrices with AdamW on the rest. Every model family (model.name)
# is the Transformer over its parts (trainer.parts.families).


@dataclass
class Engine:
    layout: Layout
    groups: Groups
    model: ParallelModel
    optimizer: ShardedOptimizer


COMPUTE_DTYPE = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16}


def build_engine(model_cfg: ModelConfig, optim_cfg: OptimConfig, seed: int, layout: Layout,
                 device: torch.device, options: EngineOptions = EngineOptions(),
                 timeout_s: int | None = None, peft: PeftConfig | None = None) -> Engine:
    """Collective over the default process group. timeout_s: how long a collective of the
    engine's groups waits for a peer (a run's: trainer.train.hangs.backend_timeout_s); None:
    torch's default. peft: LoRA's adapters (None: every weight trains)."""
    check_model_fits_layout(model_cfg, layout, options)
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    groups = build_groups(layout, CommStats(), timeout)
    with torch.device("meta"):
        model = Transformer(model_cfg)
        add_adapters(model, model_cfg, peft)  # peft=lora: adapters beside, the base frozen
    # The axes' communication options by config key: EngineOptions holds the parallel.* ones.
    sections = {"parallel": options, "model": model_cfg}
    comm = comm_options(lambda key: getattr(sections[key.split(".")[0]], key.split(".")[1]))
    plan = parallel_plan(model_cfg)
    parallel = parallelize(model, plan, layout, groups, torch.distributed.get_rank(), device,
                           COMPUTE_DTYPE[options.precision], comm, model_cfg.vocab_size)
    if peft is not None:  # the parallel layers' parameters are new ones
        freeze_base(model)
    # Around the parallel layers it replays in backward; counted within each model chunk.
    apply_recompute(model, plan, options, parallel.stage.part.chunks)
    if options.compile_blocks:  # what the rank runs, recompute and hooks included
        compile_blocks(model, plan, parallel.stage.part.chunks)
    # A mixture of experts counts its tokens over the ranks.
    routing.wire(model, groups, parallel.sequence_parallel)
    # The optimizer moves the (still untouched) parameters into its flat buffers first, so the
    # values are written once, in place, and no second copy of them is ever resident.
    clip = None if optim_cfg.qk_clip_threshold is None else QkClip(
        parallel, model_cfg, optim_cfg.qk_clip_threshold, optim_cfg.qk_clip_alpha)
    optimizer = ShardedOptimizer(parallel, optim_cfg, layout, muon_choice(model_cfg, optim_cfg),
                                 clip)
    if peft is not None and Precision(peft.base_precision) is Precision.bf16:
        keep_base_in(model, torch.bfloat16)  # frozen: outside the optimizer's fp32 buffers
    parallel.initialize(functools.partial(model.initial_values, seed=seed))
    return Engine(layout, groups, parallel, optimizer)


def build_reference(model_cfg: ModelConfig, seed: int, engine: Engine, device: torch.device,
                    options: EngineOptions = EngineOptions()) -> ParallelModel:
    """train.objective=dpo under full fine-tuning: a frozen copy of the model on the engine's
    layout and groups, at the seed's initial weights (the caller loads the run's starting
    checkpoint into it). Its parameters are the model's once more, with no gradient or
    optimizer state (the memory plan's reference term)."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    for param in model.parameters():
        param.requires_grad_(False)
    sections = {"parallel": options, "model": model_cfg}
    comm = comm_options(lambda key: getattr(sections[key.split(".")[0]], key.split(".")[1]))
    reference = parallelize(model, parallel_plan(model_cfg), engine.layout, engine.groups,
                            torch.distributed.get_rank(), device,
                            COMPUTE_DTYPE[options.precision], comm, model_cfg.vocab_size)
    routing.wire(model, engine.groups, reference.sequence_parallel)
    reference.initialize(functools.partial(model.initial_values, seed=seed))
    return reference


def muon_choice(model_cfg: ModelConfig, optim_cfg: OptimConfig) -> MuonChoice | None:
    """The parameters optim=muon orthogonalises and their row blocks; None under adamw."""
    if optim_cfg.name != "muon":
        return None
    shapes, plan = parameter_shapes(model_cfg), parallel_plan(model_cfg)
    return MuonChoice(muon_names(model_cfg, optim_cfg),
                      lambda name: row_splits(name, shapes[name], plan, optim_cfg.muon_split_qkv))
