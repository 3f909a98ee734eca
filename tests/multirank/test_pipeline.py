"""Pipeline parallel trains the same model as one process (test_parity's method and
tolerances), under each schedule, with uneven stages (num_layers_in_first/last_pipeline_stage)
and combined with the other axes, with 4 micro-batches per batch lane so every schedule reaches
its steady state; and a checkpoint written under one pipeline layout loads under another
(tests/multirank/test_layout_changes.py has the rest).

The full parameters are put together from the first rank of every stage: a stage holds its
blocks only, so the comparison also shows each block trained on exactly one stage.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel.layout.pipeline_schedules import SCHEDULES
from trainer.config import CPCommType, Precision, RecomputeGranularity
from trainer.plan.options import EngineOptions

from harness import run_ranks
from test_parity import (
    TINY,
    assert_parity,
    make_layout,
    reference_cache,
    relative,
    train_rank,
)

FOUR_LAYERS = replace(TINY, num_layers=4)
FIVE_LAYERS = replace(TINY, num_layers=5)
TIED = replace(TINY, tie_word_embeddings=True)
MICRO_BATCHES = 4
ONE_F_ONE_B, INTERLEAVED, GPIPE, ZB_H1, ZBV = (EngineOptions(pipeline_schedule=s)
                                               for s in SCHEDULES)
EIGHT_LAYERS = replace(TINY, num_layers=8)
V2 = dict(virtual_pipeline_model_parallel_size=2)
# name -> (world, Layout keyword arguments, engine options, model)
CASES = {
    "pp2": (2, dict(pipeline_model_parallel_size=2), ONE_F_ONE_B, TINY),
    "pp4": (4, dict(pipeline_model_parallel_size=4), ONE_F_ONE_B, FOUR_LAYERS),
    "pp2_ws2_cp2": (8, dict(pipeline_model_parallel_size=2, tensor_parallel_num_weight_shards=2,
                            context_parallel_size=2), ONE_F_ONE_B, TINY),
    "pp2_tp2_sp": (4, dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                           sequence_parallel=True), ONE_F_ONE_B, TINY),
    "pp2_virtual2": (2, dict(pipeline_model_parallel_size=2,
                             virtual_pipeline_model_parallel_size=2), INTERLEAVED, FOUR_LAYERS),
    "pp2_tied": (2, dict(pipeline_model_parallel_size=2), ONE_F_ONE_B, TIED),
    "pp2_gpipe": (2, dict(pipeline_model_parallel_size=2), GPIPE, TINY),
    # the other axes and options with stages: data parallel with full recompute; sequence
    # shards by all-to-all with selective recompute
    "pp2_dp2_full_recompute": (4, dict(pipeline_model_parallel_size=2), replace(
        ONE_F_ONE_B, recompute_granularity=RecomputeGranularity.full), TINY),
    "pp2_ws2_ss2_a2a_selective": (4, dict(
        pipeline_model_parallel_size=2, tensor_parallel_num_weight_shards=2,
        tensor_parallel_num_sequence_shards=2), replace(
        ONE_F_ONE_B, cp_comm_type=CPCommType.a2a,
        recompute_granularity=RecomputeGranularity.selective), TINY),
    # uneven stages (num_layers_in_first/last_pipeline_stage): 1 + 3 and 3 + 1 blocks; PP 3 with
    # both ends set, 1 + 2 + 2 blocks of 5
    "pp2_first1": (2, dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1),
                   ONE_F_ONE_B, FOUR_LAYERS),
    "pp2_last1": (2, dict(pipeline_model_parallel_size=2, num_layers_in_last_pipeline_stage=1),
                  ONE_F_ONE_B, FOUR_LAYERS),
    "pp3_first1_last2": (3, dict(pipeline_model_parallel_size=3,
                                 num_layers_in_first_pipeline_stage=1,
                                 num_layers_in_last_pipeline_stage=2), ONE_F_ONE_B, FIVE_LAYERS),
    # zero bubble (the split backward): PP 2 and 4 each, then every other axis once: GTP_remat
    # bundles with CP; TP + SP with full recompute; data parallel (the sharded optimizer) with
    # weight shards, both overlaps and selective recompute; the tied embedding on a V's stage 0
    "pp2_zb_h1": (2, dict(pipeline_model_parallel_size=2), ZB_H1, TINY),
    "pp4_zb_h1": (4, dict(pipeline_model_parallel_size=4), ZB_H1, FOUR_LAYERS),
    "pp2_zbv": (2, dict(pipeline_model_parallel_size=2, **V2), ZBV, FOUR_LAYERS),
    "pp4_zbv": (4, dict(pipeline_model_parallel_size=4, **V2), ZBV, EIGHT_LAYERS),
    "pp2_zb_h1_ws2_cp2": (8, dict(pipeline_model_parallel_size=2,
                                  tensor_parallel_num_weight_shards=2, context_parallel_size=2),
                          ZB_H1, TINY),
    "pp2_zbv_tp2_sp_full_recompute": (4, dict(pipeline_model_parallel_size=2,
                                              tensor_model_parallel_size=2,
                                              sequence_parallel=True, **V2), replace(
        ZBV, recompute_granularity=RecomputeGranularity.full), FOUR_LAYERS),
    "pp2_zbv_ws2_dp2_overlap": (8, dict(pipeline_model_parallel_size=2,
                                        tensor_parallel_num_weight_shards=2, **V2), replace(
        ZBV, overlap_grad_reduce=True, overlap_param_gather=True,
        recompute_granularity=RecomputeGranularity.selective), FOUR_LAYERS),
    "pp2_zbv_tied": (2, dict(pipeline_model_parallel_size=2, **V2), ZBV,
                     replace(FOUR_LAYERS, tie_word_embeddings=True)),
}
UNEVEN = {"pp2_first1": [1, 3], "pp2_last1": [3, 1], "pp3_first1_last2": [1, 2, 2]}
FP64 = {"pp2_ws2_cp2", "pp2_virtual2", *UNEVEN, "pp2_zb_h1", "pp4_zb_h1", "pp2_zbv", "pp4_zbv",
        "pp2_zb_h1_ws2_cp2", "pp2_zbv_ws2_dp2_overlap"}
FP64_ONLY = {"pp4_zb_h1", "pp4_zbv", "pp2_zb_h1_ws2_cp2", "pp2_zbv_ws2_dp2_overlap"}
PARAMS = [pytest.param(name, dtype, id=f"{name}-{label}") for name in CASES
          for dtype, label in ((torch.float32, "fp32"), (torch.float64, "fp64"))
          if (dtype == torch.float32 and name not in FP64_ONLY) or
          (dtype == torch.float64 and name in FP64)]


@pytest.fixture(scope="module")
def references():
    return reference_cache()


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_pipeline_layout_matches_one_process(name, dtype, references):
    world, kwargs, options, model = CASES[name]
    layout = make_layout(world, kwargs, MICRO_BATCHES)
    batches, ref = references(layout.global_batch_size, dtype, model)
    results = run_ranks(world, train_rank, layout, batches, dtype, options, model, timeout=120)
    if model.tie_word_embeddings:  # held once by the checkpointable state, as embed.weight
        assert "head.weight" not in set().union(*(r["params"] or {} for r in results))
    if name in UNEVEN:  # each stage trained the blocks the ends asked for
        blocks = [{k.split(".")[1] for k in r["params"] or {} if k.startswith("layers.")}
                  for r in results]
        assert [len(b) for b in blocks] == UNEVEN[name], blocks
    assert_parity(results, ref, dtype, f"{name} {options.pipeline_schedule} (world {world})")


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_bf16_with_stages_trains_close_to_fp32(schedule, references):
    """bf16 autocast across stages: within bf16 rounding of the fp32 reference (test_parity's
    bound), and not equal to it (the hop carries the fp32 residual stream). zb_h1: the split
    backward's linears cast as autocast does."""
    layout = make_layout(2, dict(pipeline_model_parallel_size=2), MICRO_BATCHES)
    batches, ref = references(layout.global_batch_size, torch.float32)
    got = run_ranks(2, train_rank, layout, batches, torch.float32,
                    EngineOptions(Precision.bf16, pipeline_schedule=schedule), timeout=120)[0]
    losses = [relative(a, b) for a, b in zip(got["losses"], ref["losses"])]
    norms = [relative(a, b) for a, b in zip(got["norms"], ref["norms"])]
    print(f"\nbf16 pp2 {schedule}: relative differences to fp32: loss {losses}, grad norm "
          f"{norms}")
    assert max(losses) < 1e-2 and max(norms) < 5e-2
    assert max(norms) > 1e-4


