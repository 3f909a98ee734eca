"""The shuffled sample stream of a dataset split, served by global sample index: a pure function
of the index, so any rank fetches any sample in any order and a resumed run sees the same ones."""
from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

from trainer.config import ConfigError
from trainer.data.blend import PERIOD, blend_pattern
from trainer.data.dataset import TokenDataset
from trainer.data.packing import Packs
from trainer.data.preference import pair_starts
from trainer.data.source import DataSource


class SampleStream:
    """The endless sample stream of one split, epoch after epoch.

    Sample j of the split is tokens[start + j*seq_length : start + (j+1)*seq_length + 1], so a
    sample's last token is the next sample's first. Stream index i is position i % n of epoch
    i // n, where epoch e is a permutation of range(n) seeded by (seed, e). get() is a pure
    function of the indices: no state advances, so any rank fetches any index in any order.
    """

    def __init__(self, dataset: TokenDataset, split: Literal["train", "valid"], seq_length: int,
                 seed: int, shuffle: bool, max_id: int | None = None, pack: bool = False):
        """max_id: ids must be below it, checked on every sample read (a Megatron dataset: its
        index records no vocabulary, and a large one is only sampled before the run). pack:
        samples of whole documents (data.pack, trainer.data.packing) instead of windows."""
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be at least 1")
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed={seed} must be in [0, 2**32)")
        self.dataset, self.split, self.seq_length = dataset, split, seq_length
        self.seed, self.shuffle, self.max_id, self.pack = seed, shuffle, max_id, pack
        self.start, self.end = dataset.split(split)
        self._doc_starts: np.ndarray | None = None  # read when documents are first asked for
        # Packing runs the best-fit packer over the whole split: only when a sample is first
        # read, so the identity (what the launcher and a resume compare) costs no packing.
        self._packs: Packs | None = None
        self._num_samples: int | None = None
        if pack:
            self.pad = dataset.meta.get("eod_id") or 0  # never a target, never attended to
        else:
            n = self._enough((self.end - self.start - 1) // seq_length)
            # windows[j] = sample j, a read-only view of the memory map: indexing copies rows.
            step = dataset.tokens.itemsize
            self.windows = np.lib.stride_tricks.as_strided(
                dataset.tokens[self.start:], shape=(n, seq_length + 1),
                strides=(seq_length * step, step), writeable=False)
        self._orders: dict[int, np.ndarray] = {}  # the last two epochs: a batch may span both

    def _enough(self, samples: int) -> int:
        if samples < 1:
            raise ValueError(f"the {self.split} split of {self.dataset.path} has "
                             f"{self.end - self.start} tokens, too few for one sample of "
                             f"seq_length={self.seq_length} (needs {self.seq_length + 1}); lower "
                             f"seq_length or change data.valid_fraction")
        self._num_samples = samples
        return samples

    @property
    def packs(self) -> Packs | None:
        """data.pack's samples (trainer.data.packing), packed on first use; None unpacked."""
        if self.pack and self._packs is None:
            if self.dataset.meta.get("preference"):  # each pair packed whole, its documents apart
                packs = Packs(pair_starts(self.doc_starts), self.start, self.end,
                              self.seq_length + 1, inner=self.doc_starts)
                if packs.truncated:
                    raise ValueError(
                        f"{self.dataset.path}: {packs.truncated:,} preference pair(s) of the "
                        f"{self.split} split are longer than a sample of train.seq_length + 1 "
                        f"= {self.seq_length + 1} tokens: cut, a response would be lost. Fix: "
                        f"raise train.seq_length, or drop the long pairs")
                self._packs = packs
            else:
                self._packs = Packs(self.doc_starts, self.start, self.end, self.seq_length + 1)
        return self._packs

    @property
    def num_samples_per_epoch(self) -> int:
        if self._num_samples is None:  # packed: as many as the packer made
            self._enough(len(self.packs))
        return self._num_samples

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The split's sample positions in epoch's order."""
        if epoch not in self._orders:
            n = self.num_samples_per_epoch
            # Legacy RandomState: NEP 19 freezes its streams, so the order survives numpy
            # upgrades and a resumed run sees the samples it would have seen.
            order = (np.random.RandomState([self.seed, epoch]).permutation(n) if self.shuffle
                     else np.arange(n))
            if len(self._orders) >= 2:
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = order
        return self._orders[epoch]

    def _samples(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(stream indices, the split's sample positions they are)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and idx.min() < 0:
            raise ValueError(f"sample indices must be >= 0, got {int(idx.min())}")
        epochs, positions = np.divmod(idx, self.num_samples_per_epoch)
        samples = np.empty_like(positions)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            samples[here] = self.epoch_order(int(epoch))[positions[here]]
        return idx, samples

    def document_starts(self, indices: Sequence[int]) -> np.ndarray:
        """[len(indices), seq_length + 1] int64: for each token of these samples, where its
        document starts within the sample (0 for one that started before the sample). The
        documents are the dataset's (its document index: ours, or Megatron's .idx)."""
        _, samples = self._samples(indices)
        if self.pack:
            return self.packs.document_starts(samples)
        doc_starts = self.doc_starts
        first = self.start + samples * self.seq_length  # each sample's first token
        tokens = first[:, None] + np.arange(self.seq_length + 1)
        begins = doc_starts[np.searchsorted(doc_starts, tokens, side="right") - 1]
        return np.maximum(begins - first[:, None], 0)

    def describe_packing(self) -> list[str]:
        """data.pack's report: how full the samples are, what was truncated."""
        if not self.pack:
            return []
        return [f"{self.packs.describe(self.split)} ({self.dataset.path})"]

    @property
    def doc_starts(self) -> np.ndarray:
        if self._doc_starts is None:
            self._doc_starts = np.asarray(self.dataset.meta["doc_starts"], dtype=np.int64)
        return self._doc_starts

    def loss_mask(self, indices: Sequence[int]) -> np.ndarray | None:
        """[len(indices), seq_length + 1] uint8 of the dataset's loss mask (0: no target), or
        None when it has none."""
        if self.pack:  # the padding is no target, with or without a mask
            _, samples = self._samples(indices)
            return self.packs.loss_mask(self.dataset.loss_mask, samples)
        if self.dataset.loss_mask is None:
            return None
        _, samples = self._samples(indices)
        windows = np.lib.stride_tricks.as_strided(
            self.dataset.loss_mask[self.start:], shape=self.windows.shape,
            strides=(self.seq_length, 1), writeable=False)
        return np.array(windows[samples])

    def get(self, indices: Sequence[int]) -> np.ndarray:
        """[len(indices), seq_length + 1] int64 tokens of these stream indices."""
        idx, samples = self._samples(indices)
        if self.pack:
            out = self.packs.tokens(self.dataset.tokens, samples, self.pad)
        else:
            out = np.array(self.windows[samples], dtype=np.int64)
        if self.max_id is not None and out.size and out.max() >= self.max_id:
            row = int(np.argmax(out.max(axis=1)))
            raise ConfigError(
                f"data.path={self.dataset.path}: stream sample {int(idx[row])} holds token id "
                f"{int(out[row].max())}, but model.vocab_size={self.max_id} (the dataset's "
                f"index records no vocabulary). Fix: set model.vocab_size to the tokenizer's "
                f"vocabulary.")
        return out

    @property
    def identity(self) -> dict:
        """What fixes the stream's content; a checkpoint stores it to refuse a different one."""
        return {"fingerprint": self.dataset.fingerprint, "split": self.split,
                "token_range": list(self.dataset.split(self.split)),
                "seq_length": self.seq_length, "seed": self.seed, "shuffle": self.shuffle,
                **({"pack": True} if self.pack else {})}


