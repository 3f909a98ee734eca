"""data.pack: samples made of whole examples (documents), none split across two samples.

Without packing a sample is a window of the token stream, so an example may start in one sample
and end in the next: fine for pretraining, not for fine-tuning, where each example should be
seen whole. Packing places the split's documents into samples of seq_length + 1 tokens by best
fit decreasing (longest first, each into the fullest sample it still fits, else a new one):
samples come out nearly as full as the sizes allow (95.7% on examples of 40 to 120 tokens into
257, tests/unit/test_packing.py; examples of ~70 into 257 fill 82%: three fit, not four).
The rest of a sample is padding, no target and a document of its own; a document longer than
a sample is truncated to one sample of its own (counted and reported). Within a sample the
documents keep their order in the data, and samples are ordered by their first document; the
stream shuffles them as any samples.
"""
from __future__ import annotations

import bisect

import numpy as np


class Packs:
    """The packs of the documents in [start, end), each seq_length + 1 = `length` tokens: pack
    j holds documents docs[offsets[j]:offsets[j + 1]] (token ranges begins[d], sizes[d]) then
    padding."""

    def __init__(self, doc_starts: np.ndarray, start: int, end: int, length: int,
                 inner: np.ndarray | None = None):
        """doc_starts: where each example starts; inner: every document's start, where an
        example holds several (a preference pair's two documents: packed together, apart)."""
        self.inner = inner
        self.begins, self.sizes, self.truncated = examples(doc_starts, start, end, length)
        self.length, self.examples = length, len(self.begins)
        bins = _best_fit_decreasing(self.sizes.tolist(), length)
        bins = sorted(sorted(b) for b in bins)  # documents in data order, packs by the first
        self.docs = np.asarray([d for b in bins for d in b], dtype=np.int64)
        self.offsets = np.cumsum([0] + [len(b) for b in bins]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def efficiency(self) -> float:
        """Tokens of data over tokens of samples."""
        return float(self.sizes.sum()) / max(len(self) * self.length, 1)

    def describe(self, split: str) -> str:
        return (f"data.pack: the {split} split's {self.examples:,} examples in {len(self):,} "
                f"samples of {self.length:,} tokens, {self.efficiency:.1%} of them data; "
                f"{self.truncated:,} example(s) longer than a sample truncated")

    def _pieces(self, pack: int):
        """(offset in the sample, first token, size) of each document of a pack."""
        offset = 0
        for d in self.docs[self.offsets[pack]:self.offsets[pack + 1]].tolist():
            begin, size = int(self.begins[d]), int(self.sizes[d])
            yield offset, begin, size
            offset += size

    def tokens(self, tokens: np.ndarray, samples: np.ndarray, pad: int) -> np.ndarray:
        out = np.full((len(samples), self.length), pad, dtype=np.int64)
        for row, j in enumerate(samples.tolist()):
            for at, begin, size in self._pieces(j):
                out[row, at:at + size] = tokens[begin:begin + size]
        return out

    def loss_mask(self, mask: np.ndarray | None, samples: np.ndarray) -> np.ndarray:
        """The dataset's mask (or every token) on the data, 0 on the padding."""
        out = np.zeros((len(samples), self.length), dtype=np.uint8)
        for row, j in enumerate(samples.tolist()):
            for at, begin, size in self._pieces(j):
                out[row, at:at + size] = 1 if mask is None else mask[begin:begin + size]
        return out

    def document_starts(self, samples: np.ndarray) -> np.ndarray:
        """Where each token's document starts within its sample; the padding is one more."""
        out = np.zeros((len(samples), self.length), dtype=np.int64)
        for row, j in enumerate(samples.tolist()):
            end = 0
            for at, begin, size in self._pieces(j):
                out[row, at:] = at
                if self.inner is not None:  # the example's later documents start inside it
                    lo, hi = np.searchsorted(self.inner, [begin + 1, begin + size])
                    for s in self.inner[lo:hi].tolist():
                        out[row, at + s - begin:] = at + s - begin
                end = at + size
            out[row, end:] = end
        return out


def examples(doc_starts: np.ndarray, start: int, end: int, length: int
             ) -> tuple[np.ndarray, np.ndarray, int]:
    """The documents of [start, end) as packing keeps them: (first tokens, sizes cut to
    `length`, how many were cut)."""
    inside = doc_starts[(doc_starts > start) & (doc_starts < end)]
    edges = np.concatenate(([start], inside, [end]))  # a split may start inside a document
    sizes = np.diff(edges)
    return (edges[:-1].astype(np.int64), np.minimum(sizes, length).astype(np.int64),
            int((sizes > length).sum()))


def _best_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of at most `capacity`: items longest first, each into the
    bin with the least room that still holds it. Bins are kept by their room (at most capacity
    + 1 distinct values, in a sorted list), so each item costs a bisection."""
    rooms: list[int] = []  # distinct rooms of open bins, ascending
    by_room: dict[int, list[int]] = {}  # room -> bins with it
    bins: list[list[int]] = []
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        size = sizes[item]
        at = bisect.bisect_left(rooms, size)
        if at < len(rooms):
            room = rooms[at]
            b = by_room[room].pop()
            if not by_room[room]:
                del by_room[room]
                rooms.pop(at)
        else:
            b, room = len(bins), capacity
            bins.append([])
        bins[b].append(item)
        room -= size
        if room > 0:
            if room not in by_room:
                by_room[room] = []
                bisect.insort(rooms, room)
            by_room[room].append(b)
    return bins
