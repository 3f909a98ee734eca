"""Megatron-LM's indexed dataset (PREFIX.bin + PREFIX.idx, version 1), read memory-mapped as it
is, with its document boundaries, as a TokenDataset (no conversion, no copy); and written from
one of our prepared datasets (python -m trainer.prepare --megatron PREFIX), one sequence per
document, so the same tokens feed Megatron-LM too.

PREFIX.idx, little-endian: the magic b"MMIDIDX\\x00\\x00", u64 version 1, u8 dtype code, u64
number of sequences S, u64 length of the document index D (documents + 1), then S x i32
sequence lengths, S x i64 byte offsets of the sequences in PREFIX.bin, D x i64 document
index (the sequence each document starts at; the last entry is S). PREFIX.bin holds the
tokens of the sequences back to back. The valid split is the last documents, as for our own
datasets (data.valid_fraction); the fingerprint is the .idx's digest and the .bin's size.
"""
from __future__ import annotations

import hashlib
import os
import struct
import uuid
from pathlib import Path

import numpy as np

from trainer.checks import check_writable
from trainer.data.dataset import FORMAT_VERSION, TokenDataset, split_point

MAGIC = b"MMIDIDX\x00\x00"
HEADER = len(MAGIC) + 8 + 1 + 8 + 8
TOKEN_DTYPES = {1: "<u1", 2: "<i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}  # 6, 7: floats
# What our token dtypes are written as: Megatron has no unsigned 32-bit code (it stores large
# vocabularies as int32), so uint32 ids, all below 2**31 in practice, become int32.
WRITE_CODES = {"uint8": 1, "uint16": 8, "uint32": 4, "int32": 4}


def is_indexed(path: Path | str) -> bool:
    """Whether `path` names a Megatron prefix (PREFIX.idx exists)."""
    return Path(f"{path}.idx").is_file()


def open_indexed(prefix: Path | str, valid_fraction: float) -> TokenDataset:
    """The dataset PREFIX.bin + PREFIX.idx; a ValueError names the file and what is wrong."""
    idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    if raw.size < HEADER or bytes(raw[:len(MAGIC)]) != MAGIC:
        raise ValueError(f"{idx_path} is not a Megatron index (its first bytes are not "
                         f"{MAGIC!r})")
    version = int(np.frombuffer(raw, "<u8", 1, len(MAGIC))[0])
    code = int(raw[len(MAGIC) + 8])
    count, doc_count = (int(v) for v in np.frombuffer(raw, "<u8", 2, len(MAGIC) + 9))
    if version != 1:
        raise ValueError(f"{idx_path} is a version {version} Megatron index; this trainer reads "
                         f"version 1")
    if code not in TOKEN_DTYPES:
        raise ValueError(f"{idx_path} has dtype code {code}: not an integer token type (one of "
                         f"{sorted(TOKEN_DTYPES)})")
    want = HEADER + 4 * count + 8 * count + 8 * doc_count
    if raw.size < want or doc_count < 2:
        raise ValueError(f"{idx_path} is truncated: {raw.size} bytes for {count} sequences and "
                         f"{doc_count} document index entries ({want} bytes)")
    lengths = np.frombuffer(raw, "<i4", count, HEADER).astype(np.int64)
    pointers = np.frombuffer(raw, "<i8", count, HEADER + 4 * count)
    documents = np.frombuffer(raw, "<i8", doc_count, HEADER + 12 * count)
    dtype = np.dtype(TOKEN_DTYPES[code])
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))  # token offset of each sequence
    if not np.array_equal(pointers, starts * dtype.itemsize):
        raise ValueError(f"{idx_path}: its sequences are not back to back in {bin_path.name} "
                         f"(byte offsets differ from the running sum of lengths)")
    if documents[0] != 0 or documents[-1] != count or (np.diff(documents) <= 0).any():
        raise ValueError(f"{idx_path}: its document index is not increasing from 0 to {count}")
    num_tokens = int(lengths.sum())
    size = bin_path.stat().st_size if bin_path.is_file() else None
    if size is None or size < num_tokens * dtype.itemsize:
        what = "is missing" if size is None else f"has {size} bytes"
        raise ValueError(f"{bin_path} {what}; {idx_path.name} describes {num_tokens} tokens of "
                         f"{dtype.name} ({num_tokens * dtype.itemsize} bytes)")
    doc_starts = starts[documents[:-1]].tolist()
    valid = split_point(doc_starts, num_tokens, valid_fraction)
    digest = hashlib.sha256(raw.tobytes()).hexdigest()
    meta = {"format_version": FORMAT_VERSION, "tokenizer": "megatron (unknown)",
            "vocab_size": None, "dtype": dtype.name, "num_tokens": num_tokens,
            "doc_starts": doc_starts, "splits": {"train": [0, valid], "valid": [valid, num_tokens]},
            "fingerprint": f"megatron:sha256:{digest}:bin{size}"}
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,))
    return TokenDataset(Path(prefix), meta, tokens)


