"""What python -m trainer.prepare reads (trainer/data/inputs.py): JSON lines and JSON arrays,
plain, gzip, bzip2, xz and zstd, Parquet files and folders, text, mixed; the same documents give
the same tokens whatever the container. Bad input (a malformed line or array, a damaged stream,
a lone surrogate, a file it cannot read named or in a folder, a prepared dataset among the
sources) is one line naming the file, and nothing is written."""
from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.data import containers
from trainer.data.dataset import TokenDataset, prepare
from trainer.prepare import main

ROOT = Path(__file__).parents[2]
TEXTS = ["first document\n", "the second, with ünïcode", "3rd " * 50]


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    """JSON lines; a name starting "array" is one JSON array (indented: "array_indented"), and
    a compression suffix compresses it."""
    records = [{key: t, "id": i} for i, t in enumerate(texts)]
    if path.name.startswith("array"):
        content = json.dumps(records, indent=1 if "indented" in path.name else None)
    else:
        content = "".join(json.dumps(r) + "\n" for r in records)
    path.write_bytes(compress(path, content.encode()))
    return path


def compress(path: Path, data: bytes) -> bytes:
    if path.name.endswith(".zst"):
        import zstandard

        return zstandard.ZstdCompressor().compress(data)
    squeeze = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}
    return squeeze.get(path.suffix, lambda d: d)(data)


def write_parquet(path: Path, texts: list[str], key: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({key: texts, "n": list(range(len(texts)))}), path,
                   row_group_size=2)
    return path


def tokens_of(folder: Path) -> list[int]:
    return np.asarray(TokenDataset.open(folder).tokens).tolist()


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.jsonl.gz", "docs.jsonl.zst",
                                  "docs.jsonl.bz2", "docs.jsonl.xz", "docs.json",
                                  "array.json", "array_indented.json", "array.json.bz2",
                                  "array.json.xz", "docs.parquet"])
def test_every_container_gives_the_documents_of_text_files(name, tmp_path):
    texts_dir = tmp_path / "texts"
    texts_dir.mkdir()
    for i, text in enumerate(TEXTS):
        (texts_dir / f"{i}.txt").write_text(text)
    want = prepare(texts_dir, tmp_path / "from_text", 0.0)
    src = tmp_path / name
    (write_parquet if name.endswith(".parquet") else write_jsonl)(src, TEXTS, "body")
    got = prepare(src, tmp_path / "from_json", 0.0, json_key="body")
    assert tokens_of(got) == tokens_of(want)
    assert TokenDataset.open(got).meta["doc_starts"] == TokenDataset.open(want).meta["doc_starts"]


