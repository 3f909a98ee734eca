"""The kernel calls of attention between query chunks and key chunks, with or without documents.

A packed sequence holds several documents (data.reset_attention_mask); a token then attends
only to earlier tokens of its own document. Documents are contiguous, so a document is known by
where it starts: `starts` [batch, seq] holds, for every position of the whole sequence, the
position its document starts at (nondecreasing along a sample). Query i may see key j exactly
when starts[i] <= j <= i: the key side needs nothing, so a rank needs no other rank's document
ids, whichever keys reach it.

No mask is built, dense or by block. A (query chunk, key chunk) pair of the zigzag split is cut
into kernel calls over contiguous rows and keys:

- a key chunk before the query chunk: only the chunk's first piece of a document can reach
  back (every later piece starts inside the query chunk), and it sees the keys from its
  document's start (or the key chunk's) to the key chunk's end in full; skipped when its
  document starts after the key chunk;
- the query chunk itself: each piece of a document attends causally to itself (its keys start
  where its rows do: at the document's start, or at the chunk's for the piece that began
  earlier).

Where every sample of the micro-batch gives the same call (no document boundary in the way, the
common case of long documents) it is one batched call, the same as without documents; otherwise
one call a sample and piece. So short documents cost one small kernel call each (a Python loop;
on CPU torch has no variable-length kernel, and this is exact with no masked work at all).
"""
from __future__ import annotations

import numpy as np
import torch

from parallel.context.chunks import Pair, blocks, pair

ALL = slice(None)
# (samples, query rows, key rows, causal): rows index the local queries, keys the key buffer.
Call = tuple[slice, slice, slice, bool]


def plan_calls(query_chunks: tuple[int, ...], key_chunks: tuple[int, ...], chunk: int,
               starts: torch.Tensor | None = None) -> list[Call]:
    """The calls of local query chunks (global chunk ids, in memory order) over key chunks
    (global ids, in the key buffer's order), `chunk` tokens each. starts: the documents of the
    whole sequence (CPU, [batch, seq]); None: one document a sample."""
    if starts is None:  # adjacent fully visible key chunks joined into one call
        return [(ALL, slice(qi * chunk, (qi + 1) * chunk), slice(k0 * chunk, k1 * chunk), causal)
                for qi, k0, k1, causal in blocks(query_chunks, key_chunks)]
    starts = starts.numpy() if isinstance(starts, torch.Tensor) else np.asarray(starts)
    out: list[Call] = []
    for qi, q in enumerate(query_chunks):
        here = starts[:, q * chunk:(q + 1) * chunk]  # [batch, chunk] global document starts
        for ki, k in enumerate(key_chunks):
            kind = pair(q, k)
            if kind is None:
                continue
            base_row, base_key = qi * chunk, ki * chunk
            if kind is Pair.CAUSAL:
                per_sample = [_pieces(row) for row in here]
                calls = [[(slice(base_row + a, base_row + e), slice(base_key + a, base_key + e),
                           True) for a, e in pieces] for pieces in per_sample]
            else:
                per_sample = [_reach_back(row, k * chunk, chunk) for row in here]
                calls = [[] if reach is None else
                         [(slice(base_row, base_row + reach[0]),
                           slice(base_key + reach[1], base_key + chunk), False)]
                         for reach in per_sample]
            out += _batched(calls)
    return out


def _pieces(row: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each document's piece of a chunk (chunk-relative)."""
    cuts = np.flatnonzero(np.diff(row)) + 1
    edges = [0, *cuts.tolist(), len(row)]
    return list(zip(edges[:-1], edges[1:]))


def _reach_back(row: np.ndarray, key_start: int, chunk: int) -> tuple[int, int] | None:
    """(rows of the chunk's first piece, its first visible key, key-chunk-relative) over an
    earlier key chunk starting at key_start; None: that piece's document starts after it."""
    first = int(row[0])
    if first >= key_start + chunk:
        return None
    rows = int(np.searchsorted(row, first, side="right"))  # the piece: rows sharing its start
    return rows, max(first - key_start, 0)


def _batched(per_sample: list[list[Call]]) -> list[Call]:
    """Calls for the whole micro-batch where every sample makes the same ones."""
    first = per_sample[0]
    if all(calls == first for calls in per_sample):
        return [(ALL, rows, keys, causal) for rows, keys, causal in first]
    return [(slice(b, b + 1), rows, keys, causal)
            for b, calls in enumerate(per_sample) for rows, keys, causal in calls]
