"""Per-rank parameter, gradient and optimizer bytes follow the contract's placement rules."""
from __future__ import annotations

import math

from parallel.layout import Layout
from trainer.model.plan import stage_of
from trainer.report.memory import memory_per_stage, parameter_shapes, unsharded_memory

from test_model import TINY

SHAPES = parameter_shapes(TINY)


def test_shapes_come_from_the_real_model():
    assert SHAPES["embed.weight"] == (256, 64)
    assert SHAPES["layers.1.mlp.down.weight"] == (64, 176)
    assert SHAPES["norm.weight"] == (64,)


def test_one_process_is_the_unsharded_model():
    (one,) = memory_per_stage(SHAPES, 2, Layout(1))
    full = unsharded_memory(SHAPES)
    assert one.as_dict() == full.as_dict()
    assert full.parameters == sum(math.prod(s) for s in SHAPES.values())
    assert full.param_bytes == 4 * full.parameters and full.optim_bytes == 8 * full.parameters


def test_weight_tile_splits_matrices_and_keeps_norms_whole():
    layout = Layout(8, tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=4)
    (rank,) = memory_per_stage(SHAPES, 2, layout)
    matrices = sum(math.prod(s) for s in SHAPES.values() if len(s) == 2)
    vectors = sum(math.prod(s) for s in SHAPES.values() if len(s) == 1)
    assert all(math.prod(s) % 4 == 0 for s in SHAPES.values() if len(s) == 2)
    assert rank.parameters == matrices // 4 + vectors
    # Two weight replicas (DP 2) share the optimizer state of each shard.
    assert rank.optim_bytes == 8 * (sum(math.prod(s) // 4 for s in SHAPES.values()
                                        if len(s) == 2) // 2 + vectors // 2)


def test_fp32_weights_gradients_and_moments_are_kept():
    (rank,) = memory_per_stage(SHAPES, 2, Layout(1))
    assert rank.param_bytes == 4 * rank.parameters and rank.grad_bytes == 4 * rank.parameters
    assert rank.optim_bytes == 8 * rank.parameters


def test_pipeline_stages_partition_the_model():
    stages = memory_per_stage(SHAPES, 2, Layout(2, pipeline_model_parallel_size=2))
    assert sum(s.parameters for s in stages) == unsharded_memory(SHAPES).parameters
    assert stage_of("embed.weight", 2, 2) == 0 and stage_of("head.weight", 2, 2) == 1
    assert [stage_of(f"layers.{i}.attn.qkv.weight", 8, 4) for i in range(8)] == [0, 0, 1, 1, 2, 2,
                                                                               3, 3]