class BlendedStream:
    """SampleStream's interface over several streams mixed by weight (data.blend; the order is
    explained in data.blend)."""

    def __init__(self, streams: list[SampleStream], weights: Sequence[float]):
        self.streams, self.weights = streams, list(weights)
        self.part, self.rank, self.per_period = blend_pattern(self.weights)

    def get(self, indices: Sequence[int]) -> np.ndarray:
        return self._gather(indices, SampleStream.get)

    def document_starts(self, indices: Sequence[int]) -> np.ndarray:
        return self._gather(indices, SampleStream.document_starts)

    def loss_mask(self, indices: Sequence[int]) -> np.ndarray | None:
        """A part without a loss mask counts every token."""
        if all(s.dataset.loss_mask is None for s in self.streams):
            return None

        def read(stream: SampleStream, local: list[int]):
            mask = stream.loss_mask(local)
            return 1 if mask is None else mask

        return self._gather(indices, read)

    def _gather(self, indices: Sequence[int], read) -> np.ndarray:
        """read(part's stream, its indices) of each part's samples, in the order asked."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        whole, position = np.divmod(idx, PERIOD)
        parts = self.part[position]
        local = whole * self.per_period[parts] + self.rank[position]
        out = np.empty((idx.size, self.streams[0].seq_length + 1), dtype=np.int64)
        for d in np.unique(parts):
            here = np.flatnonzero(parts == d)
            out[here] = read(self.streams[d], local[here].tolist())
        return out

    @property
    def identity(self) -> dict:
        return {"blend": [[w, s.identity] for w, s in zip(self.weights, self.streams)],
                "period": PERIOD}

    def describe_packing(self) -> list[str]:
        return [line for s in self.streams for line in s.describe_packing()]


Stream = SampleStream | BlendedStream


def open_streams(source: DataSource, seq_length: int, seed: int,
                 with_valid: bool, pack: bool = False) -> tuple[Stream, Stream | None]:
    """The train and valid streams of a data source (data.path, or each part of data.blend,
    mixed); the valid one only if the run evaluates. pack: data.pack."""
    def one(part: DataSource, split: str, shuffle: bool) -> SampleStream:
        # a Megatron dataset's ids are checked against the vocabulary as they are read
        return SampleStream(part.open(), split, seq_length, seed, shuffle,
                            part.vocab_size if part.megatron else None, pack)

    def stream(split: str, shuffle: bool) -> Stream:
        if not source.blend:
            return one(source, split, shuffle)
        return BlendedStream([one(part, split, shuffle) for _, part in source.blend],
                             [weight for weight, _ in source.blend])

    return stream("train", True), stream("valid", False) if with_valid else None
