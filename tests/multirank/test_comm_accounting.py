"""Communication accounting: bytes per step by group and collective, against the formula.

Layout: weight shards 2 x DP 2 (world 4), 2 micro-batches. Per micro-batch every GTP-sharded
linear weight is gathered twice (forward, and again in backward), the embedding once (its
backward needs only the token ids), and every sharded gradient is reduce-scattered once; the
linears of a transformer block share each of those collectives (one message for all). Per
step the small replicated gradients are all-reduced over gtp_remat, both flat buffers are
reduce-scattered and all-gathered over weight_replica, and three scalars are all-reduced.
Bytes are what one rank sends under a ring algorithm (see parallel/comm.py).
"""
from __future__ import annotations

import math

import torch

from parallel.layout import Layout
from trainer.data.batch import rank_micro_batches
from trainer.report.memory import parameter_shapes
from trainer.train.engine import build_engine
from trainer.train.step import train_step

from harness import run_ranks
from test_parity import OPTIM, SEED, TINY, make_data, make_layout

FP32 = 4


def one_step_stats(rank: int, layout: Layout, batch: torch.Tensor) -> dict:
    engine = build_engine(TINY, OPTIM, SEED, layout, torch.device("cpu"))
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
        ("token_distinct", "all_reduce"): 2 * (2 * (token_distinct - 1) * scalar // token_distinct),
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
        ("token_distinct", "all_reduce"): 2,  # the loss-token count and the loss sum
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
