"""Token datasets: prepare text into a flat memory-mapped token file and open it (checked).
Pure data code: no torch, no process groups, no layouts (the sample stream is data.stream).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import numpy as np

from trainer.data.inputs import Reader, collect, find_files
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer
from trainer.units import duration

FORMAT_VERSION = 1
DTYPES = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
META_KEYS = ("format_version", "tokenizer", "vocab_size", "dtype", "num_tokens", "doc_starts",
             "splits", "fingerprint")
BUILTIN_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})


TOKENIZERS = {"byte": ByteTokenizer()}
Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(name: str) -> Tokenizer:
    """"byte", or a tokenizer.json (or a folder holding one), as a checkpoint records it."""
    return TOKENIZERS[name] if name in TOKENIZERS else HFTokenizer.load(Path(name))


def decode(token_ids) -> str:
    """Text of byte-tokenizer ids (a list, array or tensor); undecodable bytes print as U+FFFD."""
    return TOKENIZERS["byte"].decode(token_ids)


def token_dtype(vocab_size: int) -> str:
    return next(name for name, dt in DTYPES.items() if vocab_size <= np.iinfo(dt).max + 1)


def split_point(doc_starts: list[int], num_tokens: int, valid_fraction: float) -> int:
    """First token of the valid split: whole documents from the end until they hold at least
    valid_fraction of the tokens. A single document is split by tokens instead."""
    if valid_fraction == 0:
        return num_tokens
    want = valid_fraction * num_tokens
    if len(doc_starts) == 1:
        start = num_tokens - int(np.ceil(want))
    else:
        start = next((s for s in reversed(doc_starts) if num_tokens - s >= want), 0)
    if start == 0:
        raise ValueError(f"valid_fraction={valid_fraction} leaves no training tokens out of "
                         f"{num_tokens} in {len(doc_starts)} documents; lower it")
    return start


def prepare(sources: list[Path] | Path, out_dir: Path, valid_fraction: float,
            tokenizer: str | Path = "byte", train_vocab_size: int | None = None,
            eod_token: str | None = None, progress: bool = False, json_key: str = "text",
            chat: bool = False, loss_on: str = "assistant", preference: bool = False) -> Path:
    """Tokenize the sources (trainer.data.inputs: text, JSON lines, Parquet) into out_dir
    (tokens.bin + meta.json), atomically.

    tokenizer: "byte", or a Hugging Face tokenizer.json (or a folder holding one); with
    train_vocab_size, a byte-level BPE of that size is trained on the sources first and kept as
    out_dir/tokenizer.json. chat: JSON lines of messages rendered with the tokenizer's chat
    template, plus loss_mask.bin (trainer.data.chat; loss_on "assistant" or "all").
    preference: JSON lines of prompt, chosen and rejected, two documents a pair with a loss
    mask on the responses (trainer.data.preference; chat messages need a chat template). The
    dataset is written into a hidden sibling folder and renamed into place, so out_dir either
    does not exist or is complete. If out_dir already holds a dataset (another process won the
    race, or an earlier run), it is kept when it is this same dataset; a different one is an
    error.
    """
    out_dir = Path(out_dir)
    sources = [Path(s) for s in ([sources] if isinstance(sources, (str, Path)) else sources)]
    if not 0 <= valid_fraction < 1:
        raise ValueError(f"valid_fraction={valid_fraction} must be in [0, 1)")
    if train_vocab_size is not None and not 256 < train_vocab_size <= 2**32:
        raise ValueError(f"--train-tokenizer {train_vocab_size}: a byte-level BPE needs a "
                         f"vocabulary above 256 (its bytes) and at most 2**32")
    if eod_token is not None and train_vocab_size is None and str(tokenizer) == "byte":
        raise ValueError(f"--eod-token {eod_token}: the byte tokenizer has no end-of-document "
                         f"token to choose (its 256 ids are the bytes; meta.json records where "
                         f"each document starts). Fix: leave --eod-token out, or use it with "
                         f"--tokenizer TOKENIZER_JSON or --train-tokenizer VOCAB_SIZE.")
    if chat and (train_vocab_size is not None or str(tokenizer) == "byte"):
        raise ValueError("--chat renders each conversation with the tokenizer's chat template: "
                         "pass --tokenizer with a folder holding tokenizer.json and "
                         "tokenizer_config.json (its chat_template)")
    files = collect(sources)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if train_vocab_size is not None:
            if progress:
                print(f"training a byte-level BPE of {train_vocab_size:,} tokens on "
                      f"{len(files)} file(s)", flush=True)
            texts = (d.value for d in Reader(files, json_key) if d.value)
            tok: Tokenizer = HFTokenizer.train(texts, train_vocab_size, tmp / "tokenizer.json",
                                               eod_token)
            if tok.vocab_size < train_vocab_size:  # the BPE trainer ran out of pairs to merge
                print(f"warning: --train-tokenizer {train_vocab_size}: the corpus supports only "
                      f"{tok.vocab_size} tokens (its 256 bytes, the end-of-document token and "
                      f"every merge the BPE trainer found), so the tokenizer has "
                      f"{tok.vocab_size}. For more, train on more text.", file=sys.stderr)
        elif str(tokenizer) in TOKENIZERS:
            tok = TOKENIZERS[str(tokenizer)]
        else:
            tok = HFTokenizer.load(Path(tokenizer), eod_token)
        encoder = None
        template = getattr(tok, "config", {}).get("chat_template")
        if chat or (preference and template):  # a pair of messages renders as --chat does
            from trainer.data.chat import ChatEncoder

            encoder = ChatEncoder(tok, loss_on)
        if preference:
            from trainer.data.preference import PairEncoder

            encoder = PairEncoder(tok, encoder)
        meta = write_dataset(Reader(files, json_key, chat and not preference, preference), tmp,
                             tok, valid_fraction, progress, encoder)
        meta["sources"] = [str(s) for s in sources]
        write_json(tmp / "meta.json", meta)
        try:
            os.rename(tmp, out_dir)  # atomic; fails when out_dir exists and is not empty
            return out_dir
        except OSError:
            if not out_dir.exists():
                raise
        existing = TokenDataset.open(out_dir).meta
        if any(existing[k] != meta[k] for k in META_KEYS):
            raise ValueError(f"{out_dir} already holds a different dataset (fingerprint "
                             f"{existing['fingerprint']}, this one {meta['fingerprint']}); "
                             "remove it or choose another out_dir")
        return out_dir
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


BATCH_BYTES = 8 << 20  # documents tokenized together: the batch encoder spreads them on cores
PROGRESS_BYTES = 32 << 20  # inputs at least this long show a progress line


def write_dataset(reader: Reader, folder: Path, tok: Tokenizer, valid_fraction: float,
                  progress: bool = False, chat=None) -> dict:
    """Write tokens.bin (and with a chat encoder loss_mask.bin) into folder; the meta.json
    fields that describe it."""
    from trainer.data.preference import PairEncoder, pair_starts

    preference = isinstance(chat, PairEncoder)
    dtype_name = token_dtype(tok.vocab_size)
    sha, mask_sha, doc_starts, num_tokens = hashlib.sha256(), hashlib.sha256(), [], 0
    started, counted = time.perf_counter(), 0
    if progress:
        print(f"tokenizing {len(reader.files)} file(s), {reader.total / 2**20:,.1f} MiB, with "
              f"{tok.name}", flush=True)  # stdout, with the result: stderr is for errors
    progress = progress and reader.total >= PROGRESS_BYTES  # then a line as it goes
    masks = open(folder / LOSS_MASK, "wb") if chat else None
    with open(folder / "tokens.bin", "wb") as f:
        for batch in _batches(reader):
            if preference:  # two documents a pair
                encoded = [doc for d in batch for doc in chat.encode(d.value, d.where)]
            elif chat is not None:
                encoded = [chat.encode(d.value, d.where) for d in batch]
            else:  # an empty document is none
                encoded = [(ids, None) for ids in tok.encode_documents(
                    [d.value for d in batch if d.value])]
            for ids, mask in encoded:
                ids = ids.astype(DTYPES[dtype_name], copy=False)
                doc_starts.append(num_tokens)
                num_tokens += ids.size
                sha.update(ids.tobytes())
                f.write(ids.tobytes())
                if mask is not None:
                    mask_sha.update(mask.tobytes())
                    masks.write(mask.tobytes())
                    counted += int(mask.sum())
            if progress:
                _show_progress(reader, num_tokens, started)
        f.flush()
        os.fsync(f.fileno())
    if masks is not None:
        masks.close()
    if progress:
        print(file=sys.stderr)
    if num_tokens == 0:
        raise ValueError(f"the sources ({len(reader.files)} files) hold no tokens: every "
                         f"document is empty")
    if chat is not None and counted == 0 and not preference:
        raise ValueError(f"--chat --loss-on {chat.loss_on}: not one token of the "
                         f"{len(doc_starts):,} conversations is a target (none has an "
                         f"assistant turn that {chat.source}'s chat template writes), so nothing "
                         f"would train. Fix: add the assistant's answers, or pass --loss-on all")
    # a pair's two documents stay in one split
    starts = [int(s) for s in pair_starts(np.asarray(doc_starts))] if preference else doc_starts
    if preference and len(starts) < 2 and valid_fraction > 0:
        raise ValueError(f"valid_fraction={valid_fraction}: one preference pair cannot be split "
                         f"between train and valid. Fix: --valid-fraction 0, or more pairs")
    start = split_point(starts, num_tokens, valid_fraction)
    meta = {"format_version": FORMAT_VERSION, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "eod_id": tok.eod_id, "dtype": dtype_name, "num_tokens": num_tokens,
            "doc_starts": doc_starts, "splits": {"train": [0, start], "valid": [start, num_tokens]},
            "fingerprint": f"sha256:{sha.hexdigest()}"}
    if preference:  # pair i: documents 2i and 2i + 1
        meta |= {"preference": True, "pairs": len(doc_starts) // 2}
    if chat is not None:  # the mask changes what trains: part of the identity
        meta |= {"loss_mask": True, "counted_tokens": counted,
                 "fingerprint": f"sha256:{sha.hexdigest()}+mask:{mask_sha.hexdigest()[:16]}"}
    return meta


def _show_progress(reader: Reader, num_tokens: int, started: float) -> None:
    elapsed = max(time.perf_counter() - started, 1e-9)
    share = reader.done / max(reader.total, 1)
    left = elapsed / max(share, 1e-9) * (1 - share)
    print(f"\rtokenized {share:4.0%} ({reader.done >> 20:,} of {reader.total >> 20:,} MiB), "
          f"{num_tokens / elapsed:,.0f} tokens/s, {duration(left)} left",
          end="", file=sys.stderr, flush=True)


def _batches(reader: Reader):
    """Documents in groups of about BATCH_BYTES of text."""
    batch, size = [], 0
    for document in reader:
        batch.append(document)
        size += _length(document.value)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _length(value) -> int:
    """Characters of a document: text, a chat's messages, or a preference pair of either."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, tuple):  # (prompt, chosen, rejected)
        return sum(_length(v) for v in value)
    return sum(len(m["content"]) for m in value)


