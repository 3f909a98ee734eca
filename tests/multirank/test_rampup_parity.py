"""A batch ramp-up with Megatron's schedule, trained under pipeline and data parallel, equals
one process: each step's global batch (so each step's number of micro-batches) comes from the
ramp, each step's learning rate and weight decay from the schedule at the samples consumed
before it, and the one-process reference applies the same numbers through torch's own AdamW
(its per-group weight_decay), so the engine's handling of the varying micro-batch count (1F1B
and interleaved 1F1B replaying a schedule of another length each step) and of the scheduled
weight decay are both held. fp64 at 1e-10, as test_parity."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel.layout import Layout
from trainer.config import (
    LrDecayStyle,
    OptimConfig,
    ScheduleConfig,
    WeightDecayIncrStyle,
    WsdDecayStyle,
)
from trainer.plan.lr_schedule import LrSchedule, WeightDecaySchedule
from trainer.plan.options import EngineOptions
from trainer.plan.rampup import BatchRamp
from trainer.train.batch import rank_micro_batches
from trainer.train.engine import build_engine
from trainer.train.step import IGNORE, train_step

from harness import run_ranks
from test_parity import OPTIM, SEED, SEQ, TINY, reference_backward, reference_model, relative

MICRO = 2
RAMP = [4, 4, 16]  # global batches 4, 4, 8, 12, 12: 2, 2, 4, 6, 6 micro-batches on one lane
TARGET, TRAIN = 12, 40
SCHEDULE = ScheduleConfig(lr_decay_style=LrDecayStyle.WSD, lr=2e-3, min_lr=1e-4,
                          lr_warmup_init=1e-4, lr_warmup_samples=6, lr_warmup_fraction=None,
                          lr_decay_samples=TRAIN, lr_wsd_decay_samples=20,
                          lr_wsd_decay_style=WsdDecayStyle.cosine)
WEIGHT_DECAY = replace(OPTIM, weight_decay_incr_style=WeightDecayIncrStyle.linear,
                       start_weight_decay=0.0, end_weight_decay=0.2)
DEEP = replace(TINY, num_layers=4)  # two chunks of two stages, one block each


def steps(layout: Layout) -> list[tuple[int, int, float, float]]:
    """(consumed before, global batch, lr, weight decay) of each step of the run."""
    ramp = BatchRamp.from_config(RAMP, layout)
    lr = LrSchedule.from_config(SCHEDULE, TRAIN)
    wd = WeightDecaySchedule.from_config(WEIGHT_DECAY, TRAIN)
    consumed, out = 0, []
    while consumed < TRAIN:
        batch = ramp.global_batch(consumed)
        out.append((consumed, batch, lr.lr(consumed), wd.weight_decay(consumed)))
        consumed += batch
    return out


def make_batches(sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    batches = []
    for size in sizes:
        tokens = torch.randint(0, TINY.vocab_size, (size, SEQ + 1), generator=gen)
        ignored = torch.rand(size, SEQ + 1, generator=gen) < 0.1
        ignored[:, 0] = False
        batches.append(torch.where(ignored, IGNORE, tokens))
    return batches


def reference(rank: int, plan: list, batches: list[torch.Tensor], model_cfg) -> dict:
    """One process, torch's AdamW told each step's lr and weight decay (matrices only)."""
    torch.set_default_dtype(torch.float64)
    model, opt, _ = reference_model(model_cfg)
    losses = []
    for (_, _, lr, wd), batch in zip(plan, batches):
        opt.zero_grad()
        total = reference_backward(model, batch, MICRO)
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad)
        decay, no_decay = opt.param_groups
        decay["weight_decay"], no_decay["weight_decay"] = wd, 0.0
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        losses.append(total)
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


def train_rank(rank: int, layout: Layout, plan: list, batches: list[torch.Tensor],
               model_cfg, optim: OptimConfig, options: EngineOptions) -> dict:
    torch.set_default_dtype(torch.float64)
    engine = build_engine(model_cfg, optim, SEED, layout, torch.device("cpu"), options)
    losses, counts = [], []
    for (_, size, lr, wd), batch in zip(plan, batches):
        step_layout = replace(layout, global_batch_size=size)
        micro_batches = rank_micro_batches(lambda idx, b=batch: b[idx], step_layout, rank)
        for mb in micro_batches:
            mb.tokens = mb.tokens.clamp(min=0)
        counts.append(len(micro_batches))
        losses.append(train_step(engine.model, engine.optimizer, micro_batches, lr,
                                 weight_decay=wd).loss)
    params = engine.model.full_state_dict()  # collective: this rank's pipeline stage
    first_of_stage = not any(layout.coords(rank)[:-1])
    return {"losses": losses, "counts": counts, "params": params if first_of_stage else None}


CASES = {  # name -> (world, Layout keywords, model, pipeline schedule)
    "pp2": (2, dict(pipeline_model_parallel_size=2), TINY, "1f1b"),
    "pp2_interleaved": (2, dict(pipeline_model_parallel_size=2,
                                virtual_pipeline_model_parallel_size=2), DEEP, "interleaved_1f1b"),
    "dp2_pp2": (4, dict(pipeline_model_parallel_size=2), TINY, "1f1b"),
    "ws2": (2, dict(tensor_parallel_num_weight_shards=2), TINY, "1f1b"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_ramped_run_with_megatron_schedule_matches_one_process(name):
    world, kwargs, model_cfg, schedule = CASES[name]
    layout = Layout(world, micro_batch_size=MICRO, seq_length=SEQ, global_batch_size=TARGET
                    * (2 if name.startswith("dp2") else 1), **kwargs)
    plan = steps(layout)
    sizes = [size for _, size, _, _ in plan]
    batches = make_batches(sizes)
    ref = run_ranks(1, reference, plan, batches, model_cfg)[0]
    results = run_ranks(world, train_rank, layout, plan, batches, model_cfg, WEIGHT_DECAY,
                        EngineOptions(pipeline_schedule=schedule), timeout=180)
    lanes = layout.batch_parallel_size
    assert results[0]["counts"] == [size // (MICRO * lanes) for size in sizes]
    assert len(set(results[0]["counts"])) > 1  # schedules of several lengths were replayed
    got = {}
    for result in results:
        assert result["losses"] == results[0]["losses"]
        got |= result["params"] or {}
    worst_loss = max(relative(a, b) for a, b in zip(results[0]["losses"], ref["losses"]))
    worst_param = max(relative(got[k], v) for k, v in ref["params"].items())
    print(f"\nramp {name}: batches {sizes}, max relative difference loss {worst_loss:.2e}, "
          f"params {worst_param:.2e}")
    assert worst_loss <= 1e-10 and worst_param <= 1e-10
