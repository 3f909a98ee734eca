"""The Layout against the seed PR's worked examples, the contract's group example, and every
validation rule with its message."""
from __future__ import annotations

import pytest

from parallel.layout import GROUP_NAMES, Layout, LayoutError, RankCoords


def test_seed_example_ws64_tp2_sp_ss16():
    layout = Layout(64, tensor_model_parallel_size=2, sequence_parallel=True,
                    tensor_parallel_num_weight_shards=64, tensor_parallel_num_sequence_shards=16)
    assert (layout.gtp_remat_size, layout.gtp_remat_num_sequence_shards,
            layout.gtp_remat_num_batch_shards) == (32, 8, 4)
    assert layout.runtime_context_parallel_size == 8 and layout.batch_parallel_size == 4


def test_seed_example_128_ranks_cp2():
    layout = Layout(128, tensor_parallel_num_weight_shards=64,
                    tensor_parallel_num_sequence_shards=64, context_parallel_size=2)
    assert layout.derived() == {
        "world_size": 128, "sp_degree": 1, "gtp_remat_size": 64,
        "gtp_remat_num_sequence_shards": 64, "gtp_remat_num_batch_shards": 1,
        "data_parallel_size": 1, "batch_parallel_size": 1, "runtime_context_parallel_size": 128,
        "num_weight_replicas": 2, "num_microbatches": 1, "global_batch_size": 1,
        "expert_data_parallel_size": 128}
    # Each weight-sharding group is 64 consecutive ranks (one NVLink domain of 64).
    assert layout.groups("gtp_remat") == [list(range(64)), list(range(64, 128))]
    assert layout.weight_tiles_crossing(64) == []
    assert layout.weight_tiles_crossing(8) == [[0, 63], [64, 127]]


@pytest.mark.parametrize("sequence_shards,runtime_cp,bps", [(None, 1, 8), (2, 2, 4), (1, 1, 8)])
def test_seed_review_case(sequence_shards, runtime_cp, bps):
    layout = Layout(8, tensor_parallel_num_weight_shards=2,
                    tensor_parallel_num_sequence_shards=sequence_shards)
    assert layout.runtime_context_parallel_size == runtime_cp
    assert layout.batch_parallel_size == bps and layout.data_parallel_size == 4


def test_megatron_6886_cp64_is_ws64_ss64_cp1():
    layout = Layout(64, tensor_parallel_num_weight_shards=64,
                    tensor_parallel_num_sequence_shards=64)
    assert layout.runtime_context_parallel_size == 64 and layout.gtp_remat_size == 64
    assert layout.batch_parallel_size == 1


def test_contract_group_example():
    layout = Layout(16, tensor_model_parallel_size=2, sequence_parallel=True,
                    tensor_parallel_num_weight_shards=8, tensor_parallel_num_sequence_shards=4,
                    context_parallel_size=2)
    assert (layout.gtp_remat_num_batch_shards, layout.data_parallel_size,
            layout.batch_parallel_size, layout.runtime_context_parallel_size) == (2, 1, 2, 4)
    assert layout.groups("context") == [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14],
                                        [5, 7, 13, 15]]
    assert layout.groups("batch_lane") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13],
                                           [10, 14], [11, 15]]
    assert layout.groups("token_distinct") == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    assert layout.groups("gtp_remat") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14],
                                          [9, 11, 13, 15]]
    assert layout.groups("weight_replica") == [[r, r + 8] for r in range(8)]
    assert layout.groups("weight_tile") == [list(range(8)), list(range(8, 16))]
    assert layout.groups("tp") == [[r, r + 1] for r in range(0, 16, 2)]
    assert layout.groups("embedding") == [[r] for r in range(16)]
    # runtime CP rank = seq_idx + ns * cp_idx; batch partition = batch_idx + nb * dp_idx
    assert [layout.runtime_cp_rank(r) for r in (0, 2, 8, 10)] == [0, 1, 2, 3]
    assert [layout.batch_partition(r) for r in (0, 4)] == [0, 1]
    assert layout.coords(11) == RankCoords(tp=1, seq=1, batch=0, cp=1, dp=0, pp=0)


