"""What python -m trainer.prepare reads (trainer/data/inputs.py): JSON lines plain, gzip and
zstd, Parquet files and folders, text, mixed; the same documents give the same tokens whatever
the container. Bad input is one line naming the file and the line, and nothing is written."""
from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.data.dataset import TokenDataset, prepare

ROOT = Path(__file__).parents[2]
TEXTS = ["first document\n", "the second, with ünïcode", "3rd " * 50]


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    lines = "".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts))
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(lines.encode()))
    elif path.name.endswith(".zst"):
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    else:
        path.write_text(lines)
    return path


def write_parquet(path: Path, texts: list[str], key: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({key: texts, "n": list(range(len(texts)))}), path,
                   row_group_size=2)
    return path


def tokens_of(folder: Path) -> list[int]:
    return np.asarray(TokenDataset.open(folder).tokens).tolist()


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.jsonl.gz", "docs.jsonl.zst",
                                  "docs.parquet"])
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
