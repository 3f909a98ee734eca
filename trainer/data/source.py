"""Where a run's tokens come from, checked at compose time: data.path (a prepared dataset, whose
meta.json is read, not its tokens) or the built-in corpus (prepared on first use, once, by
launch.py before any rank starts). No torch: the sweeper and the dry run check data too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trainer.config import DataConfig, ModelConfig, TrainConfig
from trainer.data.dataset import TOKENIZERS, TokenDataset, builtin_corpus, builtin_location

BUILTIN_VALID_FRACTION = 0.01  # data.valid_fraction=null with the built-in corpus


@dataclass(frozen=True)
class DataSource:
    path: Path  # the prepared dataset folder (for the built-in corpus: where it is prepared)
    builtin: bool
    valid_fraction: float  # the built-in corpus's split; a prepared dataset carries its own

    @classmethod
    def from_config(cls, data: DataConfig, model: ModelConfig, train: TrainConfig) -> DataSource:
        if data.path is None:
            return cls._builtin(data, model, train)
        for key in ("tokenizer", "valid_fraction", "cache_dir"):
            value = getattr(data, key)
            if value is not None:
                raise ValueError(
                    f"data.{key}={value!r} is ignored with data.path={data.path} (a prepared "
                    f"dataset names its own tokenizer and split and needs no cache). Fix: set "
                    f"data.{key}=null, or prepare the dataset with it (python -m trainer.prepare).")
        path = Path(data.path)
        try:
            meta = TokenDataset.open(path).meta  # reads meta.json and maps the tokens, reads none
        except ValueError as error:
            raise ValueError(f"data.path={data.path}: {error}") from None
        _check_vocab(meta["vocab_size"], f"the dataset {path}", model)
        need = train.seq_length + 1
        for split, (start, end) in meta["splits"].items():
            if end - start < need and (split == "train" or train.eval_interval is not None):
                raise ValueError(
                    f"the {split} split of data.path={data.path} has {end - start} tokens, too "
                    f"few for one sample of train.seq_length={train.seq_length} (needs {need}). "
                    f"Fix: lower train.seq_length, or prepare more text.")
        return cls(path, False, float("nan"))

    @classmethod
    def _builtin(cls, data: DataConfig, model: ModelConfig, train: TrainConfig) -> DataSource:
        tokenizer = data.tokenizer or "byte"
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"data.tokenizer={tokenizer!r} selects no tokenizer for the built-in "
                             f"corpus. Fix: choose one of {', '.join(TOKENIZERS)}, or set data.path.")
        fraction = BUILTIN_VALID_FRACTION if data.valid_fraction is None else data.valid_fraction
        if not 0 <= fraction < 1 or (fraction == 0 and train.eval_interval is not None):
            raise ValueError(f"data.valid_fraction={fraction} must be in [0, 1), and above 0 "
                             f"when train.eval_interval is set. Fix: use e.g. 0.01, or null for "
                             f"the default.")
        _check_vocab(TOKENIZERS[tokenizer].vocab_size, "the built-in corpus", model)
        path = builtin_location(Path(data.cache_dir) if data.cache_dir else None, fraction)
        if not (path / "meta.json").exists():
            _check_writable("data.cache_dir", path.parent)
        return cls(path, True, fraction)

    def open(self) -> TokenDataset:
        """The dataset, prepared first if it is the built-in one and not there yet."""
        if self.builtin:
            builtin_corpus(self.path.parent, self.valid_fraction)
        return TokenDataset.open(self.path)


def _check_vocab(vocab_size: int, what: str, model: ModelConfig) -> None:
    if vocab_size > model.vocab_size:
        raise ValueError(f"{what} has a vocabulary of {vocab_size} tokens but model.vocab_size="
                         f"{model.vocab_size}. Fix: set model.vocab_size >= {vocab_size}.")


def _check_writable(key: str, folder: Path) -> None:
    """The folder, or the nearest existing folder above it, must be writable."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{key}: the built-in corpus is prepared in {folder}, which cannot be "
                         f"written ({existing} is not a writable folder). Fix: point {key} at a "
                         f"folder you can write.")
