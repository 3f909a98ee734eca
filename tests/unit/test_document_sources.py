"""Document starts from every kind of data (trainer.data.stream.document_starts: the dataset's
document index), checked against the tokens themselves: with a tokenizer that ends every
document with its end-of-document token, a document starts in a sample exactly at position 0
or right after that token. Our folder, the same tokens as a Megatron .bin/.idx, and a blend of
the two, shuffled."""
from __future__ import annotations

import numpy as np
import pytest

from trainer.data.dataset import TokenDataset, prepare
from trainer.data.megatron import open_indexed, write_indexed
from trainer.data.stream import BlendedStream, SampleStream

SEQ = 40


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    src = root / "src"
    src.mkdir()
    rng = np.random.RandomState(0)
    words = ["alpha", "beta", "gamma", "delta", "eps"]
    for i in range(60):  # documents of 1 to 30 words
        (src / f"{i:02d}.txt").write_text(" ".join(rng.choice(words, rng.randint(1, 31))))
    ours = TokenDataset.open(prepare(src, root / "ours", 0.1, train_vocab_size=300))
    write_indexed(ours, root / "mg" / "docs")
    return ours, open_indexed(root / "mg" / "docs", 0.1)


def check(stream, indices, eod: int) -> None:
    tokens, starts = stream.get(indices), stream.document_starts(indices)
    assert starts.shape == tokens.shape
    positions = np.arange(SEQ + 1)
    for row, begin in zip(tokens, starts):
        new = begin == positions  # a document starts here (position 0: the sample's first)
        after_eod = np.concatenate(([True], row[:-1] == eod))
        assert (new[1:] == after_eod[1:]).all()
        # between starts, each position's start is the last one before it
        assert (begin == np.maximum.accumulate(np.where(new, positions, 0))).all()


def test_our_megatrons_and_a_blends_documents_are_where_the_tokens_say(datasets):
    ours, megatron = datasets
    eod = ours.meta["eod_id"]
    indices = list(range(0, 30, 3))
    for dataset in (ours, megatron):
        check(SampleStream(dataset, "train", SEQ, seed=5, shuffle=True), indices, eod)
    blend = BlendedStream([SampleStream(d, "train", SEQ, seed=5, shuffle=True)
                           for d in (ours, megatron)], [0.4, 0.6])
    check(blend, indices, eod)
    assert blend.loss_mask(indices) is None