def write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def builtin_location(cache_dir: Path | None, valid_fraction: float) -> Path:
    """Where the built-in corpus is (or will be) prepared: keyed by the Python minor version."""
    root = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "gtp-trainer"
    v = sys.version_info
    return root / f"builtin-stdlib-py{v.major}{v.minor}-{float(valid_fraction)!r}"


def builtin_corpus(cache_dir: Path | None, valid_fraction: float) -> Path:
    """This Python's standard library source (*.py, no tests, no site-packages), prepared once
    into the cache; it needs no network."""
    out_dir = builtin_location(cache_dir, valid_fraction)
    if (out_dir / "meta.json").exists():
        TokenDataset.open(out_dir)  # complete and valid, or a ValueError saying what is wrong
        return out_dir
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return prepare(find_files(stdlib, ".py", BUILTIN_SKIP_DIRS), out_dir, valid_fraction)


LOSS_MASK = "loss_mask.bin"  # optional: one uint8 a token, 0 where it is no target


class TokenDataset:
    """A prepared dataset folder: tokens.bin memory-mapped read-only, and its meta.json; with
    meta "loss_mask": true also loss_mask.bin (trainer.prepare --chat: 0 on a prompt's
    tokens, which are no target of the loss)."""

    def __init__(self, path: Path, meta: dict, tokens: np.ndarray,
                 loss_mask: np.ndarray | None = None):
        self.path, self.meta, self.tokens, self.loss_mask = path, meta, tokens, loss_mask

    @classmethod
    def open(cls, path: Path | str) -> TokenDataset:
        path = Path(path)
        meta = read_meta(path)
        bin_path, dtype = path / "tokens.bin", DTYPES[meta["dtype"]]
        if not bin_path.is_file():
            raise ValueError(f"{bin_path} is missing; prepare the dataset again")
        size, want = bin_path.stat().st_size, meta["num_tokens"] * dtype.itemsize
        if size != want:
            raise ValueError(f"{bin_path} has {size} bytes but {path / 'meta.json'} says "
                             f"num_tokens={meta['num_tokens']} of {meta['dtype']} ({want} "
                             "bytes): truncated or not this dataset's file; prepare it again")
        mask = None
        if meta.get("loss_mask"):
            mask_path = path / LOSS_MASK
            have = mask_path.stat().st_size if mask_path.is_file() else None
            if have != meta["num_tokens"]:
                what = "is missing" if have is None else f"has {have} bytes"
                raise ValueError(f"{mask_path} {what}, but {path / 'meta.json'} records a loss "
                                 f"mask of num_tokens={meta['num_tokens']} bytes")
            mask = np.memmap(mask_path, dtype=np.uint8, mode="r")
        return cls(path, meta, np.memmap(bin_path, dtype=dtype, mode="r"), mask)

    @property
    def num_tokens(self) -> int:
        return self.meta["num_tokens"]

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def split(self, name: str) -> tuple[int, int]:
        """[start, end) token range of the split "train" or "valid"."""
        splits = self.meta["splits"]
        if name not in splits:
            raise ValueError(f"split={name!r} is unknown; choose one of {list(splits)}")
        start, end = splits[name]
        return start, end

    def num_documents(self, name: str) -> int:
        """Documents that start inside the split."""
        start, end = self.split(name)
        return int(np.searchsorted(self.meta["doc_starts"], end)
                   - np.searchsorted(self.meta["doc_starts"], start))


