"""Tokenizers for `python -m trainer.prepare`: bytes (vocabulary 256, the built-in default) or a
Hugging Face tokenizer (a tokenizer.json file, or a folder holding one), offline, through the
`tokenizers` library; or a byte-level BPE trained on the sources first.

A Hugging Face tokenizer ends every document with its end-of-document token (the folder's
tokenizer_config.json eos_token, else the first of the usual names it knows, else --eod-token),
so no sample joins two documents unseen. Documents are encoded in batches with the library's
batch encoder, which uses every core.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class ByteTokenizer:
    """Token = byte value: vocabulary 256, no special tokens, any file encodes losslessly."""

    name, vocab_size, eod_id = "byte", 256, None

    def encode(self, data: str | bytes) -> np.ndarray:
        return np.frombuffer(data.encode() if isinstance(data, str) else data, dtype=np.uint8)

    def encode_documents(self, documents: list[str | bytes]) -> list[np.ndarray]:
        return [self.encode(doc) for doc in documents]

    def encode_text(self, text: str) -> list[int]:
        """A prompt's ids, no end-of-document token (generation)."""
        return self.encode(text).tolist()

    def decode(self, token_ids) -> str:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        # An id outside a byte (a model's padded vocabulary) becomes 0xFF, which is never valid
        # UTF-8, so it prints as U+FFFD like any other undecodable byte.
        ids = np.where((ids >= 0) & (ids < 256), ids, 0xFF).astype(np.uint8)
        return ids.tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizers.Tokenizer with an end-of-document id; `name` is what meta.json records."""

    def __init__(self, tokenizer, name: str, eod_token: str | None = None,
                 config: dict | None = None):
        self.tokenizer, self.name = tokenizer, name
        self.config = config or {}  # tokenizer_config.json: its chat_template, special tokens
        self.vocab_size = tokenizer.get_vocab_size()
        candidates = [eod_token] if eod_token else [_eos_of(config or {}), *EOD_NAMES]
        found = [(t, tokenizer.token_to_id(t)) for t in candidates if t]
        found = [(t, i) for t, i in found if i is not None]
        if not found:
            raise ValueError(f"tokenizer {name} has no end-of-document token "
                             f"({eod_token or ', '.join(EOD_NAMES)}). Fix: pass --eod-token "
                             f"with the one it uses")
        self.eod_token, self.eod_id = found[0]

    @classmethod
    def load(cls, path: Path, eod_token: str | None = None) -> HFTokenizer:
        """From a tokenizer.json file or a folder holding one (offline)."""
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"--tokenizer {path}: no tokenizer.json there; pass byte, a "
                             f"Hugging Face tokenizer.json file or a folder holding one "
                             f"(tokenizers are read offline, never downloaded)")
        config_file = file.parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as error:  # noqa: BLE001  (the library raises its own kinds)
            raise ValueError(f"--tokenizer {file} is not a tokenizer the tokenizers library "
                             f"reads ({str(error).splitlines()[0][:80]})") from None
        return cls(tokenizer, str(file.resolve()), eod_token, config)

    @classmethod
    def train(cls, texts: Iterable[str | bytes], vocab_size: int, out: Path,
              eod_token: str | None = None) -> HFTokenizer:
        """A byte-level BPE of `vocab_size` trained on the documents `texts`, saved as out
        (tokenizer.json)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        eod = eod_token or EOD_NAMES[0]
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eod],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tokenizer.train_from_iterator((_text(t) for t in texts), trainer)
        tokenizer.save(str(out))
        return cls(tokenizer, out.name, eod)

    def encode_documents(self, documents: list[str | bytes]) -> list[np.ndarray]:
        """Each document's ids followed by the end-of-document id (undecodable bytes become
        U+FFFD: a Hugging Face tokenizer reads text, not bytes)."""
        texts = [_text(doc) for doc in documents]
        encoded = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids + [self.eod_id], dtype=np.int64) for e in encoded]

    def encode_text(self, text: str) -> list[int]:
        """A prompt's ids, without added special tokens (a chat template writes its own)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(np.asarray(token_ids).reshape(-1).tolist(),
                                     skip_special_tokens=False)


def _text(document: str | bytes) -> str:
    return document if isinstance(document, str) else document.decode("utf-8", errors="replace")


def _eos_of(config: dict) -> str | None:
    eos = config.get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos
