"""build_groups: real gloo process groups whose members are the Layout's, on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel.layout import GROUP_NAMES, Layout

from harness import RankFailure, run_ranks

# The contract's group example, halved to 8 ranks: TP 2 + SP, weight shards 4, sequence shards
# 4 (ns 2), CP 2 -> every group kind has more than one member.
LAYOUT = Layout(8, tensor_model_parallel_size=2, sequence_parallel=True,
                tensor_parallel_num_weight_shards=4, tensor_parallel_num_sequence_shards=4,
                context_parallel_size=2)


def groups_of_rank(rank: int, layout: Layout) -> dict:
    from parallel.groups import build_groups

    groups = build_groups(layout)
    out = {}
    for name in ("world", *GROUP_NAMES):
        group = getattr(groups, name)
        # A real collective over the group: the sum of the members' global ranks.
        total = group.all_reduce(torch.tensor([float(rank)]))
        out[name] = (group.ranks, group.rank, total.item())
    return out


def test_every_rank_gets_the_layouts_groups_and_they_communicate():
    results = run_ranks(8, groups_of_rank, LAYOUT, timeout=60)
    for rank, groups in enumerate(results):
        for name in GROUP_NAMES:
            ranks, position, total = groups[name]
            assert ranks == LAYOUT.group(name, rank), (rank, name)
            assert position == LAYOUT.position(name, rank)
            assert total == sum(ranks)
        assert groups["world"] == (list(range(8)), rank, sum(range(8)))


def world_mismatch(rank: int) -> None:
    from parallel.groups import build_groups

    build_groups(Layout(4))


def test_a_world_that_disagrees_with_the_layout_is_a_clear_error():
    with pytest.raises(RankFailure, match=r"process group has 2 ranks but the layout's "
                                          r"world_size is 4"):
        run_ranks(2, world_mismatch, timeout=60)
    assert not dist.is_initialized()
