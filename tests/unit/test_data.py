"""The data layer: prepared format, atomic prepare, meta validation, the sample stream."""
from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.data import dataset as data
from trainer.data.dataset import TokenDataset, builtin_corpus, decode, prepare
from trainer.data.stream import SampleStream

DOCS = {"a.txt": b"first document\n", "b/c.md": b"second, in a subfolder\n",
        "b/d.txt": "third: caf\u00e9 \u2713\n".encode(), "e.txt": b"fourth and last\n"}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for name, body in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(body)
    (root / ".hidden.txt").write_bytes(b"hidden")  # hidden: skipped
    (root / "empty.txt").write_bytes(b"")  # no tokens: no document
    return root


def make_dataset(tmp_path: Path, num_tokens: int, valid_fraction: float = 0.0) -> TokenDataset:
    """One document of num_tokens bytes, token k = k % 251, so a window's values say where it is."""
    text = tmp_path / "one.txt"
    text.write_bytes(bytes(k % 251 + 1 for k in range(num_tokens)))  # no NUL: still text
    return TokenDataset.open(prepare(text, tmp_path / "ds", valid_fraction))


def test_round_trip_tokens_documents_and_split(src: Path, tmp_path: Path) -> None:
    out = prepare(src, tmp_path / "out", valid_fraction=0.2)
    ds = TokenDataset.open(out)
    ordered = [DOCS[k] for k in ("a.txt", "b/c.md", "b/d.txt", "e.txt")]  # sorted by path
    assert bytes(ds.tokens) == b"".join(ordered)
    assert ds.tokens.dtype == np.uint8 and ds.vocab_size == 256
    assert ds.meta["doc_starts"] == list(np.cumsum([0] + [len(d) for d in ordered[:-1]]))
    # 20% of the tokens is less than the last document: exactly the last one is held out.
    assert ds.split("valid") == (ds.num_tokens - len(ordered[-1]), ds.num_tokens)
    assert ds.split("train") == (0, ds.num_tokens - len(ordered[-1]))
    assert ds.num_documents("train") == 3 and ds.num_documents("valid") == 1
    assert decode(torch.from_numpy(np.array(ds.tokens[:15]))) == "first document\n"
    assert decode(list(DOCS["b/d.txt"])) == DOCS["b/d.txt"].decode()
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokens.bin"]


def test_valid_split_takes_whole_documents_from_the_end(src: Path, tmp_path: Path) -> None:
    ds = TokenDataset.open(prepare(src, tmp_path / "out", valid_fraction=0.5))
    start, end = ds.split("valid")
    starts = ds.meta["doc_starts"]
    assert start in starts and end - start >= 0.5 * ds.num_tokens
    next_start = starts[starts.index(start) + 1]  # the fewest documents that hold half
    assert end - next_start < 0.5 * ds.num_tokens
    no_valid = TokenDataset.open(prepare(src, tmp_path / "out0", valid_fraction=0.0))
    assert no_valid.split("valid") == (no_valid.num_tokens, no_valid.num_tokens)
    with pytest.raises(ValueError, match="leaves no training tokens"):
        prepare(src, tmp_path / "out1", valid_fraction=0.99)


def test_a_single_document_is_split_by_tokens(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, 1000, valid_fraction=0.1)
    assert ds.split("train") == (0, 900) and ds.split("valid") == (900, 1000)


def test_decode_replaces_what_is_not_text() -> None:
    assert decode([104, 105, 0xC3]) == "hi\ufffd"  # a cut multi-byte character
    assert decode([104, 300, -1, 105]) == "h\ufffd\ufffdi"  # ids outside a byte


def test_prepare_user_errors_name_the_path_or_value(tmp_path: Path, src: Path) -> None:
    (tmp_path / "void").mkdir()
    with pytest.raises(ValueError, match=r"no files found in .*void"):
        prepare(tmp_path / "void", tmp_path / "out", 0.1)
    with pytest.raises(ValueError, match=r"missing.* does not exist"):
        prepare(tmp_path / "missing", tmp_path / "out", 0.1)
    with pytest.raises(ValueError, match=r"--tokenizer gpt2: no tokenizer.json there; pass byte"):
        prepare(src, tmp_path / "out", 0.1, tokenizer="gpt2")
    (tmp_path / "image.bin").write_bytes(b"\x89PNG\x00\x01")  # in a folder: test_inputs.py
    with pytest.raises(ValueError, match=r"image.bin is not a text file"):
        prepare([src / "a.txt", tmp_path / "image.bin"], tmp_path / "out", 0.1)
    with pytest.raises(ValueError, match=r"valid_fraction=1.5"):
        prepare(src, tmp_path / "out", 1.5)
    assert not (tmp_path / "out").exists()