def test_split_backward_trains_as_the_whole_one_bit_for_bit(references):
    """zb_h1's I then W against 1f1b's whole backward on one layout (GTP_remat's bundles: the
    reduce-scatter at the pass's last W): fp64 losses, gradient norms and every parameter
    identical, not only close."""
    kwargs = dict(pipeline_model_parallel_size=2, tensor_parallel_num_weight_shards=2)
    layout = make_layout(4, kwargs, MICRO_BATCHES)
    batches, _ = references(layout.global_batch_size, torch.float64)
    whole, split = (run_ranks(4, train_rank, layout, batches, torch.float64, options,
                              timeout=120) for options in (ONE_F_ONE_B, ZB_H1))
    for a, b in zip(whole, split):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert (a["params"] is None) == (b["params"] is None)
        for name, value in (a["params"] or {}).items():
            assert torch.equal(value, b["params"][name]), name


def kept_in_flight(rank: int, layout, options: EngineOptions, model) -> dict:
    """One training step on real gloo ranks, measuring what the schedule kept at once."""
    from trainer.train.batch import rank_micro_batches
    from trainer.train.engine import build_engine
    from trainer.train.step import train_step

    from test_parity import OPTIM, SEED

    engine = build_engine(model, OPTIM, SEED, layout, torch.device("cpu"), options)
    fetch = lambda idx: torch.randint(0, model.vocab_size, (len(idx), layout.seq_length + 1))  # noqa: E731
    runner = engine.model.runner
    runner.measure = True
    train_step(engine.model, engine.optimizer, rank_micro_batches(fetch, layout, rank), 1e-3)
    return {"stage": layout.coords(rank).pp, "bytes": runner.peak_saved_bytes,
            "pairs": runner.peak_in_flight, "messages": runner.peak_message_bytes}


