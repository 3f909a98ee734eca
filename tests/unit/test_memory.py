"""Per-rank parameter, gradient and optimizer bytes follow the contract's placement rules."""
from __future__ import annotations

import math
from dataclasses import replace

from parallel.layout import Layout
from trainer.parts.assembly import parameter_shapes
from trainer.plan.memory import memory_per_stage, stage_of, unsharded_memory

from test_model import TINY

SHAPES = parameter_shapes(TINY)


def test_shapes_come_from_the_real_model():
    assert SHAPES["embed.weight"] == (256, 64)
    assert SHAPES["layers.1.mlp.down.weight"] == (64, 176)
    assert SHAPES["norm.weight"] == (64,)


def test_one_process_is_the_unsharded_model():
    (one,) = memory_per_stage(SHAPES, 2, Layout(1))
    full = unsharded_memory(SHAPES)
    state = {k: v for k, v in one.as_dict().items() if k != "update_bytes"}
    assert state == {k: v for k, v in full.as_dict().items() if k != "update_bytes"}
    # The update's transient: two fp32 tensors the size of the larger flat buffer (the 2-D
    # weights; the norms are the other).
    assert one.update_bytes == 2 * 4 * sum(math.prod(s) for s in SHAPES.values() if len(s) == 2)
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
    pp2, pp4 = Layout(2, pipeline_model_parallel_size=2), Layout(4, pipeline_model_parallel_size=4)
    assert stage_of("embed.weight", pp2, 2) == 0 and stage_of("head.weight", pp2, 2) == 1
    assert [stage_of(f"layers.{i}.attn.qkv.weight", pp4, 8) for i in range(8)] == [
        0, 0, 1, 1, 2, 2, 3, 3]
    assert [s.blocks for s in stages] == [(0,), (1,)]


def test_interleaved_and_uneven_stages_place_blocks_by_model_chunk():
    interleaved = Layout(2, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2, global_batch_size=2)
    # model chunks [0,1] [2,3] [4,5] [6,7]: stage 0 runs chunks 0 and 2
    assert [stage_of(f"layers.{i}.mlp.down.weight", interleaved, 8) for i in range(8)] == [
        0, 0, 1, 1, 0, 0, 1, 1]
    uneven = Layout(4, pipeline_model_parallel_size=4, num_layers_in_first_pipeline_stage=1,
                    num_layers_in_last_pipeline_stage=1)
    assert [s.blocks for s in memory_per_stage(parameter_shapes(replace(TINY, num_layers=6)), 6,
                                               uneven)] == [(0,), (1, 2), (3, 4), (5,)]


def test_tied_embeddings_put_a_copy_outside_the_optimizer_on_the_last_stage():
    tied = parameter_shapes(replace(TINY, tie_word_embeddings=True))
    pp2 = Layout(2, pipeline_model_parallel_size=2)
    first, last = memory_per_stage(tied, 2, pp2, tie_word_embeddings=True)
    untied_last = memory_per_stage(tied, 2, pp2)[1]
    embedding = 256 * 64
    assert last.param_bytes - untied_last.param_bytes == 4 * embedding
    assert last.grad_bytes - untied_last.grad_bytes == 4 * embedding
    assert last.optim_bytes == untied_last.optim_bytes
    assert first.optim_bytes >= 8 * embedding


def test_the_plan_keeps_as_many_gradient_reduces_in_flight_as_the_bundles_do():
    """With overlap_grad_reduce the step plan counts REDUCES_IN_FLIGHT earlier blocks' packed
    gradients beside a block's backward: as many as the queue parallelize builds leaves
    unfinished while blocks keep putting their reduces in."""
    import torch

    from parallel.bundle import GradReduceQueue
    from parallel.comm import Pending
    from trainer.plan.axis_costs.gtp_remat import REDUCES_IN_FLIGHT

    queue, finished = GradReduceQueue(), []
    for block in range(6):
        queue.put(Pending(torch.zeros(1), None), lambda grad, block=block: finished.append(block))
        assert len(queue) == min(block + 1, REDUCES_IN_FLIGHT)
    assert finished == list(range(6 - REDUCES_IN_FLIGHT))  # oldest first
    queue.finish()
    assert finished == list(range(6)) and len(queue) == 0
