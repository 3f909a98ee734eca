"""python -m trainer.prepare with Hugging Face tokenizers, offline: a byte-level BPE trained on
the sources, or a tokenizer.json (file or folder) given; every document ends with the
end-of-document id; the ids are those of the tokenizers library's own encoder; meta.json names
the tokenizer, its vocabulary and end-of-document id, and training checks model.vocab_size."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from trainer.compose.runspec import settle
from trainer.config import ConfigError
from trainer.data.dataset import TokenDataset, prepare

from config_helpers import ROOT, compose_config

TEXTS = {f"doc{i:02d}.txt": f"Document {i}: the layout shards weights, gathers them and "
         f"scatters gradients; caf\u00e9 \u2713 {i * 7}.\n" * (3 + i % 4) for i in range(24)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("texts")
    for name, text in TEXTS.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def trained(sources, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "bpe"
    proc = subprocess.run([sys.executable, "-m", "trainer.prepare", str(sources), str(out),
                           "--train-tokenizer", "300", "--valid-fraction", "0.1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "end of document" in proc.stdout
    return out


def documents(dataset: TokenDataset) -> list[np.ndarray]:
    starts = dataset.meta["doc_starts"] + [dataset.num_tokens]
    return [np.asarray(dataset.tokens[a:b]) for a, b in zip(starts, starts[1:])]


def test_a_trained_bpe_encodes_every_document_losslessly_with_an_end_token(trained):
    dataset = TokenDataset.open(trained)
    meta = dataset.meta
    assert meta["tokenizer"] == "tokenizer.json" and (trained / "tokenizer.json").is_file()
    assert 256 < meta["vocab_size"] <= 300 and meta["dtype"] == "uint16"
    tokenizer = Tokenizer.from_file(str(trained / "tokenizer.json"))
    assert tokenizer.id_to_token(meta["eod_id"]) == "<|endoftext|>"
    docs = documents(dataset)
    assert len(docs) == len(TEXTS)
    for ids, text in zip(docs, TEXTS.values()):  # files are read in sorted order
        assert ids[-1] == meta["eod_id"] and meta["eod_id"] not in ids[:-1]
        assert tokenizer.decode(ids[:-1].tolist()) == text
        assert len(ids) < len(text.encode())  # merges happened: fewer tokens than bytes


@pytest.mark.parametrize("given", ["file", "folder"])
def test_a_given_tokenizer_gives_the_librarys_own_ids(given, trained, sources, tmp_path):
    path = trained / "tokenizer.json" if given == "file" else trained
    out = prepare(sources, tmp_path / "given", 0.1, tokenizer=path)
    dataset = TokenDataset.open(out)
    assert dataset.meta["tokenizer"] == str((trained / "tokenizer.json").resolve())
    oracle = Tokenizer.from_file(str(trained / "tokenizer.json"))
    eod = oracle.token_to_id("<|endoftext|>")
    want = [oracle.encode(text, add_special_tokens=False).ids + [eod] for text in TEXTS.values()]
    assert [d.tolist() for d in documents(dataset)] == want
    assert dataset.fingerprint == TokenDataset.open(trained).fingerprint


def test_the_end_token_comes_from_tokenizer_config_or_is_asked_for(trained, sources, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    data = json.loads((trained / "tokenizer.json").read_text())
    data["added_tokens"][0]["content"] = "<|my_eod|>"  # a name prepare does not guess
    data["model"]["vocab"]["<|my_eod|>"] = data["model"]["vocab"].pop("<|endoftext|>")
    (folder / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"has no end-of-document token .* --eod-token"):
        prepare(sources, tmp_path / "a", 0.1, tokenizer=folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|my_eod|>"}))
    meta = TokenDataset.open(prepare(sources, tmp_path / "b", 0.1, tokenizer=folder)).meta
    assert meta["eod_id"] == Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(
        "<|my_eod|>")
    with pytest.raises(ValueError, match=r"--tokenizer .*: no tokenizer.json there"):
        prepare(sources, tmp_path / "c", 0.1, tokenizer=tmp_path / "nothing")


def test_training_checks_the_vocabulary_and_trains(trained, tmp_path):
    vocab = TokenDataset.open(trained).vocab_size
    with pytest.raises(ConfigError, match=rf"vocabulary of {vocab} tokens but model.vocab_size="
                                          r"256. Fix: set model.vocab_size >= "):
        settle(compose_config("model=tiny", f"data.path={trained}", "train.seq_length=16"))
    proc = subprocess.run(
        [sys.executable, "launch.py", "model=tiny", f"model.vocab_size={vocab}",
         f"data.path={trained}", "train.seq_length=16", "train.train_samples=32",
         "train.eval_samples=8", "train.eval_interval=4", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step      4/4" in proc.stdout