def test_a_failure_mid_write_leaves_nothing_and_a_retry_works(src, tmp_path, monkeypatch) -> None:
    def crash(path, obj):
        assert (path.parent / "tokens.bin").stat().st_size > 0  # tokens were already written
        raise OSError("disk full")

    monkeypatch.setattr(data, "write_json", crash)
    with pytest.raises(OSError, match="disk full"):
        prepare(src, tmp_path / "out", 0.2)
    assert list(tmp_path.iterdir()) == [src]  # no out_dir, no temporary sibling
    monkeypatch.undo()
    assert TokenDataset.open(prepare(src, tmp_path / "out", 0.2)).num_tokens > 0


def test_preparing_an_existing_dataset_keeps_it_and_a_different_one_is_refused(src, tmp_path):
    out = prepare(src, tmp_path / "out", 0.2)
    before = (out / "tokens.bin").stat().st_mtime_ns
    assert prepare(src, out, 0.2) == out  # the loser of a race takes the winner's result
    assert (out / "tokens.bin").stat().st_mtime_ns == before
    with pytest.raises(ValueError, match="already holds a different dataset"):
        prepare(src, out, 0.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_concurrent_prepares_agree(src: Path, tmp_path: Path) -> None:
    with multiprocessing.get_context("fork").Pool(4) as pool:
        outs = pool.starmap(prepare, [(src, tmp_path / "out", 0.2)] * 8)
    assert set(outs) == {tmp_path / "out"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    assert bytes(TokenDataset.open(tmp_path / "out").tokens) == b"".join(
        DOCS[k] for k in ("a.txt", "b/c.md", "b/d.txt", "e.txt"))


def test_meta_validation_names_the_file_and_the_problem(src: Path, tmp_path: Path) -> None:
    out = prepare(src, tmp_path / "out", 0.2)
    meta = json.loads((out / "meta.json").read_text())
    with open(out / "tokens.bin", "r+b") as f:
        f.truncate(meta["num_tokens"] - 3)
    with pytest.raises(ValueError, match=rf"tokens.bin has {meta['num_tokens'] - 3} bytes but "
                                         rf".*meta.json says num_tokens={meta['num_tokens']}"):
        TokenDataset.open(out)
    for change, message in [({"format_version": 99}, "format_version=99"),
                            ({"dtype": "float32"}, "dtype='float32'"),
                            ({"splits": {"train": [0, 5]}}, "splits="),
                            ({"doc_starts": [3, 1]}, r"num_tokens=\d+ and doc_starts")]:
        (out / "meta.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(ValueError, match=rf"meta.json has {message}"):
            TokenDataset.open(out)
    (out / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "dtype"}))
    with pytest.raises(ValueError, match=r"meta.json lacks the keys \['dtype'\]"):
        TokenDataset.open(out)
    (out / "meta.json").unlink()
    with pytest.raises(ValueError, match=r"out/meta.json is missing.*trainer.prepare"):
        TokenDataset.open(out)


def test_windows_are_contiguous_and_labels_are_inputs_shifted(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, 1001)
    stream = SampleStream(ds, "train", seq_length=10, seed=0, shuffle=False)
    assert stream.num_samples_per_epoch == 100  # (1001 - 1) // 10
    batch = stream.get(range(100))
    assert batch.shape == (100, 11) and batch.dtype == np.int64
    tokens = ds.tokens[:1000].astype(np.int64)
    assert np.array_equal(batch[:, :-1].reshape(-1), tokens)
    assert np.array_equal(batch[:-1, -1], batch[1:, 0])  # a window's last token is the next's first
    inputs, labels = batch[:, :-1], batch[:, 1:]
    assert np.array_equal(labels[:, :-1], inputs[:, 1:])


def test_each_epoch_is_a_permutation_and_the_seed_fixes_the_order(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, 2001)
    stream = SampleStream(ds, "train", seq_length=20, seed=7, shuffle=True)
    n = stream.num_samples_per_epoch
    every = SampleStream(ds, "train", seq_length=20, seed=7, shuffle=False).get(range(n))
    epochs = [stream.get(range(e * n, (e + 1) * n)) for e in range(3)]
    for batch in epochs:  # every sample exactly once per epoch
        assert sorted(map(tuple, batch.tolist())) == sorted(map(tuple, every.tolist()))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[0], every)
    again = SampleStream(ds, "train", seq_length=20, seed=7, shuffle=True)
    assert np.array_equal(again.get(range(3 * n)), np.concatenate(epochs))
    other = SampleStream(ds, "train", seq_length=20, seed=8, shuffle=True)
    assert not np.array_equal(other.get(range(n)), epochs[0])


