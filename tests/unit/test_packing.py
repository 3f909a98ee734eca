"""data.pack (trainer/data/packing.py through the sample stream): whole documents placed into
samples of seq_length + 1 tokens by best fit decreasing, the rest padding that is no target and
its own document; a document longer than a sample truncated, alone, and counted."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from parallel.layout import Layout
from trainer.data.dataset import TokenDataset
from trainer.data.packing import Packs
from trainer.data.stream import SampleStream
from trainer.train.batch import IGNORE, DocumentRules, rank_micro_batches

LENGTHS = [3, 5, 2, 9, 4]  # tokens of each document


def dataset(with_mask: bool = False) -> TokenDataset:
    starts = np.concatenate(([0], np.cumsum(LENGTHS)[:-1])).tolist()
    total = sum(LENGTHS)
    tokens = np.arange(1, total + 1, dtype=np.uint16)  # token t is 1 + its position
    mask = (np.arange(total) % 2).astype(np.uint8) if with_mask else None
    meta = {"doc_starts": starts, "num_tokens": total, "fingerprint": "test", "eod_id": 0,
            "splits": {"train": [0, total], "valid": [total, total]}}
    if with_mask:
        meta["loss_mask"] = True
    return TokenDataset(Path("docs"), meta, tokens, mask)


def test_documents_fill_samples_whole_and_a_long_one_is_truncated():
    packs = Packs(np.asarray(dataset().meta["doc_starts"]), 0, sum(LENGTHS), 8)
    # longest first into the fullest sample that holds it: 9 (truncated to 8) alone, 5 new,
    # 4 new, 3 with the 5, 2 with the 4; in data order, samples by their first document
    assert [packs.docs[a:b].tolist() for a, b in zip(packs.offsets, packs.offsets[1:])] == \
        [[0, 1], [2, 4], [3]]
    assert packs.truncated == 1 and packs.examples == 5
    assert packs.efficiency == 22 / 24
    assert "5 examples in 3 samples of 8 tokens, 91.7% of them data; 1 example(s)" in \
        packs.describe("train")


def test_best_fit_fills_chat_sized_examples():
    """Examples of 40 to 120 tokens into samples of 257: 95% or more of the tokens are data."""
    rng = np.random.RandomState(0)
    starts = np.concatenate(([0], np.cumsum(rng.randint(40, 121, size=2000))[:-1]))
    packs = Packs(starts, 0, int(starts[-1]) + 80, 257)
    assert packs.efficiency > 0.95 and sorted(packs.docs.tolist()) == list(range(2000))


def test_the_stream_serves_packs_with_padding_masked_and_apart():
    stream = SampleStream(dataset(), "train", 7, seed=0, shuffle=False, pack=True)
    tokens = stream.get([0, 1, 2]).tolist()
    assert tokens == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 20, 21, 22, 23, 0, 0],
                      [11, 12, 13, 14, 15, 16, 17, 18]]
    assert stream.document_starts([0, 1]).tolist() == [[0, 0, 0, 3, 3, 3, 3, 3],
                                                       [0, 0, 2, 2, 2, 2, 6, 6]]
    assert stream.loss_mask([1]).tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]]
    assert stream.identity["pack"] is True
    # labels: the padding is never a target
    layout = Layout(1, micro_batch_size=1, seq_length=7, global_batch_size=1)
    labels = rank_micro_batches(stream, layout, 0, None, DocumentRules(), offset=1)[0].labels
    assert labels.tolist() == [[10, 20, 21, 22, 23, IGNORE, IGNORE]]


def test_a_dataset_mask_is_kept_on_the_data():
    stream = SampleStream(dataset(with_mask=True), "train", 7, seed=0, shuffle=False, pack=True)
    # positions 8, 9 and 19..22 of the alternating mask, then padding
    assert stream.loss_mask([1]).tolist() == [[0, 1, 1, 0, 1, 0, 0, 0]]


def test_the_identity_is_read_without_packing_and_the_split_is_packed_once(monkeypatch):
    """The launcher reads a packed stream's identity to check a resume: that runs no packer;
    the first sample read packs the split, and only that one."""
    packed = []

    class CountedPacks(Packs):
        def __init__(self, *args):
            packed.append(args)
            super().__init__(*args)

    monkeypatch.setattr("trainer.data.stream.Packs", CountedPacks)
    stream = SampleStream(dataset(), "train", 7, seed=3, shuffle=True, pack=True)
    assert stream.identity == {"fingerprint": "test", "split": "train",
                               "token_range": [0, sum(LENGTHS)], "seq_length": 7, "seed": 3,
                               "shuffle": True, "pack": True}
    assert packed == []
    stream.get([0, 1])
    stream.document_starts([2])
    assert stream.num_samples_per_epoch == 3 and len(packed) == 1
