"""What trainer.prepare reads, as documents with where each came from.

    text files          one document a file
    .jsonl              one document a line: the --json-key field (Megatron's preprocess_data
                        flag; default "text"), or with --chat its "messages"
    .json               a JSON array of such records, one document each, or one record a line
    .parquet            one document a row: the --json-key column
    folders             every such file under them, sorted by path (hidden ones left out)

JSON and JSON lines may be compressed: .gz, .bz2, .xz, .zst (trainer.data.containers).
A file that is none of these (a binary file, or a compressed one that is not JSON), named or
found in a folder, is one line naming it, as is a folder that holds a prepared dataset (its
files would be read back as text); so are a malformed line or element, a missing key, a value
of the wrong type or with a lone surrogate escape, an empty file. Reading is streamed (a file
is never read whole), and `done` reports the bytes of the sources read so far, for the
progress line.
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from trainer.data.containers import (
    COMPRESSED,
    ArrayError,
    array_elements,
    compression,
    damaged_stream_errors,
    decompressed,
)


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


READ = ("text, JSON lines (.jsonl), JSON (.json), either compressed (" + ", ".join(COMPRESSED)
        + "), or Parquet (.parquet)")


@dataclass
class Document:
    value: Any  # the text (str or bytes), or a chat's messages (a list of dicts)
    where: str  # "file:line" or "file:row N", for errors


def kind(path: Path) -> str:
    """"jsonl", "json", "parquet" or "text" by the file's name; "compressed" for a compressed
    file that is not JSON, which is not read."""
    name = path.name.lower()
    base = name[:len(name) - len(compression(path))]
    if base.endswith(".jsonl"):
        return "jsonl"
    if base.endswith(".json"):
        return "json"
    if base != name:
        return "compressed"
    return "parquet" if name.endswith(".parquet") else "text"


def collect(sources: list[Path]) -> list[Path]:
    """Every named file, and every file under each named folder, sorted by path. A file that
    cannot be read, or a prepared dataset among the sources, is one line (unreadable())."""
    files = set()
    for src in sources:
        if src.is_dir():
            found = find_files(src)
            dataset = next((p.parent for p in found if p.name == "tokens.bin"
                            and (p.parent / "meta.json").is_file()), None)
            if dataset is not None:
                inside = "" if dataset == src else f" inside the source folder {src}"
                raise ValueError(
                    f"{dataset} is a dataset trainer.prepare wrote (tokens.bin, meta.json)"
                    f"{inside}: its files would be read back as text. Fix: pass the text it was "
                    f"prepared from{', or move it out of ' + str(src) if inside else ''} "
                    f"(launch.py reads it as it is: data.path={dataset})")
            for path in found:
                unreadable(path, src)
            files.update(found)
        elif src.is_file():
            unreadable(src, None)
            files.add(src)
        else:
            raise ValueError(f"source {src} does not exist. Fix: pass {READ} files, or folders "
                             f"of them")
    if not files:
        raise ValueError(f"no files found in {', '.join(map(str, sources))}. Fix: pass {READ} "
                         f"files, or folders of them")
    return sorted(files, key=lambda p: p.parts)


def unreadable(path: Path, folder: Path | None) -> None:
    """One line when `path` (named, or found in `folder`) is a file prepare cannot read."""
    where = f"{path} (in the source folder {folder})" if folder else str(path)
    remove = f"remove it from {folder}, or name the files to read" if folder else \
        "remove it from the sources"
    if kind(path) == "compressed":
        raise ValueError(f"{where} is compressed ({compression(path)}) but not JSON (.json or "
                         f".jsonl before the {compression(path)}), and prepare reads only JSON "
                         f"compressed. Fix: decompress it, or {remove}")
    if kind(path) == "text" and not looks_like_text(path):
        raise ValueError(f"{where} is not a text file (it holds a NUL byte), nor by its name "
                         f"JSON lines, JSON or Parquet. Fix: {remove}")


class Reader:
    """The documents of `files` in order; `done`: source bytes read so far."""

    def __init__(self, files: list[Path], json_key: str = "text", chat: bool = False,
                 preference: bool = False):
        """preference: each record a (prompt, chosen, rejected) pair
        (trainer.data.preference)."""
        self.files, self.json_key, self.chat = files, json_key, chat
        self.preference = preference
        self.total = sum(f.stat().st_size for f in files)
        self.done = self._file_base = 0

    def __iter__(self) -> Iterator[Document]:
        for path in self.files:
            before = self._file_base = self.done
            if kind(path) == "text":
                if self.preference:
                    raise ValueError(f"{path}: --preference reads JSON records of {{\"prompt\": "
                                     f"..., \"chosen\": ..., \"rejected\": ...}}, not text "
                                     f"files; pass .jsonl or .json files")
                if self.chat:
                    raise ValueError(f"{path}: --chat reads JSON records of {{\"messages\": "
                                     f"[...]}}, not text files; pass .jsonl or .json files")
                self.done += path.stat().st_size
                yield Document(path.read_bytes(), str(path))
            elif kind(path) in ("jsonl", "json"):
                yield from self._json(path)
            else:
                yield from self._parquet(path)
            self.done = before + path.stat().st_size

    def _json(self, path: Path) -> Iterator[Document]:
        """JSON lines, or (a .json file whose first character is "[") a JSON array."""
        raw = open(path, "rb")
        try:
            count = 0
            text = io.TextIOWrapper(decompressed(raw, path), encoding="utf-8", errors="strict")
            for where, record in self._records(path, text, raw):
                count += 1
                yield Document(self._field(record, where), where)
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start} of "
                             f"a line): JSON is UTF-8") from None
        except damaged_stream_errors(path) as error:
            raise ValueError(f"{path}: cannot be decompressed ({error}). Fix: check the file "
                             f"(it may be cut short or not {compression(path)}), or remove it "
                             f"from the sources") from None
        finally:
            raw.close()
        if count == 0:
            what = "JSON lines (an empty file)" if kind(path) == "jsonl" else \
                "records (an empty file or array)"
            raise ValueError(f"{path} holds no {what}. Fix: remove it from the sources")

    def _records(self, path: Path, text, raw) -> Iterator[tuple[str, Any]]:
        array = kind(path) == "json" or None  # a .json file may hold one array; .jsonl never
        for number, line in enumerate(text, 1):
            self.done = self._file_base + raw.tell()
            if not line.strip():
                continue
            if array and line.lstrip().startswith("["):
                try:
                    for i, record in enumerate(array_elements(text, line), 1):
                        self.done = self._file_base + raw.tell()
                        yield f"{path}:record {i}", record
                except ArrayError as error:
                    raise ValueError(f"{path}:{number + error.line - 1}: not a JSON array "
                                     f"({error} at column {error.column}). Fix: repair it "
                                     f"there, or remove the file from the sources") from None
                return
            yield f"{path}:{number}", _parse(line, path, number, array is not None)
            array = None  # JSON lines (in a .json file: the array would have come first)

    def _parquet(self, path: Path) -> Iterator[Document]:
        if self.preference:
            raise ValueError(f"{path}: --preference reads JSON lines (.jsonl) or JSON (.json) "
                             f"records of prompt, chosen and rejected, not Parquet")
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
        if self.preference:
            return pair_fields(record, where)
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
        return _unicode(value, where, key)


PAIR_FIELDS = ("prompt", "chosen", "rejected")  # a preference line (trainer.data.preference)


def pair_fields(record: Any, where: str) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of one line, checked: all text, or all chat messages."""
    if not isinstance(record, dict) or any(f not in record for f in PAIR_FIELDS):
        found = (f"keys {', '.join(map(repr, record))}" if isinstance(record, dict)
                 else f"a JSON {type(record).__name__}")
        missing = [f for f in PAIR_FIELDS if not isinstance(record, dict) or f not in record]
        raise ValueError(f"{where}: no {missing[0]!r} ({found}). Fix: each line of --preference "
                         f"data is {{\"prompt\": ..., \"chosen\": ..., \"rejected\": ...}}")
    values = [record[f] for f in PAIR_FIELDS]
    if all(isinstance(v, str) for v in values):
        return tuple(_unicode(v, where, f) for v, f in zip(values, PAIR_FIELDS))
    if all(isinstance(v, list) for v in values):
        return tuple(_messages(v, f"{where} ({f})") for v, f in zip(values, PAIR_FIELDS))
    kinds = ", ".join(f"{f} a {type(v).__name__}" for f, v in zip(PAIR_FIELDS, values))
    raise ValueError(f"{where}: {kinds}. Fix: three strings, or three lists of chat messages")


def _parse(line: str, path: Path, number: int, first_of_json: bool = False) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        how = (". Fix: a .json file is read as a JSON array of records, or as one record a "
               "line" if first_of_json else "")
        raise ValueError(f"{path}:{number}: not a JSON line ({error.msg} at column "
                         f"{error.colno}){how}") from None


def _messages(value: Any, where: str) -> list[dict]:
    """A chat's messages, checked: a non-empty list of {"role": str, "content": str}."""
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)
    if not ok:
        raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., "
                         f"\"content\": ...}} (strings)")
    for m in value:
        _unicode(m["role"], where, "role")
        _unicode(m["content"], where, "content")
    return value


def _unicode(text: str, where: str, key: str) -> str:
    """JSON's \\u escapes can write half a surrogate pair, which is no character: no tokenizer
    encodes it (one traceback deep in the encoder otherwise)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{where}: {key!r} holds a lone surrogate {text[error.start]!r} at "
                         f"character {error.start} (half of a \\u escape pair), which is no "
                         f"Unicode character. Fix: write the whole pair or the character "
                         f"itself, or drop that record") from None
    return text


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("reading Parquet needs pyarrow. Fix: pip install "
                         "'gtp-trainer[data]'") from None
    return pq