@pytest.mark.parametrize("name", ["pp2", "pp2_virtual2", "pp2_zb_h1", "pp2_zbv"])
def test_activations_in_flight_match_the_plan(name):
    """The dry run's activations per stage are the schedule's micro-batches in flight times
    what each keeps; measured on gloo ranks with autograd's saved-tensor hooks. Its message
    term is the receive buffers the runner really held at once (real gloo messages)."""
    from trainer.parts.assembly import parameter_shapes
    from trainer.plan.stage_plan import step_per_stage

    world, kwargs, options, model = CASES[name]
    layout = make_layout(world, kwargs, MICRO_BATCHES)
    shapes = parameter_shapes(model)
    plan = step_per_stage(shapes, model, layout, options)
    for got in run_ranks(world, kept_in_flight, layout, options, model, timeout=120):
        planned = plan[got["stage"]]
        print(f"\n{name} stage {got['stage']}: {got['pairs']} in flight, kept "
              f"{got['bytes']:,} B, planned {planned['activation_bytes']:,} B; messages "
              f"{got['messages']:,} B, planned {planned['message_bytes']:,} B")
        assert got["messages"] == planned["message_bytes"] > 0
        assert got["pairs"] == planned["in_flight"]
        assert got["pairs"] > 1 or got["stage"] == layout.pp_size - 1
        assert abs(got["bytes"] / planned["activation_bytes"] - 1) < 5e-3


def eval_loss(rank: int, layout, options: EngineOptions, batch: torch.Tensor) -> float:
    from trainer.train.batch import rank_micro_batches
    from trainer.train.engine import build_engine
    from trainer.train.step import evaluate

    from test_parity import OPTIM, SEED

    engine = build_engine(TIED, OPTIM, SEED, layout, torch.device("cpu"), options)
    return evaluate(engine.model, rank_micro_batches(lambda idx: batch[idx], layout, rank))


def test_evaluation_runs_the_stages_forward_only():
    """The schedule's forwards alone give the one-process evaluation loss, on every rank (the
    sum comes from the last stage); tied embeddings, so the head uses the copy."""
    world, kwargs, options, _ = CASES["pp2_tied"]
    layout = make_layout(world, kwargs, MICRO_BATCHES)
    batch = torch.randint(0, TIED.vocab_size, (layout.global_batch_size, layout.seq_length + 1),
                          generator=torch.Generator().manual_seed(0))
    one = run_ranks(1, eval_loss, make_layout(1, {}, MICRO_BATCHES), ONE_F_ONE_B, batch)[0]
    got = run_ranks(world, eval_loss, layout, options, batch)
    assert got[0] == got[1]
    assert abs(got[0] - one) <= 1e-6 * one, (got, one)
