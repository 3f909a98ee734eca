"""The containers trainer.prepare opens: a compressed file (.gz, .bz2, .xz, .zst) as the stream
of its bytes, and a JSON array read one element at a time (a file is never read whole). What a
record means, and every message about it, is trainer.data.inputs'.
"""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path
from typing import Any, Iterator, TextIO

COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


def compression(path: Path) -> str:
    """The compression suffix of the file's name (".gz", ...), or ""."""
    name = path.name.lower()
    return next((suffix for suffix in COMPRESSED if name.endswith(suffix)), "")


def decompressed(raw, path: Path):
    """The file object `raw` decompressed as its name says (raw itself when it is not)."""
    suffix = compression(path)
    if suffix == ".gz":
        return gzip.GzipFile(fileobj=raw)
    if suffix == ".bz2":
        return bz2.BZ2File(raw)
    if suffix == ".xz":
        return lzma.LZMAFile(raw)
    if suffix == ".zst":
        return _zstandard(path).ZstdDecompressor().stream_reader(raw)
    return raw


def damaged_stream_errors(path: Path) -> tuple[type[BaseException], ...]:
    """What reading a damaged compressed stream raises: gzip and bz2 an OSError (or EOFError
    when it is cut short), xz an LZMAError, zstd a ZstdError."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, lzma.LZMAError)
    if compression(path) == ".zst":
        errors += (_zstandard(path).ZstdError,)
    return errors


def _zstandard(path: Path):
    try:
        import zstandard
    except ImportError:
        raise ValueError(f"{path}: reading .zst needs the zstandard package. Fix: pip install "
                         f"'gtp-trainer[data]'") from None
    return zstandard


class ArrayError(ValueError):
    """A malformed JSON array: `line` and `column` (1-based) say where."""

    def __init__(self, message: str, line: int, column: int):
        super().__init__(message)
        self.line, self.column = line, column


CHUNK = 1 << 20
# A decode error this close to the end of what was read may only mean the element goes on in
# the next chunk (a cut literal, number or escape): read more before calling it malformed.
TAIL = 16


def array_elements(text: TextIO, head: str) -> Iterator[Any]:
    """The elements of the JSON array that `head` (text already read, from the array's "[")
    and then `text` hold, each decoded as soon as it is complete."""
    return _Array(text, head).elements()


class _Array:
    """A window `buf` on the text: what is decoded is forgotten, keeping the line and column
    of buf[0] for messages. The window grows by at least its own size on each read, so an
    element of any length costs linear time."""

    def __init__(self, text: TextIO, head: str):
        self.text, self.buf, self.eof = text, head, False
        self.line, self.column = 1, 0  # of buf[0]: line 1-based, column 0-based

    def elements(self) -> Iterator[Any]:
        decoder, count = json.JSONDecoder(), 0
        pos = self.skip_space(self.buf.index("[") + 1)
        while True:
            if pos < len(self.buf) and self.buf[pos] == "]":
                after = self.skip_space(pos + 1)
                if after < len(self.buf):
                    self.fail("more data after the array's closing ]", after)
                return
            if count:
                if pos >= len(self.buf) or self.buf[pos] != ",":
                    self.fail("expected , or ] after an element" if pos < len(self.buf)
                              else "the array is not closed (no ])", pos)
                pos = self.skip_space(pos + 1)
            value, end = self.decode(decoder, pos)
            yield value
            count += 1
            pos = self.skip_space(end)
            if pos > CHUNK:
                pos = self.forget(pos)

    def decode(self, decoder: json.JSONDecoder, pos: int) -> tuple[Any, int]:
        """The element at pos and where it ends. It is complete once a "," or "]" follows: a
        number cut by the end of the window decodes as a shorter one ("12" of "12.5")."""
        end = -1
        while True:
            try:
                value, new_end = decoder.raw_decode(self.buf, pos)
            except json.JSONDecodeError as error:
                cut = (error.pos >= len(self.buf) - TAIL
                       or error.msg.startswith("Unterminated string"))
                if not (cut and self.more()):
                    self.fail(error.msg, error.pos)
                continue
            if new_end == end:  # more text changed nothing: what follows is not JSON
                return value, end
            end = new_end
            after = self.skip_space(end)
            if after >= len(self.buf) or self.buf[after] in ",]" or not self.more():
                return value, end

    def more(self) -> bool:
        if self.eof:
            return False
        chunk = self.text.read(max(CHUNK, len(self.buf)))
        self.eof, self.buf = not chunk, self.buf + chunk
        return bool(chunk)

    def skip_space(self, pos: int) -> int:
        while True:
            while pos < len(self.buf) and self.buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(self.buf) or not self.more():
                return pos

    def forget(self, pos: int) -> int:
        """Drop buf[:pos]; the new position of pos (0)."""
        newline = self.buf.rfind("\n", 0, pos)
        self.line += self.buf.count("\n", 0, pos)
        self.column = pos - newline - 1 if newline >= 0 else self.column + pos
        self.buf = self.buf[pos:]
        return 0

    def fail(self, message: str, pos: int):
        newline = self.buf.rfind("\n", 0, pos)
        column = pos - newline if newline >= 0 else self.column + pos + 1
        raise ArrayError(message, self.line + self.buf.count("\n", 0, pos), column)
