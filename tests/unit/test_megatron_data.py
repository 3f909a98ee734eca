"""Megatron-LM indexed datasets (PREFIX.bin + PREFIX.idx) as data.path: read as written, with
document boundaries, by the sample stream; bad files are one line naming the file.

The files are written here by `write_indexed`, straight from the published format (Megatron-LM
megatron/core/datasets/indexed_dataset.py: _IndexWriter), independently of the reader."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from trainer.compose.runspec import settle
from trainer.config import ConfigError
from trainer.data.megatron import open_indexed
from trainer.data.stream import SampleStream

from config_helpers import compose_config

CODES = {np.uint8: 1, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_indexed(prefix: Path, documents: list[list[list[int]]], dtype=np.uint16,
                  version: int = 1, code: int | None = None) -> None:
    """documents: each a list of sequences of token ids."""
    sequences = [np.asarray(seq, dtype=dtype) for doc in documents for seq in doc]
    Path(f"{prefix}.bin").write_bytes(b"".join(s.tobytes() for s in sequences))
    lengths = [len(s) for s in sequences]
    pointers = np.concatenate(([0], np.cumsum(lengths)[:-1])) * np.dtype(dtype).itemsize
    doc_index = np.cumsum([0] + [len(doc) for doc in documents])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", version))
        f.write(struct.pack("<B", CODES[dtype] if code is None else code))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(np.asarray(lengths, dtype="<i4").tobytes())
        f.write(np.asarray(pointers, dtype="<i8").tobytes())
        f.write(np.asarray(doc_index, dtype="<i8").tobytes())


def corpus(seed: int = 0) -> list[list[list[int]]]:
    """40 documents of 1-3 sequences of 20-60 tokens below 200."""
    gen = np.random.default_rng(seed)
    return [[gen.integers(0, 200, gen.integers(20, 60)).tolist()
             for _ in range(gen.integers(1, 4))] for _ in range(40)]


@pytest.mark.parametrize("dtype", list(CODES), ids=lambda d: np.dtype(d).name)
def test_tokens_and_documents_read_as_written(dtype, tmp_path):
    docs = corpus()
    write_indexed(tmp_path / "text_document", docs, dtype)
    dataset = open_indexed(tmp_path / "text_document", valid_fraction=0.1)
    flat = [t for doc in docs for seq in doc for t in seq]
    assert dataset.tokens.dtype == np.dtype(dtype)
    assert dataset.tokens.tolist() == flat
    doc_lengths = [sum(len(seq) for seq in doc) for doc in docs]
    assert dataset.meta["doc_starts"] == np.concatenate(([0], np.cumsum(doc_lengths)[:-1])).tolist()
    start, end = dataset.split("valid")
    assert end == len(flat) and start in dataset.meta["doc_starts"]
    assert 0.1 * len(flat) <= end - start < 0.1 * len(flat) + max(doc_lengths)
    stream = SampleStream(dataset, "train", 16, seed=0, shuffle=False)
    assert stream.get([0, 3]).tolist() == [flat[0:17], flat[48:65]]


def test_a_run_reads_a_megatron_prefix_and_checks_its_ids(tmp_path):
    write_indexed(tmp_path / "ok", corpus())
    spec = settle(compose_config("model=tiny", f"data.path={tmp_path / 'ok'}",
                                 "train.seq_length=32", "data.valid_fraction=0.3",
                                 "train.eval_samples=8"))
    spec.data.prepare(spec.config.train)  # ids below 200 fit model=tiny's 256
    assert spec.data.open().num_tokens == sum(len(s) for d in corpus() for s in d)
    write_indexed(tmp_path / "wide", [[[5, 300] * 600]])
    wide = settle(compose_config("model=tiny", f"data.path={tmp_path / 'wide'}",
                                 "train.seq_length=32", "train.eval_interval=null"))
    with pytest.raises(ValueError, match=r"holds token id 300, but model.vocab_size=256. Fix"):
        wide.data.prepare(wide.config.train)


def damaged(tmp_path: Path, how: str) -> Path:
    prefix = tmp_path / how
    if how == "version":
        write_indexed(prefix, corpus(), version=2)
    elif how == "float":
        write_indexed(prefix, corpus(), code=6)
    else:
        write_indexed(prefix, corpus())
    if how == "magic":
        data = Path(f"{prefix}.idx").read_bytes()
        Path(f"{prefix}.idx").write_bytes(b"NOTANIDX\x00" + data[9:])
    if how == "truncated_bin":
        data = Path(f"{prefix}.bin").read_bytes()
        Path(f"{prefix}.bin").write_bytes(data[:len(data) // 2])
    if how == "truncated_idx":
        data = Path(f"{prefix}.idx").read_bytes()
        Path(f"{prefix}.idx").write_bytes(data[:100])
    return prefix


@pytest.mark.parametrize("how, named", [
    ("magic", ".idx is not a Megatron index"), ("version", "version 2 Megatron index"),
    ("float", "dtype code 6"), ("truncated_idx", ".idx is truncated"),
    ("truncated_bin", ".bin has"),
])
def test_a_damaged_dataset_is_one_line_naming_the_file(how, named, tmp_path):
    prefix = damaged(tmp_path, how)
    with pytest.raises(ConfigError) as error:
        settle(compose_config("model=tiny", f"data.path={prefix}", "train.seq_length=32"))
    message = str(error.value)
    assert "\n" not in message and named in message and str(tmp_path) in message
    assert message.startswith(f"data.path={prefix}") and "Fix:" in message


def test_launch_trains_on_a_megatron_prefix(tmp_path):
    import subprocess
    import sys

    from config_helpers import ROOT

    write_indexed(tmp_path / "text_document", corpus(1) * 4)
    proc = subprocess.run(
        [sys.executable, "launch.py", "model=tiny", f"data.path={tmp_path / 'text_document'}",
         "train.seq_length=32", "train.train_samples=64", "train.eval_interval=4",
         "data.valid_fraction=0.1",
         "train.eval_samples=8", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step      8/8" in proc.stdout and "eval at step 8" in proc.stdout
    assert (tmp_path / "run" / "checkpoints" / "step_00000008").is_dir()


def test_our_writer_writes_the_format_as_the_independent_writer_does(tmp_path):
    """trainer.prepare --megatron: byte for byte what this file's writer (the published
    format) writes for the same documents, one sequence each, and read back as prepared."""
    from trainer.data.dataset import TokenDataset, prepare
    from trainer.data.megatron import write_indexed as ours

    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(["first document", "second, longer document", "3"]):
        (src / f"{i}.txt").write_text(text)
    dataset = TokenDataset.open(prepare(src, tmp_path / "ds", 0.0))
    ours(dataset, tmp_path / "ours_text_document")
    starts = dataset.meta["doc_starts"] + [dataset.num_tokens]
    tokens = dataset.tokens.tolist()
    assert dataset.tokens.dtype == np.uint8  # bytes: Megatron's code 1
    write_indexed(tmp_path / "theirs", [[tokens[a:b]] for a, b in zip(starts, starts[1:])],
                  np.uint8)
    for suffix in (".bin", ".idx"):
        assert (Path(f"{tmp_path / 'ours_text_document'}{suffix}").read_bytes()
                == Path(f"{tmp_path / 'theirs'}{suffix}").read_bytes())
    back = open_indexed(tmp_path / "ours_text_document", 0.0)
    assert back.tokens.tolist() == tokens and back.meta["doc_starts"] == starts[:-1]


def test_a_large_dataset_is_sampled_before_the_run_and_every_sample_checked_as_read(tmp_path):
    """Reading a 2 TB .bin for its largest id would take an hour: past the budget only evenly
    spread blocks are read before the run, and the stream refuses an out-of-vocabulary id in
    any sample it reads, in one line."""
    from trainer.data.megatron import largest_token

    tokens = np.arange(1600) % 200
    tokens[300] = 5000  # between the sampled blocks below
    write_indexed(tmp_path / "big", [[tokens.tolist()]])
    dataset = open_indexed(tmp_path / "big", 0.0)
    assert largest_token(dataset) == (5000, True)  # small: read whole
    largest, whole = largest_token(dataset, budget=64, block=16)  # blocks at 0, 528, 1056, 1584
    assert largest < 200 and not whole
    stream = SampleStream(dataset, "train", 32, 0, False, max_id=256)
    assert stream.get(range(5)).max() < 200  # samples before the bad one read fine
    with pytest.raises(ConfigError, match=r"sample 9 holds token id 5000, but "
                                          r"model.vocab_size=256"):
        stream.get(range(12))
    assert SampleStream(dataset, "train", 32, 0, False).get(range(12)).max() == 5000


def test_our_writer_moves_a_whole_dataset_into_place_or_nothing(tmp_path, monkeypatch):
    """--megatron PREFIX: written under unique temporary names, moved into place at the end
    (.idx last); a crash leaves nothing under the final names, and a second writer of the same
    PREFIX is refused without touching the first one's files."""
    import trainer.data.megatron as megatron
    from trainer.data.dataset import TokenDataset, prepare

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("some document")
    dataset = TokenDataset.open(prepare(src, tmp_path / "ds", 0.0))
    prefix = tmp_path / "meg" / "text"

    placed = megatron._place

    def crash_at_the_idx(tmp: Path, final: Path) -> None:
        if final.suffix == ".idx":
            raise OSError("disk gone")
        placed(tmp, final)

    monkeypatch.setattr(megatron, "_place", crash_at_the_idx)
    with pytest.raises(OSError, match="disk gone"):
        megatron.write_indexed(dataset, prefix)
    assert list(prefix.parent.iterdir()) == []  # neither file, nor a temporary one
    monkeypatch.undo()

    megatron.write_indexed(dataset, prefix)
    first = {p.name: p.read_bytes() for p in prefix.parent.iterdir()}
    assert sorted(first) == ["text.bin", "text.idx"]
    with pytest.raises(ValueError, match=r"text.bin appeared while this dataset was written .*"
                                         r"Fix:"):
        megatron.write_indexed(dataset, prefix)
    Path(f"{prefix}.bin").rename(tmp_path / "kept.bin")  # a writer that placed only an .idx
    with pytest.raises(ValueError, match=r"text.idx appeared"):
        megatron.write_indexed(dataset, prefix)
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["text.idx"]  # its .bin removed
    with pytest.raises(ValueError, match=r"text.idx already exists. Fix:"):
        megatron.check_new_prefix(prefix)
