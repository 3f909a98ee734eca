"""data.pack (trainer/data/packing.py through the sample stream): whole documents, in order,
greedily filled into samples of seq_length + 1 tokens, the rest padding that is no target and
its own document; a document longer than a sample truncated, alone, and counted."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from parallel.layout import Layout
from trainer.data.batch import IGNORE, DocumentRules, rank_micro_batches
from trainer.data.dataset import TokenDataset
from trainer.data.packing import Packs
from trainer.data.stream import SampleStream

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
    # [3 + 5], [2] (9 would not fit), [9 truncated to 8], [4]
    assert packs.begins.tolist() == [0, 8, 10, 19] and packs.sizes.tolist() == [8, 2, 8, 4]
    assert packs.truncated == 1 and packs.examples == 5
    assert packs.efficiency == 22 / 32
    assert "5 examples in 4 samples of 8 tokens, 68.8% of them data; 1 example(s)" in \
        packs.describe("train")


def test_the_stream_serves_packs_with_padding_masked_and_apart():
    stream = SampleStream(dataset(), "train", 7, seed=0, shuffle=False, pack=True)
    tokens = stream.get([0, 1, 2, 3]).tolist()
    assert tokens == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 0, 0, 0, 0, 0, 0],
                      [11, 12, 13, 14, 15, 16, 17, 18], [20, 21, 22, 23, 0, 0, 0, 0]]
    assert stream.document_starts([0, 1]).tolist() == [[0, 0, 0, 3, 3, 3, 3, 3],
                                                       [0, 0, 2, 2, 2, 2, 2, 2]]
    assert stream.loss_mask([1]).tolist() == [[1, 1, 0, 0, 0, 0, 0, 0]]
    assert stream.identity["pack"] is True
    # labels: the padding is never a target
    layout = Layout(1, micro_batch_size=1, seq_length=7, global_batch_size=1)
    labels = rank_micro_batches(stream, layout, 0, None, DocumentRules(), offset=1)[0].labels
    assert labels.tolist() == [[10] + [IGNORE] * 6]


def test_a_dataset_mask_is_kept_on_the_data():
    stream = SampleStream(dataset(with_mask=True), "train", 7, seed=0, shuffle=False, pack=True)
    assert stream.loss_mask([1]).tolist() == [[0, 1, 0, 0, 0, 0, 0, 0]]  # tokens 8, 9 of 0/1
