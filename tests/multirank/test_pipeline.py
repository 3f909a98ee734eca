"""Pipeline parallel trains the same model as one process (test_parity's method and
tolerances), under each schedule and combined with the other axes, with 4 micro-batches per
batch lane so every schedule reaches its steady state; and a checkpoint written under one
pipeline layout loads under another (tests/multirank/test_layout_changes.py has the rest).

The full parameters are put together from the first rank of every stage: a stage holds its
blocks only, so the comparison also shows each block trained on exactly one stage.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.train.options import EngineOptions

from harness import run_ranks
from test_parity import TINY, assert_parity, make_layout, reference_cache, train_rank

FOUR_LAYERS = replace(TINY, num_layers=4)
TIED = replace(TINY, tie_word_embeddings=True)
MICRO_BATCHES = 4
# name -> (world, Layout keyword arguments, schedule, model)
CASES = {
    "pp2": (2, dict(pipeline_model_parallel_size=2), "1f1b", TINY),
    "pp4": (4, dict(pipeline_model_parallel_size=4), "1f1b", FOUR_LAYERS),
    "pp2_ws2_cp2": (8, dict(pipeline_model_parallel_size=2, tensor_parallel_num_weight_shards=2,
                            context_parallel_size=2), "1f1b", TINY),
    "pp2_tp2_sp": (4, dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                           sequence_parallel=True), "1f1b", TINY),
    "pp2_virtual2": (2, dict(pipeline_model_parallel_size=2,
                             virtual_pipeline_model_parallel_size=2), "interleaved_1f1b",
                     FOUR_LAYERS),
    "pp2_tied": (2, dict(pipeline_model_parallel_size=2), "1f1b", TIED),
    "pp2_gpipe": (2, dict(pipeline_model_parallel_size=2), "gpipe", TINY),
}
FP64 = {"pp2_ws2_cp2", "pp2_virtual2", "pp2_tied"}
PARAMS = [pytest.param(name, dtype, id=f"{name}-{label}") for name in CASES
          for dtype, label in ((torch.float32, "fp32"), (torch.float64, "fp64"))
          if dtype == torch.float32 or name in FP64]


@pytest.fixture(scope="module")
def references():
    return reference_cache()


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_pipeline_layout_matches_one_process(name, dtype, references):
    world, kwargs, schedule, model = CASES[name]
    layout = make_layout(world, kwargs, MICRO_BATCHES)
    batches, ref = references(layout.global_batch_size, dtype, model)
    results = run_ranks(world, train_rank, layout, batches, dtype,
                        EngineOptions(pipeline_schedule=schedule), model, timeout=120)
    if model.tie_word_embeddings:  # held once by the checkpointable state, as embed.weight
        assert "head.weight" not in set().union(*(r["params"] or {} for r in results))
    assert_parity(results, ref, dtype, f"{name} {schedule} (world {world})")


def kept_in_flight(rank: int, layout, schedule: str, model) -> dict:
    """One training step on real gloo ranks, measuring what the schedule kept at once."""
    from trainer.data.batch import rank_micro_batches
    from trainer.train.engine import build_engine
    from trainer.train.step import train_step

    from test_parity import OPTIM, SEED

    engine = build_engine(model, OPTIM, SEED, layout, torch.device("cpu"),
                          EngineOptions(pipeline_schedule=schedule))
    fetch = lambda idx: torch.randint(0, model.vocab_size, (len(idx), layout.seq_length + 1))  # noqa: E731
    runner = engine.model.runner
    runner.measure = True
    train_step(engine.model, engine.optimizer, rank_micro_batches(fetch, layout, rank), 1e-3)
    return {"stage": layout.coords(rank).pp, "bytes": runner.peak_saved_bytes,
            "pairs": runner.peak_in_flight}


@pytest.mark.parametrize("name", ["pp2", "pp2_virtual2"])
def test_activations_in_flight_match_the_plan(name):
    """The dry run's activations per stage are the schedule's micro-batches in flight times
    what each keeps; measured on gloo ranks with autograd's saved-tensor hooks."""
    from trainer.report.memory import memory_per_stage, parameter_shapes, step_per_stage

    world, kwargs, schedule, model = CASES[name]
    layout = make_layout(world, kwargs, MICRO_BATCHES)
    shapes = parameter_shapes(model)
    plan = step_per_stage(shapes, model, layout, EngineOptions(pipeline_schedule=schedule),
                          memory_per_stage(shapes, model.num_layers, layout))
    for got in run_ranks(world, kept_in_flight, layout, schedule, model, timeout=120):
        planned = plan[got["stage"]]
        print(f"\n{name} stage {got['stage']}: {got['pairs']} in flight, kept "
              f"{got['bytes']:,} B, planned {planned['activation_bytes']:,} B")
        assert got["pairs"] == planned["in_flight"]
        assert got["pairs"] > 1 or got["stage"] == layout.pp_size - 1
        assert abs(got["bytes"] / planned["activation_bytes"] - 1) < 5e-3


def eval_loss(rank: int, layout, schedule: str, batch: torch.Tensor) -> float:
    from trainer.data.batch import rank_micro_batches
    from trainer.train.engine import build_engine
    from trainer.train.step import evaluate

    from test_parity import OPTIM, SEED

    engine = build_engine(TIED, OPTIM, SEED, layout, torch.device("cpu"),
                          EngineOptions(pipeline_schedule=schedule))
    return evaluate(engine.model, rank_micro_batches(lambda idx: batch[idx], layout, rank))


def test_evaluation_runs_the_stages_forward_only():
    """The schedule's forwards alone give the one-process evaluation loss, on every rank (the
    sum comes from the last stage); tied embeddings, so the head uses the copy."""
    world, kwargs, schedule, _ = CASES["pp2_tied"]
    layout = make_layout(world, kwargs, MICRO_BATCHES)
    batch = torch.randint(0, TIED.vocab_size, (layout.global_batch_size, layout.seq_length + 1),
                          generator=torch.Generator().manual_seed(0))
    one = run_ranks(1, eval_loss, make_layout(1, {}, MICRO_BATCHES), "1f1b", batch)[0]
    got = run_ranks(world, eval_loss, layout, schedule, batch)
    assert got[0] == got[1]
    assert abs(got[0] - one) <= 1e-6 * one, (got, one)
