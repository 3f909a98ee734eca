"""The kernel calls over packed documents and sliding windows (parallel/context/calls.py) cover
exactly the pairs the mask allows, each once: checked against the definition (query i sees key j
when starts[i] <= j <= i and i - window <= j), written here as a dense mask, for every rank of
several zigzag splits, over the whole sequence and over a ring's steps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from parallel.context.calls import ALL, ANTI, CAUSAL, FULL, plan_calls
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
    for samples, r, k, shape in calls:
        assert 0 <= r.start < r.stop <= rows and 0 <= k.start < k.stop <= keys
        block = np.ones((r.stop - r.start, k.stop - k.start), dtype=np.int64)
        if shape != FULL:  # square: causal row i sees keys 0..i; anti keys i..
            assert r.stop - r.start == k.stop - k.start and shape in (CAUSAL, ANTI)
            block = np.tril(block) if shape == CAUSAL else np.triu(block)
        count[samples, r, k] += block
    return count


def allowed_pairs(starts: np.ndarray, window: int | None) -> np.ndarray:
    """[batch, query, key]: the definition, as a dense mask."""
    seq = starts.shape[1]
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    allowed = (starts[:, :, None] <= j) & (j <= i)
    return allowed & (j >= i - window) if window is not None else allowed


WINDOWS = [None, 1, 2, 3, 5, 8, 13, 40]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cp,seq,longest", [(1, 24, 7), (2, 32, 5), (4, 32, 12), (4, 64, 3),
                                            (8, 64, 40), (2, 32, None)])
def test_calls_cover_what_the_documents_and_window_allow_once(cp, seq, longest, window):
    rng = np.random.RandomState(cp * seq + (longest or 0))
    layout = Layout(cp, context_parallel_size=cp, seq_length=seq)
    chunk, batch = seq // (2 * cp), 3
    starts = random_starts(rng, batch, seq, longest) if longest else None
    allowed = allowed_pairs(np.zeros((batch, seq), dtype=np.int64) if starts is None
                            else starts.numpy(), window)
    for rank in range(cp):
        mine = layout.context_chunk_ids(rank) if cp > 1 else (0,)
        length = chunk if cp > 1 else seq
        queries = np.concatenate([np.arange(c * length, (c + 1) * length) for c in mine])
        everything = tuple(range(2 * cp)) if cp > 1 else (0,)
        calls = plan_calls(mine, everything, length, starts, window)
        got = covered(calls, batch, len(queries), seq)
        want = allowed[:, queries, :].astype(np.int64)
        assert (got == want).all(), (rank, np.argwhere(got != want)[:5])


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_a_ring_of_steps_covers_each_pair_once_and_skips_the_unreached(cp, window):
    """The ring's steps (each over one member's two chunks) together cover the mask once; a
    step whose member's chunks the window never reaches has no call."""
    seq, batch = 2 * cp * 6, 2
    layout = Layout(cp, context_parallel_size=cp, seq_length=seq)
    chunk = seq // (2 * cp)
    members = [layout.context_chunk_ids(r) for r in range(cp)]
    allowed = allowed_pairs(np.zeros((batch, seq), dtype=np.int64), window)
    for rank, mine in enumerate(members):
        queries = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in mine])
        got = np.zeros((batch, len(queries), seq), dtype=np.int64)
        for held in (members[(rank - step) % cp] for step in range(cp)):
            calls = plan_calls(mine, held, chunk, None, window)
            keys = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in held])
            got[:, :, keys] += covered(calls, batch, len(queries), len(keys))
            reached = allowed[:, queries][:, :, keys].any()
            assert bool(calls) == bool(reached)
        assert (got == allowed[:, queries].astype(np.int64)).all()


def test_without_a_boundary_in_the_way_the_calls_are_the_batched_ones():
    """Documents longer than the chunks they span change nothing: the same calls as without
    documents (one batched call a pair, the earlier full chunks joined)."""
    layout = Layout(2, context_parallel_size=2, seq_length=16)
    starts = torch.zeros(2, 16, dtype=torch.int64)
    starts[:, 12:] = 12  # a boundary in chunk 3 only: rank 1 keeps chunks 1 and 2
    plain = plan_calls(layout.context_chunk_ids(1), (0, 1, 2, 3), 4)
    with_documents = plan_calls(layout.context_chunk_ids(1), (0, 1, 2, 3), 4, starts)
    assert with_documents == plain and len(plain) == 4  # chunk 2 over 0 and 1 joined


def test_a_document_starting_after_an_earlier_chunk_skips_it():
    starts = torch.tensor([[0, 0, 0, 0, 4, 4, 4, 4]])  # chunk 1 is a new document
    calls = plan_calls((1,), (0, 1), 4, starts)
    assert calls == [(ALL, slice(0, 4), slice(4, 8), CAUSAL)]  # itself, causally; chunk 0 never


def test_a_window_is_a_band_of_causal_and_reversed_causal_squares():
    """One process, 16 tokens, a window of 4: the first 5 rows causally, then runs of 4 rows:
    the window's back edge (reversed causal) and the diagonal (causal), no full work past the
    band."""
    assert plan_calls((0,), (0,), 16, None, 4) == [
        (ALL, slice(0, 5), slice(0, 5), CAUSAL),
        (ALL, slice(5, 9), slice(1, 5), ANTI), (ALL, slice(5, 9), slice(5, 9), CAUSAL),
        (ALL, slice(9, 13), slice(5, 9), ANTI), (ALL, slice(9, 13), slice(9, 13), CAUSAL),
        (ALL, slice(13, 16), slice(9, 12), ANTI), (ALL, slice(13, 16), slice(12, 13), FULL),
        (ALL, slice(13, 16), slice(13, 16), CAUSAL)]
