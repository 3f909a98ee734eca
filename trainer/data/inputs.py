"""What trainer.prepare reads, as documents with where each came from.

    text files          one document a file (a folder: every text file under it)
    .jsonl, .jsonl.gz,  one document a line: the --json-key field (Megatron's preprocess_data
    .jsonl.zst          flag; default "text"), or with --chat its "messages"
    .parquet            one document a row: the --json-key column (a folder of them: every
                        .parquet under it, sorted)

A problem is one line naming the file and the line (or row): a malformed line, a missing key,
a value of the wrong type, an empty JSON-lines or Parquet file, a binary file named as text.
Reading is streamed (a file is never read whole), and `done` reports the bytes of the sources
read so far, for the progress line.
"""
from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator


def looks_like_text(path: Path) -> bool:
    """git's test: a file is binary when its first 8000 bytes hold a NUL byte."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(8000)


def find_files(folder: Path, suffix: str = "", skip_dirs: frozenset = frozenset()) -> list[Path]:
    """Files under folder, sorted by path; hidden entries, skip_dirs and symlinked folders are
    left out (os.walk does not follow links, so a link loop cannot hang it)."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in skip_dirs and not d.startswith(".")]
        found += [Path(root, f) for f in files if f.endswith(suffix) and not f.startswith(".")]
    return sorted(found, key=lambda p: p.parts)


JSON_LINES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET = ".parquet"


@dataclass
class Document:
    value: Any  # the text (str or bytes), or a chat's messages (a list of dicts)
    where: str  # "file:line" or "file:row N", for errors


def kind(path: Path) -> str:
    """"jsonl", "parquet" or "text", by the file's name."""
    name = path.name.lower()
    if name.endswith(JSON_LINES):
        return "jsonl"
    return "parquet" if name.endswith(PARQUET) else "text"


def collect(sources: list[Path]) -> list[Path]:
    """Every named file, and every file under each named folder that is JSON lines, Parquet or
    text, sorted by path. A named file that is none of them (binary) is one line."""
    files = set()
    for src in sources:
        if src.is_dir():
            files |= {p for p in find_files(src) if kind(p) != "text" or looks_like_text(p)}
        elif src.is_file():
            if kind(src) == "text" and not looks_like_text(src):
                raise ValueError(f"{src} is not a text file (it holds a NUL byte), nor JSON lines "
                                 f"({', '.join(JSON_LINES)}) or Parquet ({PARQUET}) by its name; "
                                 f"remove it from the sources")
            files.add(src)
        else:
            raise ValueError(f"source {src} does not exist; pass text, JSON-lines or Parquet "
                             f"files, or folders of them")
    if not files:
        raise ValueError(f"no text, JSON-lines or Parquet files found in "
                         f"{', '.join(map(str, sources))}")
    return sorted(files, key=lambda p: p.parts)


class Reader:
    """The documents of `files` in order; `done`: source bytes read so far."""

    def __init__(self, files: list[Path], json_key: str = "text", chat: bool = False):
        self.files, self.json_key, self.chat = files, json_key, chat
        self.total = sum(f.stat().st_size for f in files)
        self.done = self._file_base = 0

    def __iter__(self) -> Iterator[Document]:
        for path in self.files:
            before = self._file_base = self.done
            if kind(path) == "text":
                if self.chat:
                    raise ValueError(f"{path}: --chat reads JSON lines of {{\"messages\": "
                                     f"[...]}}, not text files; pass .jsonl files")
                self.done += path.stat().st_size
                yield Document(path.read_bytes(), str(path))
            elif kind(path) == "jsonl":
                yield from self._json_lines(path)
            else:
                yield from self._parquet(path)
            self.done = before + path.stat().st_size

    def _json_lines(self, path: Path) -> Iterator[Document]:
        raw = open(path, "rb")
        try:
            stream = _decompressed(raw, path)
            count = 0
            for number, line in enumerate(io.TextIOWrapper(stream, encoding="utf-8",
                                                           errors="strict"), 1):
                self.done = self._file_base + raw.tell()
                if not line.strip():
                    continue
                count += 1
                yield Document(self._field(_parse(line, path, number), f"{path}:{number}"),
                               f"{path}:{number}")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start} of "
                             f"a line): JSON lines are UTF-8") from None
        except (OSError, EOFError) as error:  # a damaged gzip or zstd stream
            raise ValueError(f"{path}: cannot be decompressed ({error})") from None
        finally:
            raw.close()
        if count == 0:
            raise ValueError(f"{path} holds no JSON lines (an empty file); remove it from the "
                             f"sources")

    def _parquet(self, path: Path) -> Iterator[Document]:
        pq = _pyarrow_parquet()
        try:
            table = pq.ParquetFile(path)
        except Exception as error:  # noqa: BLE001  (pyarrow's own errors: one line)
            raise ValueError(f"{path}: not a readable Parquet file ({error})") from None
        names = table.schema_arrow.names
        key = "messages" if self.chat else self.json_key
        if key not in names:
            raise ValueError(f"{path}: no column {key!r} (its columns: {', '.join(names)}). Fix: "
                             f"--json-key COLUMN names the text column")
        rows, size = table.metadata.num_rows, path.stat().st_size
        if rows == 0:
            raise ValueError(f"{path} holds no rows (an empty file); remove it from the sources")
        base, row = self.done, 0
        for batch in table.iter_batches(columns=[key], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                where = f"{path}:row {row}"
                yield Document(self._field({key: value}, where), where)
            self.done = base + size * row // rows

    def _field(self, record: Any, where: str) -> Any:
        key = "messages" if self.chat else self.json_key
        if not isinstance(record, dict) or key not in record:
            found = (f"keys {', '.join(map(repr, record))}" if isinstance(record, dict)
                     else f"a JSON {type(record).__name__}")
            fix = ("each line must be {\"messages\": [{\"role\": ..., \"content\": ...}, ...]}"
                   if self.chat else "--json-key KEY names the text field")
            raise ValueError(f"{where}: no key {key!r} ({found}). Fix: {fix}")
        value = record[key]
        if self.chat:
            return _messages(value, where)
        if not isinstance(value, str):
            raise ValueError(f"{where}: {key!r} is a {type(value).__name__}, not text")
        return value


def _parse(line: str, path: Path, number: int) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{number}: not a JSON line ({error.msg} at column "
                         f"{error.colno})") from None


def _messages(value: Any, where: str) -> list[dict]:
    """A chat's messages, checked: a non-empty list of {"role": str, "content": str}."""
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)
    if not ok:
        raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., "
                         f"\"content\": ...}} (strings)")
    return value


def _decompressed(raw, path: Path):
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ValueError(f"{path}: reading .zst needs the zstandard package. Fix: pip install "
                             f"'gtp-trainer[data]'") from None
        return zstandard.ZstdDecompressor().stream_reader(raw)
    return raw


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("reading Parquet needs pyarrow. Fix: pip install "
                         "'gtp-trainer[data]'") from None
    return pq