def test_get_equals_slices_of_the_full_enumeration(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, 3001)
    stream = SampleStream(ds, "train", seq_length=30, seed=3, shuffle=True)
    n = stream.num_samples_per_epoch
    full = SampleStream(ds, "train", seq_length=30, seed=3, shuffle=True).get(range(4 * n))
    rng = np.random.default_rng(0)
    for indices in ([0], [4 * n - 1], list(range(n - 5, n + 5)),  # across an epoch boundary
                    [3 * n + 2, 1, 2 * n, 1], rng.integers(0, 4 * n, size=50).tolist(), []):
        assert np.array_equal(stream.get(indices), full[indices].reshape(-1, 31))
    # What the trainer does: the global batch of step s, each rank taking its own share.
    gbs = 16
    for step in range(2 * n // gbs + 2):
        rank_share = [stream.get(range(step * gbs + r, (step + 1) * gbs, 4)) for r in range(4)]
        assert np.array_equal(np.stack(rank_share, 1).reshape(gbs, -1),
                              full[step * gbs:(step + 1) * gbs])
    with pytest.raises(ValueError, match="must be >= 0"):
        stream.get([-1])


def test_train_and_valid_never_overlap(src: Path, tmp_path: Path) -> None:
    ds = TokenDataset.open(prepare(src, tmp_path / "out", valid_fraction=0.4))
    ends = {}
    for split in ("train", "valid"):
        stream = SampleStream(ds, split, seq_length=4, seed=1, shuffle=True)
        starts = stream.start + stream.epoch_order(0) * 4
        ends[split] = (starts.min(), starts.max() + 5)  # token range the split's samples read
    assert ends["train"][1] <= ds.split("valid")[0] <= ends["valid"][0]
    assert ends["valid"][1] <= ds.num_tokens


def test_stream_errors_name_the_split_and_the_fix(tmp_path: Path) -> None:
    ds = make_dataset(tmp_path, 1000, valid_fraction=0.01)
    with pytest.raises(ValueError, match=r"valid split .* has 10 tokens.*seq_length=16"):
        SampleStream(ds, "valid", seq_length=16, seed=0, shuffle=False)
    with pytest.raises(ValueError, match="split='test' is unknown"):
        SampleStream(ds, "test", seq_length=16, seed=0, shuffle=False)
    with pytest.raises(ValueError, match=r"seed=-1 must be in"):
        SampleStream(ds, "train", seq_length=16, seed=-1, shuffle=True)


def test_builtin_corpus_is_prepared_once(tmp_path: Path, monkeypatch) -> None:
    out = builtin_corpus(tmp_path / "cache", valid_fraction=0.01)
    assert out.parent == tmp_path / "cache" and out.name.startswith("builtin-stdlib-py3")
    ds = TokenDataset.open(out)
    assert ds.num_tokens > 1_000_000 and ds.num_documents("valid") >= 1
    valid = ds.split("valid")
    assert 0.01 <= (valid[1] - valid[0]) / ds.num_tokens < 0.2
    assert b"def " in bytes(ds.tokens[:200_000])
    assert not any(s.endswith(("site-packages", "idlelib")) or "/test/" in s
                   for s in ds.meta["sources"])

    def no_prepare(*args, **kwargs):
        raise AssertionError("the built-in corpus was prepared again")

    monkeypatch.setattr(data, "prepare", no_prepare)
    assert builtin_corpus(tmp_path / "cache", valid_fraction=0.01) == out
    assert sorted(os.listdir(tmp_path / "cache")) == [out.name]


def test_the_command_line_prints_what_it_wrote(src: Path, tmp_path: Path, capsys) -> None:
    from trainer.prepare import main

    main([str(src), str(tmp_path / "out"), "--valid-fraction", "0.2"])
    printed = capsys.readouterr().out
    assert "tokens.bin (71 bytes, uint8)" in printed and "4 documents" in printed
    assert "valid: tokens [55, 71) = 16 tokens, 1 documents" in printed
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "missing"), str(tmp_path / "out2")])
    assert exit_.value.code == 2 and "missing does not exist" in capsys.readouterr().err
