"""Communication accounting: bytes per step by group and collective, against the formula.

Layout: weight shards 2 x DP 2 (world 4), 2 micro-batches. Per micro-batch every GTP-sharded
linear weight is gathered twice (forward, and again in backward), the embedding once (its
backward needs only the token ids), and every sharded gradient is reduce-scattered once; the
linears of a transformer block share each of those collectives (one message for all). Per
step the small replicated gradients are all-reduced over gtp_remat, both flat buffers are
reduce-scattered and all-gathered over weight_replica, and three scalars are all-reduced.
Bytes are what one rank sends under a ring algorithm (see parallel/comm.py).

Under bf16 the GTP_remat gathers move bf16 copies of the fp32 shards: exactly half their bytes,
measured; with grad_reduce_in_bf16 the gradient reduce-scatters are halved too. Everything else
(the optimizer's fp32 buffers, small gradients, scalars) moves the same bytes.
"""
from __future__ import annotations

import math

import torch

from parallel.layout import Layout
from trainer.config import Precision
from trainer.parts.assembly import parameter_shapes
from trainer.plan.options import EngineOptions
from trainer.train.batch import rank_micro_batches
from trainer.train.engine import build_engine
from trainer.train.step import train_step

from harness import run_ranks
from test_parity import OPTIM, SEED, TINY, make_data, make_layout

FP32 = 4


def one_step_stats(rank: int, layout: Layout, batch: torch.Tensor,
                   options: EngineOptions = EngineOptions()) -> dict:
    engine = build_engine(TINY, OPTIM, SEED, layout, torch.device("cpu"), options)
    engine.groups.stats.reset()
    micro_batches = rank_micro_batches(lambda idx: batch[idx], layout, rank)
    train_step(engine.model, engine.optimizer, micro_batches, 1e-3)
    return {"bytes": dict(engine.groups.stats.bytes), "calls": dict(engine.groups.stats.calls)}


def expected(layout: Layout) -> tuple[dict, dict]:
    g, r, micro = layout.gtp_remat_size, layout.num_weight_replicas, layout.num_microbatches
    shapes = parameter_shapes(TINY)
    matrices = {n: s for n, s in shapes.items() if len(s) == 2}
    shard = {n: math.ceil(s[0] / g) * s[1] * FP32 for n, s in matrices.items()}
    linears = [n for n in matrices if not n.startswith("embed.")]
    small = sum(math.prod(s) for n, s in shapes.items() if len(s) == 1) * FP32
    # The optimizer's flat buffers are padded to a multiple of the replica count.
    sharded_part = math.ceil(sum(shard.values()) / FP32 / r) * FP32
    small_part = math.ceil(small / FP32 / r) * FP32
    world, token_distinct = layout.world_size, layout.world_size  # TP = PP = 1 here
    scalar = 8  # float64
    bytes_ = {
        ("gtp_remat", "all_gather"): micro * (g - 1) * (2 * sum(shard[n] for n in linears)
                                                        + shard["embed.weight"]),
        ("gtp_remat", "reduce_scatter"): micro * (g - 1) * sum(shard.values()),
        ("gtp_remat", "all_reduce"): 2 * (g - 1) * small // g,
        ("weight_replica", "reduce_scatter"): (r - 1) * (sharded_part + small_part),
        ("weight_replica", "all_gather"): (r - 1) * (sharded_part + small_part),
        # the counts (loss tokens, samples counting none: two scalars) and the loss sum
        ("token_distinct", "all_reduce"): 3 * (2 * (token_distinct - 1) * scalar // token_distinct),
        ("world", "all_reduce"): 2 * (world - 1) * scalar // world,
    }
    blocks = TINY.num_layers  # a block's linears share one collective (a ShardBundle)
    calls = {
        # embedding once, the head twice, each block twice (forward, then again in backward)
        ("gtp_remat", "all_gather"): micro * (1 + 2 + 2 * blocks),
        ("gtp_remat", "reduce_scatter"): micro * (2 + blocks),
        ("gtp_remat", "all_reduce"): 1,
        ("weight_replica", "reduce_scatter"): 2,
        ("weight_replica", "all_gather"): 2,
        ("token_distinct", "all_reduce"): 2,  # the counts and the loss sum
        ("world", "all_reduce"): 1,  # the gradient norm
    }
    return bytes_, calls


def test_bytes_per_step_match_the_formula():
    layout = make_layout(4, dict(tensor_parallel_num_weight_shards=2))
    assert (layout.gtp_remat_size, layout.num_weight_replicas, layout.num_microbatches) == (2, 2, 2)
    batch = make_data(layout.global_batch_size)[0]
    results = run_ranks(4, one_step_stats, layout, batch, timeout=120)
    want_bytes, want_calls = expected(layout)
    for rank, result in enumerate(results):
        assert result["calls"] == want_calls, rank
        assert result["bytes"] == want_bytes, rank
    print(f"\nbytes per rank per step (ws2 x dp2, 2 micro-batches): {results[0]['bytes']}")


def each_options(rank: int, layout: Layout, batch: torch.Tensor,
                 options: list[EngineOptions]) -> list[dict]:
    return [one_step_stats(rank, layout, batch, o)["bytes"] for o in options]


def test_bf16_gathers_and_bf16_gradient_reduction_halve_their_bytes():
    layout = make_layout(2, dict(tensor_parallel_num_weight_shards=2))
    batch = make_data(layout.global_batch_size)[0]
    options = [EngineOptions(), EngineOptions(Precision.bf16),
               EngineOptions(Precision.bf16, grad_reduce_in_bf16=True)]
    fp32, bf16, bf16_reduce = run_ranks(2, each_options, layout, batch, options, timeout=120)[0]
    gather, scatter = ("gtp_remat", "all_gather"), ("gtp_remat", "reduce_scatter")
    ratios = {"all_gather bf16 / fp32": bf16[gather] / fp32[gather],
              "reduce_scatter bf16 / fp32": bf16[scatter] / fp32[scatter],
              "reduce_scatter bf16-reduce / bf16": bf16_reduce[scatter] / bf16[scatter]}
    print(f"\ngtp_remat byte ratios: {ratios}")
    assert ratios == {"all_gather bf16 / fp32": 0.5, "reduce_scatter bf16 / fp32": 1.0,
                      "reduce_scatter bf16-reduce / bf16": 0.5}
    assert bf16_reduce[gather] == bf16[gather]
    for key in set(fp32) - {gather, scatter}:
        assert fp32[key] == bf16[key] == bf16_reduce[key], key