def read_meta(path: Path) -> dict:
    """meta.json of a dataset folder, checked; a ValueError names the file and the problem."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{meta_path} is missing: {path} is not a prepared dataset; prepare it "
                         "with `python -m trainer.prepare SRC_FOLDER OUT_DIR`")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path} is not valid JSON ({e}); prepare the dataset again") from e
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"{meta_path} lacks the keys {missing}; prepare the dataset again")
    if meta["format_version"] != FORMAT_VERSION:
        raise ValueError(f"{meta_path} has format_version={meta['format_version']}, this "
                         f"trainer reads {FORMAT_VERSION}; prepare the dataset again")
    if meta["dtype"] not in DTYPES:
        raise ValueError(f"{meta_path} has dtype={meta['dtype']!r}; expected one of {list(DTYPES)}")
    n, starts = meta["num_tokens"], np.asarray(meta["doc_starts"], dtype=np.int64)
    if not (n >= 1 and starts.size and starts[0] == 0 and (np.diff(starts) > 0).all()
            and starts[-1] < n):
        raise ValueError(f"{meta_path} has num_tokens={n} and doc_starts that are not an "
                         "increasing list from 0 below it; prepare the dataset again")
    try:
        (a, b), (c, d) = meta["splits"]["train"], meta["splits"]["valid"]
    except (KeyError, TypeError, ValueError):
        a = b = c = d = None
    if not (a == 0 and b == c and 0 < b <= d == n):
        raise ValueError(f"{meta_path} has splits={meta['splits']}: expected train [0, t) and "
                         f"valid [t, {n}) with t > 0; prepare the dataset again")
    return meta