def check_new_prefix(prefix: Path | str) -> None:
    """Before anything is prepared: PREFIX.bin and PREFIX.idx do not exist (a dataset is never
    overwritten) and their folder can be made and written."""
    for path in (f"{prefix}.bin", f"{prefix}.idx"):
        if os.path.lexists(path):
            raise ValueError(f"--megatron {prefix}: {path} already exists. Fix: choose another "
                             f"PREFIX, or remove {prefix}.bin and {prefix}.idx first.")
    check_writable("--megatron", prefix, Path(prefix).parent, "PREFIX.bin and PREFIX.idx go")


def write_indexed(dataset: TokenDataset, prefix: Path | str) -> tuple[Path, Path]:
    """PREFIX.bin and PREFIX.idx holding `dataset`'s tokens, one sequence per document. Both
    are written under temporary names unique to this call and moved into place at the end, the
    .idx last: a crash never leaves part of a dataset under the final names, and two writers of
    one PREFIX never mix (the second is refused)."""
    code = WRITE_CODES[dataset.tokens.dtype.name]
    dtype = np.dtype(TOKEN_DTYPES[code])
    if dataset.tokens.size and int(dataset.tokens.max()) > np.iinfo(dtype).max:
        raise ValueError(f"{dataset.path}: token ids above {np.iinfo(dtype).max} do not fit "
                         f"Megatron's {dtype.name}")
    starts = np.asarray(dataset.meta["doc_starts"], dtype=np.int64)
    lengths = np.diff(np.append(starts, dataset.num_tokens))
    if (lengths > np.iinfo(np.int32).max).any():
        raise ValueError(f"{dataset.path}: a document longer than 2**31 tokens does not fit the "
                         f"index's int32 lengths")
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    bin_tmp, idx_tmp = (p.with_name(f".{p.name}{tag}") for p in (bin_path, idx_path))
    try:
        with open(bin_tmp, "wb") as f:
            block = 1 << 24
            for i in range(0, dataset.num_tokens, block):
                f.write(np.asarray(dataset.tokens[i:i + block], dtype=dtype).tobytes())
            f.flush()
            os.fsync(f.fileno())
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", 1, code, len(starts), len(starts) + 1))
            f.write(lengths.astype("<i4").tobytes())
            f.write((starts * dtype.itemsize).astype("<i8").tobytes())
            f.write(np.arange(len(starts) + 1, dtype="<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        _place(bin_tmp, bin_path)
        try:
            _place(idx_tmp, idx_path)  # last: a prefix with an .idx is complete
        except BaseException:
            bin_path.unlink(missing_ok=True)  # ours, placed just now; no .idx will describe it
            raise
    finally:
        bin_tmp.unlink(missing_ok=True)
        idx_tmp.unlink(missing_ok=True)
    return bin_path, idx_path


def _place(tmp: Path, final: Path) -> None:
    """tmp moved to final, never over an existing file: a hard link fails, in one step, where
    final exists (a rename would replace another writer's file)."""
    appeared = ValueError(f"{final} appeared while this dataset was written (another prepare "
                          f"--megatron of the same PREFIX?) and was left as it is. Fix: choose "
                          f"another --megatron PREFIX.")
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise appeared from None
    except OSError:  # a file system without hard links: look, then rename
        if os.path.lexists(final):
            raise appeared from None
        os.rename(tmp, final)
    tmp.unlink(missing_ok=True)


SCAN_TOKENS, SCAN_BLOCK = 1 << 26, 1 << 20  # what the start-time vocabulary check reads


def largest_token(dataset: TokenDataset, budget: int = SCAN_TOKENS,
                  block: int = SCAN_BLOCK) -> tuple[int, bool]:
    """(the largest token id read, whether every token was read). A Megatron index does not
    record its vocabulary: a dataset of up to `budget` tokens is read whole; a larger one (a
    2 TB .bin would take an hour) in `budget / block` blocks spread evenly over it, and the
    sample stream checks the rest as it reads them (SampleStream's max_id)."""
    tokens, n = dataset.tokens, dataset.tokens.size
    if n <= budget:
        starts = range(0, n, block)
    else:
        count = max(budget // block, 1)
        starts = (i * (n - block) // max(count - 1, 1) for i in range(count))
    return max(int(tokens[s:s + block].max()) for s in starts), n <= budget
