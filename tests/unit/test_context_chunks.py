"""Zigzag chunk pairs: with the sequence in order, all_gather's calls (parallel/context/calls.py)
join the earlier full chunks of a query chunk into one call and run its own chunk causally; every
rank of a ring does the same causal work whatever its position."""
from __future__ import annotations

import pytest

from parallel.context.calls import ALL, CAUSAL, FULL, plan_calls
from parallel.layout import Layout


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_every_rank_of_a_ring_does_the_same_causal_work(cp):
    """Its two chunks see 2C + 1 chunks of keys (the diagonal counted whole), at any position."""
    chunk = 4
    layout = Layout(cp, context_parallel_size=cp, seq_length=2 * cp * chunk)
    members = [layout.context_chunk_ids(r) for r in range(cp)]
    for rank, mine in enumerate(members):
        keys = sum(k.stop - k.start for step in range(cp)
                   for _, _, k, _ in plan_calls(mine, members[(rank - step) % cp], chunk))
        assert keys == (2 * cp + 1) * chunk


def test_in_sequence_order_each_query_chunk_is_two_calls():
    assert plan_calls((1, 6), tuple(range(8)), 1) == [
        (ALL, slice(0, 1), slice(0, 1), FULL), (ALL, slice(0, 1), slice(1, 2), CAUSAL),
        (ALL, slice(1, 2), slice(0, 6), FULL), (ALL, slice(1, 2), slice(6, 7), CAUSAL)]
    assert plan_calls((0, 7), tuple(range(8)), 1) == [
        (ALL, slice(0, 1), slice(0, 1), CAUSAL), (ALL, slice(1, 2), slice(0, 7), FULL),
        (ALL, slice(1, 2), slice(7, 8), CAUSAL)]
