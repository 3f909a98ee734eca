"""The kernel calls over packed documents (parallel/context/calls.py) cover exactly the pairs a
document mask allows, each once: checked against the definition (query i sees key j when
starts[i] <= j <= i), written here as a dense mask, for every rank of several zigzag splits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from parallel.context.calls import ALL, plan_calls
from parallel.layout import Layout


def random_starts(rng: np.random.RandomState, batch: int, seq: int, longest: int
                  ) -> torch.Tensor:
    """[batch, seq] document starts of documents 1..longest tokens long (the first of each
    sample may have begun before it: start 0)."""
    rows = []
    for _ in range(batch):
        cuts = np.cumsum(rng.randint(1, longest + 1, size=seq))
        cuts = cuts[cuts < seq] - rng.randint(0, 2)  # sometimes a boundary at 0 + 1 - 1
        begins = np.zeros(seq, dtype=np.int64)
        for cut in sorted(set(cuts.tolist()) - {0}):
            begins[cut:] = cut
        rows.append(begins)
    return torch.from_numpy(np.stack(rows))


def covered(calls, batch: int, rows: int, keys: int) -> np.ndarray:
    """How many calls cover each (sample, local query row, key buffer row)."""
    count = np.zeros((batch, rows, keys), dtype=np.int64)
    for samples, r, k, causal in calls:
        block = np.ones((r.stop - r.start, k.stop - k.start), dtype=np.int64)
        if causal:
            assert r.stop - r.start == k.stop - k.start
            block = np.tril(block)
        count[samples, r, k] += block
    return count


@pytest.mark.parametrize("cp,seq,longest", [(1, 24, 7), (2, 32, 5), (4, 32, 12), (4, 64, 3),
                                            (8, 64, 40)])
def test_calls_cover_what_the_documents_allow_once(cp, seq, longest):
    rng = np.random.RandomState(cp * seq + longest)
    layout = Layout(cp, context_parallel_size=cp, seq_length=seq)
    chunk, batch = seq // (2 * cp), 3
    starts = random_starts(rng, batch, seq, longest)
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    allowed = (starts.numpy()[:, :, None] <= j) & (j <= i)  # [batch, query, key]
    for rank in range(cp):
        mine = layout.context_chunk_ids(rank) if cp > 1 else (0,)
        length = chunk if cp > 1 else seq
        queries = np.concatenate([np.arange(c * length, (c + 1) * length) for c in mine])
        everything = tuple(range(2 * cp)) if cp > 1 else (0,)
        calls = plan_calls(mine, everything, length, starts)
        got = covered(calls, batch, len(queries), seq)
        want = allowed[:, queries, :].astype(np.int64)
        assert (got == want).all(), (rank, np.argwhere(got != want)[:5])


def test_without_a_boundary_in_the_way_the_calls_are_the_batched_ones():
    """Documents longer than the chunks they span change nothing: the same calls as without
    documents (one batched call a pair, the earlier full chunks joined)."""
    layout = Layout(2, context_parallel_size=2, seq_length=16)
    starts = torch.zeros(2, 16, dtype=torch.int64)
    starts[:, 12:] = 12  # a boundary in chunk 3 only: rank 1 keeps chunks 1 and 2
    plain = plan_calls(layout.context_chunk_ids(1), (0, 1, 2, 3), 4)
    with_documents = plan_calls(layout.context_chunk_ids(1), (0, 1, 2, 3), 4, starts)
    assert all(samples == ALL for samples, *_ in with_documents)
    assert len(with_documents) == 5 and len(plain) == 4  # chunk 2 over 0 and 1: not joined
    covered_plain = covered(plain, 2, 8, 16)
    assert (covered(with_documents, 2, 8, 16) == covered_plain).all()


def test_a_document_starting_after_an_earlier_chunk_skips_it():
    starts = torch.tensor([[0, 0, 0, 0, 4, 4, 4, 4]])  # chunk 1 is a new document
    calls = plan_calls((1,), (0, 1), 4, starts)
    assert calls == [(ALL, slice(0, 4), slice(4, 8), True)]  # itself, causally; chunk 0 never
