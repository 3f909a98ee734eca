"""data.pack: samples made of whole examples (documents), none split across two samples.

Without packing a sample is a window of the token stream, so an example may start in one sample
and end in the next: fine for pretraining, not for fine-tuning, where each example should be
seen whole. Packing fills each sample with consecutive documents of the split in their order,
greedily, up to seq_length + 1 tokens; the rest is padding (no target, its own document). A
document longer than a sample is truncated to one sample of its own (counted and reported).
Consecutive documents are consecutive tokens, so a pack is one token range plus padding.
"""
from __future__ import annotations

import numpy as np


class Packs:
    """The packs of the documents in [start, end): pack j is tokens [begins[j], begins[j] +
    sizes[j]) then padding to `length`."""

    def __init__(self, doc_starts: np.ndarray, start: int, end: int, length: int):
        inside = doc_starts[(doc_starts > start) & (doc_starts < end)]
        edges = np.concatenate(([start], inside, [end]))  # a split may start inside a document
        begins, sizes, self.truncated = [], [], 0
        pack_begin, pack_size = int(edges[0]), 0
        for begin, size in zip(edges[:-1].tolist(), np.diff(edges).tolist()):
            if size > length:  # an example longer than a sample: alone, truncated
                if pack_size:
                    begins.append(pack_begin)
                    sizes.append(pack_size)
                begins.append(begin)
                sizes.append(length)
                self.truncated += 1
                pack_begin, pack_size = begin + size, 0
            elif pack_size + size > length:
                begins.append(pack_begin)
                sizes.append(pack_size)
                pack_begin, pack_size = begin, size
            else:
                pack_size += size
        if pack_size:
            begins.append(pack_begin)
            sizes.append(pack_size)
        self.begins = np.asarray(begins, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.length, self.examples = length, len(edges) - 1

    def __len__(self) -> int:
        return len(self.begins)

    @property
    def efficiency(self) -> float:
        """Tokens of data over tokens of samples."""
        return float(self.sizes.sum()) / max(len(self) * self.length, 1)

    def describe(self, split: str) -> str:
        return (f"data.pack: the {split} split's {self.examples:,} examples in {len(self):,} "
                f"samples of {self.length:,} tokens, {self.efficiency:.1%} of them data; "
                f"{self.truncated:,} example(s) longer than a sample truncated")

    def tokens(self, tokens: np.ndarray, samples: np.ndarray, pad: int) -> np.ndarray:
        out = np.full((len(samples), self.length), pad, dtype=np.int64)
        for row, j in enumerate(samples.tolist()):
            begin, size = self.begins[j], self.sizes[j]
            out[row, :size] = tokens[begin:begin + size]
        return out

    def loss_mask(self, mask: np.ndarray | None, samples: np.ndarray) -> np.ndarray:
        """The dataset's mask (or every token) on the data, 0 on the padding."""
        out = np.zeros((len(samples), self.length), dtype=np.uint8)
        for row, j in enumerate(samples.tolist()):
            begin, size = self.begins[j], self.sizes[j]
            out[row, :size] = 1 if mask is None else mask[begin:begin + size]
        return out

    def document_starts(self, doc_starts: np.ndarray, samples: np.ndarray) -> np.ndarray:
        """Where each token's document starts within its sample; the padding is one more."""
        out = np.zeros((len(samples), self.length), dtype=np.int64)
        for row, j in enumerate(samples.tolist()):
            begin, size = self.begins[j], self.sizes[j]
            lo, hi = np.searchsorted(doc_starts, [begin + 1, begin + size])
            for offset in (doc_starts[lo:hi] - begin).tolist() + [size]:
                out[row, offset:] = offset
        return out
