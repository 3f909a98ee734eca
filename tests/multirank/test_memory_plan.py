"""The dry run's memory plan against what a rank really allocates, byte for byte: weight shards
whose rows GTP_remat pads (weight shards 3 over rows that 3 does not divide), the optimizer's
flat buffers padded to a multiple of the weight replicas, after one real step (Adam moments
exist). Planned from shapes and the Layout alone; measured on gloo ranks."""
from __future__ import annotations

import pytest
import torch

from trainer.data.batch import rank_micro_batches
from trainer.report.memory import memory_per_stage, parameter_shapes
from trainer.train.engine import build_engine
from trainer.train.step import train_step

from harness import run_ranks
from test_parity import OPTIM, SEED, TINY, make_data, make_layout

FP32 = 4


def held_after_one_step(rank, layout, batch) -> dict:
    engine = build_engine(TINY, OPTIM, SEED, layout, torch.device("cpu"))
    train_step(engine.model, engine.optimizer, rank_micro_batches(lambda i: batch[i], layout, rank),
               1e-3)
    opt = engine.optimizer
    return {
        "parameters": sum(p.numel() for p in engine.model.module.parameters()),
        "param_bytes": sum(b.params.numel() for b in opt.buffers) * FP32,
        "grad_bytes": sum(b.grads.numel() for b in opt.buffers) * FP32,
        "optim_bytes": sum(t.numel() for state in opt.adam.state.values()
                           for key, t in state.items() if key != "step") * FP32,
    }


@pytest.mark.parametrize("world, kwargs", [
    (3, dict(tensor_parallel_num_weight_shards=3)),  # rows 256, 64, 352 padded to 3's multiples
    (4, dict(tensor_model_parallel_size=2, sequence_parallel=True)),  # DP 2 over TP 2
    (6, dict(tensor_parallel_num_weight_shards=3)),  # padded shards, two replicas
])
def test_planned_bytes_are_the_allocated_bytes(world, kwargs):
    layout = make_layout(world, kwargs)
    (plan,) = memory_per_stage(parameter_shapes(TINY), TINY.num_layers, layout)
    batch = make_data(layout.global_batch_size)[0]
    for rank, held in enumerate(run_ranks(world, held_after_one_step, layout, batch, timeout=120)):
        planned = {key: getattr(plan, key) for key in held}
        assert held == planned, (rank, held, planned)