def test_a_folder_of_parquet_and_json_lines_is_read_in_path_order(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_parquet(folder / "a.parquet", TEXTS[:2])
    write_jsonl(folder / "b.jsonl", TEXTS[2:])
    got = TokenDataset.open(prepare(folder, tmp_path / "out", 0.0))
    assert len(got.meta["doc_starts"]) == 3
    assert bytes(np.asarray(got.tokens, dtype=np.uint8)).decode() == "".join(TEXTS)


def run_prepare(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.prepare", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


BAD = {
    "malformed": ('{"text": "ok"}\n{"text": "broken\n', r"bad.jsonl:2: not a JSON line"),
    "missing_key": ('{"text": "ok"}\n{"body": "x"}\n',
                    r"bad.jsonl:2: no key 'text' \(keys 'body'\)"),
    "not_text": ('{"text": 5}\n', r"bad.jsonl:1: 'text' is a int, not text"),
    "empty": ("", r"bad.jsonl holds no JSON lines \(an empty file\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_json_lines_are_one_line_and_nothing_is_written(case, tmp_path):
    content, said = BAD[case]
    (tmp_path / "bad.jsonl").write_text(content)
    done = run_prepare(tmp_path / "bad.jsonl", tmp_path / "out")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert re.search(said, lines[0]), lines[0]
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [tmp_path / "bad.jsonl"]


def test_a_binary_file_a_missing_column_and_chat_without_messages_are_one_line(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2binary")
    done = run_prepare(tmp_path / "blob.bin", tmp_path / "out")
    assert done.returncode == 2 and "blob.bin is not a text file" in done.stderr
    write_parquet(tmp_path / "t.parquet", TEXTS)
    done = run_prepare(tmp_path / "t.parquet", tmp_path / "out", "--json-key", "content")
    assert done.returncode == 2 and "no column 'content' (its columns: text, n)" in done.stderr
    write_jsonl(tmp_path / "plain.jsonl", TEXTS)
    done = run_prepare(tmp_path / "plain.jsonl", tmp_path / "out", "--chat")
    assert done.returncode == 2 and "--chat renders each conversation" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("chunk", [1, 3, 64, 1 << 20])
def test_a_json_array_is_read_an_element_at_a_time_across_reads(chunk, monkeypatch):
    """Whatever the read size: every element as json.loads reads the whole text (numbers cut
    by a read too: "12" of "12.5" is no element), and a malformed array fails at its line."""
    monkeypatch.setattr(containers, "CHUNK", chunk)
    records = [{"text": "é\\\"x\U0001F600" * (i % 4), "n": i * 1234.5678e3, "l": [1, None, True]}
               for i in range(40)] + [12345678901234567890, 1.5e-300, "str", [], {}]
    for indent in (None, 1):
        text = json.dumps(records, indent=indent)
        stream = io.StringIO(text)
        assert list(containers.array_elements(stream, stream.readline())) == json.loads(text)
    for indent in (None, 1):  # where json itself says the first fault is
        bad = json.dumps(records, indent=indent).replace('"l"', '"l" x', 29)
        with pytest.raises(json.JSONDecodeError) as want:
            json.loads(bad)
        stream = io.StringIO(bad)
        with pytest.raises(containers.ArrayError, match=want.value.msg) as error:
            list(containers.array_elements(stream, stream.readline()))
        assert (error.value.line, error.value.column) == (want.value.lineno, want.value.colno)


def test_a_folder_of_json_lines_in_every_compression_is_read_whole(tmp_path):
    """The sweep's case: a .jsonl.bz2 beside .jsonl and .jsonl.gz was skipped (200 of 800)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = [f"record {i}\n" for i in range(200)]
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.bz2", "d.jsonl.xz"):
        write_jsonl(folder / name, texts)
    got = TokenDataset.open(prepare(folder, tmp_path / "out", 0.0))
    assert len(got.meta["doc_starts"]) == 800
    assert bytes(np.asarray(got.tokens, dtype=np.uint8)).decode() == "".join(texts) * 4


def refusal(capsys, *args) -> str:
    """prepare's one line: exit 2, a Fix, and the out folder (the last argument) not written."""
    with pytest.raises(SystemExit) as exit:
        main([str(a) for a in args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(lines) == 1 and "Fix:" in lines[0], lines
    assert not Path(args[-1]).exists()
    return lines[0]


def bpe_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


DAMAGED = {  # file name: (its bytes, what the line says)
    "bad.jsonl.zst": (b"\x28\xb5\x2f\xfd" + b"garbage" * 10, r"bad.jsonl.zst: cannot be decomp"),
    "bad.jsonl.bz2": (bz2.compress(b'{"text": "a"}\n' * 50)[:40], r"bad.jsonl.bz2: cannot be d"),
    "bad.json.xz": (b"\xfd7zXZ\x00 not xz", r"bad.json.xz: cannot be decompressed"),
    "bad.json": (b'[{"text": "a"},\n {"text": "b"} {"text": "c"}]',
                 r"bad.json:2: not a JSON array \(expected , or \] after an element at column 16"),
    "bad.txt.bz2": (bz2.compress(b"text"), r"bad.txt.bz2 is compressed \(.bz2\) but not JSON"),
    "surrogate.jsonl": (b'{"text": "ok"}\n{"text": "a \\ud800 b"}\n',
                        r"surrogate.jsonl:2: 'text' holds a lone surrogate '\\ud800'"),
}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_or_unreadable_file_is_one_line(name, tmp_path, capsys):
    content, said = DAMAGED[name]
    (tmp_path / name).write_bytes(content)
    # a BPE tokenizer: the lone surrogate was a traceback there (the byte one said no file)
    tokenizer = bpe_tokenizer(tmp_path / "tokenizer.json")
    line = refusal(capsys, "--tokenizer", tokenizer, tmp_path / name, tmp_path / "out")
    assert re.search(said, line), line


def test_a_folder_with_a_file_it_cannot_read_or_a_prepared_dataset_is_one_line(tmp_path,
                                                                             capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(TEXTS):
        (folder / f"{i}.txt").write_text(text)
    (folder / "notes.txt.gz").write_bytes(gzip.compress(b"compressed text"))
    line = refusal(capsys, folder, tmp_path / "out")
    assert f"{folder / 'notes.txt.gz'} (in the source folder {folder}) is compressed" in line
    (folder / "notes.txt.gz").rename(folder / "image.png")
    line = refusal(capsys, folder, tmp_path / "out")
    assert f"{folder / 'image.png'} (in the source folder {folder}) is not a text file" in line
    (folder / "image.png").unlink()
    # the sweep's case: an earlier prepare's output inside the folder was read back as text
    prepare(folder, folder / "prepared", 0.0)
    line = refusal(capsys, folder, tmp_path / "out")
    assert line.startswith(f"error: {folder / 'prepared'} is a dataset trainer.prepare wrote "
                           f"(tokens.bin, meta.json) inside the source folder {folder}: ")
    line = refusal(capsys, folder / "prepared", tmp_path / "out")
    assert f"data.path={folder / 'prepared'}" in line and "inside" not in line