def test_pipeline_and_embedding_groups():
    layout = Layout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    assert layout.groups("pp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("embedding") == [[0, 6], [1, 7]]
    assert layout.group("embedding", 6) == [0, 6] and layout.position("embedding", 6) == 1
    assert layout.group("embedding", 4) == []  # a middle stage holds no embedding
    with pytest.raises(ValueError, match="middle pipeline stage"):
        layout.position("embedding", 4)
    assert layout.groups("model_parallel") == [list(range(8))]


def test_effective_defaults_are_filled_in():
    layout = Layout(8, tensor_model_parallel_size=2, sequence_parallel=True, micro_batch_size=3)
    assert layout.tensor_parallel_num_weight_shards == 2
    assert layout.tensor_parallel_num_sequence_shards == 2
    assert layout.global_batch_size == 3 * 4 and layout.num_microbatches == 1


def test_global_batch_gives_micro_batches():
    layout = Layout(4, micro_batch_size=2, global_batch_size=24)
    assert layout.batch_parallel_size == 4 and layout.num_microbatches == 3


def test_unknown_group_and_out_of_range_rank():
    layout = Layout(4)
    with pytest.raises(KeyError, match="unknown group 'dp'"):
        layout.groups("dp")
    with pytest.raises(IndexError):
        layout.coords(4)
    assert set(layout.all_groups()) == set(GROUP_NAMES)


# Each rule of the contract: the message names the keys and their values and gives a fix.
RULES = [
    (dict(world_size=0), ["world_size=0", "cluster.num_nodes x cluster.procs_per_node"]),
    (dict(world_size=8, context_parallel_size=0), ["parallel.context_parallel_size=0", ">= 1"]),
    (dict(world_size=8, tensor_model_parallel_size=-2),
     ["parallel.tensor_model_parallel_size=-2"]),
    (dict(world_size=8, pipeline_model_parallel_size=2.0),
     ["parallel.pipeline_model_parallel_size=2.0"]),
    (dict(world_size=8, tensor_parallel_num_weight_shards=0),
     ["parallel.tensor_parallel_num_weight_shards=0", "null"]),
    (dict(world_size=8, micro_batch_size=0), ["train.micro_batch_size=0"]),
    (dict(world_size=8, sequence_parallel="yes"), ["parallel.sequence_parallel='yes'"]),
    (dict(world_size=8, tensor_model_parallel_size=4, tensor_parallel_num_weight_shards=6),
     ["parallel.tensor_parallel_num_weight_shards=6", "parallel.tensor_model_parallel_size=4",
      "Fix:", "4 or 8"]),
    (dict(world_size=8, tensor_model_parallel_size=4, tensor_parallel_num_weight_shards=2),
     ["parallel.tensor_parallel_num_weight_shards=2", "tensor_model_parallel_size=4", "Fix:"]),
    (dict(world_size=8, tensor_model_parallel_size=2, sequence_parallel=True,
          tensor_parallel_num_weight_shards=4, tensor_parallel_num_sequence_shards=3),
     ["parallel.tensor_parallel_num_sequence_shards=3", "SP degree 2", "Fix:", "2 or 4"]),
    (dict(world_size=8, tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=8,
          tensor_parallel_num_sequence_shards=2),
     ["parallel.tensor_parallel_num_sequence_shards=2", "requires sequence_parallel",
      "parallel.tensor_model_parallel_size=2", "Fix: set parallel.sequence_parallel=true"]),
    (dict(world_size=8, tensor_parallel_num_weight_shards=4,
          tensor_parallel_num_sequence_shards=3),
     ["parallel.tensor_parallel_num_sequence_shards=3", "GTP_remat size 4", "Fix:"]),
    (dict(world_size=12, tensor_parallel_num_weight_shards=8),
     ["world_size=12", "TP x GTP_remat x CP x PP", "= 8", "Fix:", "8 or 16"]),
    (dict(world_size=8, context_parallel_size=3), ["world_size=8", "= 3", "Fix:"]),
    (dict(world_size=8, micro_batch_size=2, global_batch_size=20),
     ["train.global_batch_size=20", "train.micro_batch_size=2", "batch_parallel_size=8",
      "Fix:", "16 or 32"]),
    (dict(world_size=4, context_parallel_size=2, seq_length=130),
     ["train.seq_length=130", "2 x runtime CP = 4", "Fix:", "128 or 132"]),
    (dict(world_size=4, tensor_model_parallel_size=4, sequence_parallel=True, seq_length=126),
     ["train.seq_length=126", "SP degree", "Fix:", "124 or 128"]),
    (dict(world_size=8, tensor_model_parallel_size=4, sequence_parallel=True,
          context_parallel_size=2, seq_length=132),  # 132 / 4 chunks fine, 66 / TP 4 is not
     ["train.seq_length=132", "runtime CP x SP degree = 2 x 4", "Fix:", "128 or 136"]),
]


@pytest.mark.parametrize("inputs,phrases", RULES)
def test_every_rule_raises_one_clear_error(inputs, phrases):
    with pytest.raises(LayoutError) as error:
        Layout(**inputs)
    for phrase in phrases:
        assert phrase in str(error.value), (phrase, str(error.value))


# Layouts at the edge of a rule, accepted, with their sizes worked from the contract's formulas
# by hand: (DP, BPS, runtime CP, weight replicas, weight tile, rank 0's zigzag chunks, the
# tokens a rank's residual stream holds).
EDGES = [
    # CP 2: DP = 4 / 2, BPS = DP, replicas = CP x DP; 4 chunks of 32, rank 0 has the 1st and 4th
    (dict(world_size=4, context_parallel_size=2, seq_length=128),
     (2, 2, 2, 4, 1, [range(0, 32), range(96, 128)], 64)),
    # 136 = 8 x 17: 4 chunks of 34, CP-local 68 split again over TP 2 with SP: 34 (the rule
    # wants both to divide)
    (dict(world_size=8, tensor_model_parallel_size=2, sequence_parallel=True,
          context_parallel_size=2, seq_length=136),
     (2, 2, 2, 4, 2, [range(0, 34), range(102, 136)], 34)),
    # WS 4 over TP 2: G = 2 batch shards (no SP, so ns = 1), DP = 4 / (2 x 2) = 1, BPS = 2
    (dict(world_size=4, tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=4,
          seq_length=64),
     (1, 2, 1, 1, 4, [range(0, 64)], 64)),
]


@pytest.mark.parametrize("inputs,sizes", EDGES)
def test_valid_edge_cases_pass_with_their_sizes(inputs, sizes):
    layout = Layout(**inputs)
    assert (layout.data_parallel_size, layout.batch_parallel_size,
            layout.runtime_context_parallel_size, layout.num_weight_replicas,
            layout.weight_tile_size, layout.context_chunks(0),
            layout.residual_local_length) == sizes


def test_from_config_names_the_cluster_key():
    class Node:
        def __init__(self, **values):
            self.__dict__.update(values)

    parallel = Node(tensor_model_parallel_size=1, sequence_parallel=False,
                    tensor_parallel_num_weight_shards=None,
                    tensor_parallel_num_sequence_shards=None, context_parallel_size=1,
                    expert_model_parallel_size=1, expert_tensor_parallel_size=None,
                    pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                    num_layers_in_first_pipeline_stage=None,
                    num_layers_in_last_pipeline_stage=None)
    train = Node(micro_batch_size=1, global_batch_size=None, seq_length=64)
    assert Layout.from_config(parallel, Node(num_nodes=2, procs_per_node=4), train).world_size == 8
    with pytest.raises(LayoutError, match=r"cluster.procs_per_node=0"):
        Layout.from_config(parallel, Node(num_nodes=2, procs_per_node=0), train)


def test_lanes_and_micro_batches_partition_the_global_batch():
    layout = Layout(8, tensor_parallel_num_weight_shards=2, micro_batch_size=3,
                    global_batch_size=48)
    assert (layout.batch_parallel_size, layout.num_microbatches) == (8, 2)
    seen = [i for lane in range(8) for micro in range(2)
            for i in layout.micro_batch_samples(lane, micro)]
    assert sorted(seen) == list(range(48))
    assert list(layout.micro_batch_samples(1, 1)) == [27, 28, 29]  # (1 x 8 + 1) x 3
    with pytest.raises(IndexError):
        layout.micro_batch_samples(8, 0)


def test_context_chunks_are_zigzag_and_cover_each_sequence_once():
    layout = Layout(16, tensor_model_parallel_size=2, sequence_parallel=True,
                    tensor_parallel_num_weight_shards=8, tensor_parallel_num_sequence_shards=4,
                    context_parallel_size=2, seq_length=64)
    # runtime CP 4: 8 chunks of 8 tokens; runtime CP rank r keeps chunks r and 7 - r.
    assert layout.context_chunks(0) == [range(0, 8), range(56, 64)]
    assert layout.context_chunks(10) == [range(24, 32), range(32, 40)]  # runtime CP rank 3
    for group in layout.groups("context"):
        covered = sorted(p for rank in group for chunk in layout.context_chunks(rank)
                         for p in chunk)
        assert covered == list(range(64))
    assert Layout(2, seq_length=10).context_chunks(1) == [range(10)]


def test_pipeline_layers_split_evenly_or_as_the_ends_say():
    pp4 = Layout(4, pipeline_model_parallel_size=4)
    assert pp4.pipeline_layers(8) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    ends = Layout(4, pipeline_model_parallel_size=4, num_layers_in_first_pipeline_stage=1,
                  num_layers_in_last_pipeline_stage=3)
    assert ends.pipeline_layers(8) == [range(0, 1), range(1, 3), range(3, 5), range(5, 8)]
    only_first = Layout(3, pipeline_model_parallel_size=3, num_layers_in_first_pipeline_stage=2)
    assert only_first.pipeline_layers(6) == [range(0, 2), range(2, 4), range(4, 6)]
    with pytest.raises(LayoutError, match=r"model.num_layers=7.*do|do not split evenly"):
        pp4.pipeline_layers(7)
    with pytest.raises(LayoutError, match=r"num_layers_in_last_pipeline_stage=3"):
        ends.pipeline_layers(5)  # 1 layer left for two middle stages


def test_interleaving_places_model_chunks_round_robin():
    """Model chunk c = virtual index x PP + stage: stage 0 of PP 2 with 2 chunks runs blocks
    0-1 and 4-5 of 8 (Megatron's interleaved placement)."""
    layout = Layout(2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                    global_batch_size=4)
    assert layout.stage_chunks(0, 8) == [range(0, 2), range(4, 6)]
    assert layout.stage_chunks(1, 8) == [range(2, 4), range(6, 8)]
    with pytest.raises(LayoutError, match=r"virtual_pipeline_model_parallel_size=2"):
        layout.pipeline_layers(2)  # one layer per stage cannot make two chunks


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          global_batch_size=3), r"their number \(3 = train.global_batch_size 3.*to 2 or 4"),
    (dict(world_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          global_batch_size=1), r"divisible by parallel.pipeline_model_parallel_size=2.*Fix"),
    (dict(world_size=1, virtual_pipeline_model_parallel_size=2),
     r"virtual_pipeline_model_parallel_size=2 interleaves"),
    (dict(world_size=1, num_layers_in_first_pipeline_stage=1),
     r"num_layers_in_first_pipeline_stage=1 needs parallel.pipeline_model_parallel_size > 1"),
])
def test_pipeline_rules_name_the_keys(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        Layout(**kwargs)
