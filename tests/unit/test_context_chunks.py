"""Zigzag chunk pairs: over a whole ring, every rank's blocks cover each causal (query chunk,
key chunk) pair exactly once, causal exactly on the diagonal, and nothing above it; all_gather's
plan over the sequence in order does the same in two calls per query chunk."""
from __future__ import annotations

import pytest

from parallel.context.chunks import blocks
from parallel.layout import Layout


def covered(query_chunks, key_rows) -> dict[tuple[int, int], bool]:
    """(query chunk, key chunk) -> causal, from blocks over several rows of key chunks."""
    seen: dict[tuple[int, int], bool] = {}
    for keys in key_rows:
        for qi, k0, k1, causal in blocks(query_chunks, keys):
            assert not causal or k1 == k0 + 1  # a causal call is one chunk against itself
            for k in keys[k0:k1]:
                pair = (query_chunks[qi], k)
                assert pair not in seen, pair
                seen[pair] = causal
    return seen


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_a_ring_covers_every_causal_pair_once(cp):
    layout = Layout(cp, context_parallel_size=cp, seq_length=2 * cp * 4)
    members = [layout.context_chunk_ids(r) for r in range(cp)]
    for rank, mine in enumerate(members):
        rows = [members[(rank - step) % cp] for step in range(cp)]
        want = {(a, b): a == b for a in mine for b in range(2 * cp) if b <= a}
        assert covered(mine, rows) == want
        # the rank's work: its two chunks see 2C + 1 chunks of keys, whatever its position
        assert sum(k1 - k0 for keys in rows for _, k0, k1, _ in blocks(mine, keys)) == 2 * cp + 1


def test_in_sequence_order_each_query_chunk_is_two_calls():
    assert blocks((1, 6), tuple(range(8))) == [(0, 0, 1, False), (0, 1, 2, True),
                                               (1, 0, 6, False), (1, 6, 7, True)]
    assert blocks((0, 7), tuple(range(8))) == [(0, 0, 1, True), (1, 0, 7, False),
                                               (1, 7, 8, True)]
