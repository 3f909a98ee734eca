"""Where a run's tokens come from, checked at compose time: data.path (a prepared dataset, whose
meta.json is read, not its tokens) or the built-in corpus (prepared on first use, once, by
launch.py before any rank starts). No torch: the sweeper and the dry run check data too.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.checks import check_writable
from trainer.config import DataConfig, ModelConfig, TrainConfig
from trainer.data.blend import parse_blend, samples_per_part
from trainer.data.dataset import TOKENIZERS, TokenDataset, builtin_corpus, builtin_location
from trainer.data.megatron import is_indexed, largest_token, open_indexed
from trainer.data.packing import examples

BUILTIN_VALID_FRACTION = 0.01  # data.valid_fraction=null with the built-in corpus
PREPARE_FIX = ("point data.path at a folder made by `python -m trainer.prepare SRC_FOLDER "
               "OUT_DIR`, or set data.path=null for the built-in corpus")


@dataclass(frozen=True)
class DataSource:
    path: Path  # the prepared dataset folder (for the built-in corpus: where it is prepared)
    builtin: bool
    valid_fraction: float  # the built-in corpus's or a Megatron dataset's; ours carry their own
    megatron: bool = False  # path is a Megatron indexed dataset prefix
    vocab_size: int = 0  # model.vocab_size, which a Megatron dataset's ids are checked against
    blend: tuple[tuple[float, DataSource], ...] = ()  # data.blend: (weight, part) pairs

    @classmethod
    def from_config(cls, data: DataConfig, model: ModelConfig, train: TrainConfig) -> DataSource:
        if data.reset_position_ids and not data.reset_attention_mask:
            raise ValueError(
                "data.reset_position_ids=true with data.reset_attention_mask=false: positions "
                "would restart at each document while attention still runs across documents, "
                "so tokens of two documents would meet at the same positions. Fix: set "
                "data.reset_attention_mask=true too, or data.reset_position_ids=false.")
        pairs_fix = ("Fix: prepare pairs with python -m trainer.prepare FILE.jsonl OUT "
                     "--preference and set data.path=OUT, or train.objective=lm")
        if train.objective == "dpo" and (data.path is None or data.blend is not None
                                         or is_indexed(data.path)):
            where = ("data.blend" if data.blend is not None else
                     "data.path=null (the built-in corpus)" if data.path is None else
                     f"data.path={data.path} (a Megatron dataset)")
            raise ValueError(f"train.objective=dpo reads preference pairs, and {where} holds "
                             f"none. {pairs_fix}.")
        if data.blend is not None:
            return cls._blend(data, model, train)
        if data.path is None:
            return cls._builtin(data, model, train)
        if is_indexed(data.path):
            return cls._megatron(data, model, train)
        for key in ("tokenizer", "valid_fraction", "cache_dir"):
            value = getattr(data, key)
            if value is not None:
                raise ValueError(
                    f"data.{key}={value!r} is ignored with data.path={data.path} (a prepared "
                    f"dataset names its own tokenizer and split and needs no cache). Fix: set "
                    f"data.{key}=null, or prepare the dataset with it (python -m trainer.prepare).")
        path = Path(data.path)
        if not path.is_dir():
            what = "is a file, not a dataset folder" if path.exists() else "does not exist"
            raise ValueError(f"data.path={data.path} {what}. Fix: {PREPARE_FIX}.")
        try:
            meta = TokenDataset.open(path).meta  # reads meta.json and maps the tokens, reads none
        except ValueError as error:  # the dataset's own advice ("; prepare ...") is the Fix
            problem = str(error).split("; prepare")[0]
            raise ValueError(f"data.path={data.path}: {problem}. Fix: {PREPARE_FIX}.") from None
        _check_vocab(meta["vocab_size"], f"the dataset {path}", model)
        _check_splits(meta["splits"], data.path, train)
        _check_end_of_document(data, meta["eod_id"], f"data.path={data.path}")
        if train.objective == "dpo" and not meta.get("preference"):
            raise ValueError(f"train.objective=dpo with data.path={data.path}, a dataset of "
                             f"documents, not preference pairs. {pairs_fix}.")
        if meta.get("preference") and data.pack:  # packed whole, a pair must fit a sample
            edges = np.append(np.asarray(meta["doc_starts"][::2]), meta["num_tokens"])
            longest = int(np.diff(edges).max())
            if longest > train.seq_length + 1:
                raise ValueError(
                    f"data.path={data.path}: its longest preference pair is {longest:,} tokens, "
                    f"more than a sample of train.seq_length + 1 = {train.seq_length + 1:,}: "
                    f"cut, a response would be lost. Fix: train.seq_length={longest - 1}, or "
                    f"prepare the pairs without the long ones.")
        return cls(path, False, float("nan"))

    @classmethod
    def _builtin(cls, data: DataConfig, model: ModelConfig, train: TrainConfig) -> DataSource:
        tokenizer = data.tokenizer or "byte"
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"data.tokenizer={tokenizer!r} selects no tokenizer for the built-in "
                             f"corpus. Fix: choose one of {', '.join(TOKENIZERS)}, or set "
                             f"data.path.")
        fraction = _valid_fraction(data, train)
        _check_vocab(TOKENIZERS[tokenizer].vocab_size, "the built-in corpus", model)
        _check_end_of_document(data, TOKENIZERS[tokenizer].eod_id,
                               f"the built-in corpus (data.tokenizer={tokenizer})")
        path = builtin_location(Path(data.cache_dir) if data.cache_dir else None, fraction)
        # Its splits are checked at start, once it is prepared (prepare()): a dry run, which
        # reads no data, plans any train.seq_length whether or not this machine prepared it.
        if not (path / "meta.json").exists():
            check_writable("data.cache_dir", data.cache_dir or "null (~/.cache/gtp-trainer)",
                           path.parent, "the built-in corpus is prepared once")
        return cls(path, True, fraction)

    @classmethod
    def _megatron(cls, data: DataConfig, model: ModelConfig, train: TrainConfig) -> DataSource:
        for key in ("tokenizer", "cache_dir"):
            value = getattr(data, key)
            if value is not None:
                raise ValueError(f"data.{key}={value!r} is ignored with the Megatron dataset "
                                 f"data.path={data.path} (it was tokenized already). Fix: set "
                                 f"data.{key}=null.")
        fraction = _valid_fraction(data, train)
        try:
            dataset = open_indexed(data.path, fraction)  # reads the index, not the tokens
        except ValueError as error:
            raise ValueError(f"data.path={data.path}: {error}. Fix: point data.path at a "
                             f"complete Megatron dataset prefix (PREFIX.bin + PREFIX.idx).") \
                from None
        _check_splits(dataset.meta["splits"], data.path, train)
        return cls(Path(data.path), False, fraction, megatron=True, vocab_size=model.vocab_size)

    @classmethod
    def _blend(cls, data: DataConfig, model: ModelConfig, train: TrainConfig) -> DataSource:
        if data.path is not None:
            raise ValueError(f"data.blend and data.path={data.path} are both set. Fix: set "
                             f"data.path=null (a blend names its datasets), or data.blend=null.")
        pairs = parse_blend(data.blend)
        alone = dataclasses.replace(train, eval_interval=None)  # evaluation is checked mixed
        parts = []
        for weight, path in pairs:
            try:
                parts.append((weight, cls.from_config(
                    dataclasses.replace(data, path=path, blend=None), model, alone)))
            except ValueError as error:
                raise ValueError(f"data.blend: {error}") from None
        _check_one_tokenizer(parts)
        if train.eval_interval is not None:
            need = samples_per_part([w for w, _ in parts], train.eval_samples)
            for (weight, part), n in zip(parts, need):
                start, end = part.open().split("valid")
                have = (end - start - 1) // train.seq_length
                if n > have:
                    raise ValueError(
                        f"data.blend: train.eval_samples={train.eval_samples} takes {n} samples "
                        f"of {part.path} (weight {weight}), whose valid split holds {have} of "
                        f"train.seq_length={train.seq_length}: an evaluation would repeat "
                        f"samples. Fix: lower train.eval_samples, or hold out more of it.")
        return cls(Path(f"blend of {len(parts)}"), False, float("nan"), blend=tuple(parts))

    def prepare(self, train: TrainConfig, pack: bool = False) -> None:
        """Before any rank starts: the built-in corpus is prepared once, or checked if it is there
        (a data.path was checked when the spec was settled), and its splits against `train`; a
        Megatron dataset, whose index records no vocabulary, has its tokens read for the largest
        id (all of them up to 64M tokens, else evenly spread blocks of that many: the stream
        checks every sample it reads, so an id past the vocabulary never trains); a dataset
        with a loss mask must leave a target in the splits the run reads (_check_targets)."""
        for _, part in self.blend:
            part.prepare(train, pack)
        if not (self.blend or self.builtin or self.megatron):
            _check_targets(self.open(), train, pack)
        if self.builtin:
            builtin_corpus(self.path.parent, self.valid_fraction)
            _check_splits(self.open().meta["splits"], f"null (the built-in corpus, {self.path})",
                          train)
        if self.megatron:
            largest, _ = largest_token(self.open())
            if largest >= self.vocab_size:
                raise ValueError(f"data.path={self.path} holds token id {largest}, but "
                                 f"model.vocab_size={self.vocab_size}. Fix: set "
                                 f"model.vocab_size >= {largest + 1} (the tokenizer's "
                                 f"vocabulary).")

    def tokenizer_file(self) -> str | None:
        """What tokenized the data, for python -m trainer.generate: "byte", a tokenizer.json
        path, or None (a Megatron dataset records none). A blend's parts share one."""
        if self.blend:
            return self.blend[0][1].tokenizer_file()
        if self.builtin:
            return "byte"
        if self.megatron:
            return None
        name = TokenDataset.open(self.path).meta["tokenizer"]
        if name == "byte":
            return name
        for file in (self.path.resolve() / "tokenizer.json", Path(name)):  # trained: kept here
            if file.is_absolute() and file.is_file():
                return str(file)
        return None

    def open(self) -> TokenDataset:
        """The dataset, prepared and checked by launch.py before any rank started."""
        if self.megatron:
            return open_indexed(self.path, self.valid_fraction)
        return TokenDataset.open(self.path)


def _valid_fraction(data: DataConfig, train: TrainConfig) -> float:
    """The held-out share of the built-in corpus or a Megatron dataset (null: 0.01)."""
    fraction = BUILTIN_VALID_FRACTION if data.valid_fraction is None else data.valid_fraction
    if not 0 <= fraction < 1:
        raise ValueError(f"data.valid_fraction={fraction} is outside [0, 1): it is the share "
                         f"of the corpus held out. Fix: use e.g. 0.01, or null for "
                         f"{BUILTIN_VALID_FRACTION}.")
    if fraction == 0 and train.eval_interval is not None:
        raise ValueError(f"data.valid_fraction=0 holds out nothing, but train.eval_interval="
                         f"{train.eval_interval} evaluates. Fix: use e.g. 0.01, or set "
                         f"train.eval_interval=null.")
    return fraction


def _check_splits(splits: dict, where: str, train: TrainConfig) -> None:
    """Each split the run reads holds one sample; an evaluation reads distinct samples (more
    than the valid split holds would repeat some and weigh them twice, silently)."""
    need = train.seq_length + 1
    for split, (start, end) in splits.items():
        if end - start < need and (split == "train" or train.eval_interval is not None):
            raise ValueError(
                f"the {split} split of data.path={where} has {end - start} tokens, too few for "
                f"one sample of train.seq_length={train.seq_length} (needs {need}). Fix: lower "
                f"train.seq_length, or prepare more text.")
    start, end = splits["valid"]
    samples = (end - start - 1) // train.seq_length  # as data.stream cuts them
    if train.eval_interval is not None and train.eval_samples > samples:
        raise ValueError(
            f"train.eval_samples={train.eval_samples} is more than the {samples} samples of "
            f"train.seq_length={train.seq_length} in the valid split of data.path={where}: an "
            f"evaluation would repeat samples. Fix: lower train.eval_samples, or hold out more "
            f"(data.valid_fraction for the built-in corpus or a Megatron dataset, "
            f"`python -m trainer.prepare --valid-fraction` for a prepared one).")


def _check_targets(dataset: TokenDataset, train: TrainConfig, pack: bool) -> None:
    """A loss mask (trainer.prepare --chat) that leaves no target in a split the run reads
    would fail the first step ("no loss tokens") after every rank started: say it first. Its
    mask is read until a target turns up (at once, for any real chat data; the whole split's
    mask, a byte a token, when there is none). Without data.pack the windows' targets are the
    split's tokens but its first; with it, each example is cut to seq_length + 1 tokens."""
    if dataset.loss_mask is None:
        return
    mask, length = dataset.loss_mask, train.seq_length + 1
    doc_starts = np.asarray(dataset.meta["doc_starts"], dtype=np.int64)
    for split in ("train", "valid") if train.eval_interval is not None else ("train",):
        start, end = dataset.split(split)
        if pack:
            begins, sizes, _ = examples(doc_starts, start, end, length)
        else:  # the windows' targets: every token of theirs but the split's first
            windows = (end - start - 1) // train.seq_length
            begins, sizes = np.asarray([start + 1]), np.asarray([windows * train.seq_length])
        if _any_target(mask, begins, begins + sizes):
            continue
        if _any_target(mask, np.asarray([start]), np.asarray([end])):
            why = (f" once data.pack cuts each example to train.seq_length + 1 = {length} tokens "
                   f"(its answer comes after its prompt)")
            fix = "raise train.seq_length above the prompts, or prepare shorter examples"
        else:
            why, fix = "", ("prepare the data again (python -m trainer.prepare --chat refuses "
                            "data with no target), or with --loss-on all")
        raise ValueError(f"data.path={dataset.path}: its loss mask leaves no target in the "
                         f"{split} split{why}, so a step would have no loss tokens. Fix: {fix}.")


def _any_target(mask: np.ndarray, begins: np.ndarray, ends: np.ndarray) -> bool:
    """Whether mask is nonzero in any of the ordered, disjoint ranges [begins, ends), read a
    block at a time until it is."""
    last, block = int(ends[-1]), 1 << 22
    for at in range(int(begins[0]), last, block):
        hits = np.flatnonzero(mask[at:min(at + block, last)]) + at
        inside = np.searchsorted(begins, hits, side="right") - 1  # the range each hit is past
        if (hits < ends[inside]).any():
            return True
    return False


def _check_one_tokenizer(parts: list[tuple[float, DataSource]]) -> None:
    """The parts of a blend share one tokenizer: a token id must mean the same text in every
    part. Ours record theirs in meta.json; a Megatron index records none (not compared)."""
    named = [(part.path, _tokenizer_of(part)) for _, part in parts if not part.megatron]
    for path, (name, identity) in named[1:]:
        first_path, (first_name, first) = named[0]
        if identity != first:
            raise ValueError(
                f"data.blend mixes tokenizers: {first_path} was made with {first_name}, {path} "
                f"with {name}, so one token id would mean different text in each. Fix: prepare "
                f"every part with the same tokenizer (python -m trainer.prepare --tokenizer "
                f"...), or blend only those that share one.")


def _tokenizer_of(part: DataSource) -> tuple[str, tuple]:
    """(how a message names it, what must be equal): a BPE trained by prepare is kept in the
    dataset as tokenizer.json, a loaded one is named by its file; their bytes are compared, as
    two BPEs of one size trained on different text share a name and a vocabulary size."""
    meta = part.open().meta
    name = f"{meta['tokenizer']} (vocabulary {meta['vocab_size']})"
    for file in (part.path.resolve() / "tokenizer.json", Path(meta["tokenizer"])):
        if file.is_absolute() and file.is_file():
            return name, (meta["vocab_size"], hashlib.sha256(file.read_bytes()).hexdigest())
    return name, (meta["vocab_size"], meta["tokenizer"])


def _check_end_of_document(data: DataConfig, eod_id: int | None, what: str) -> None:
    """eod_mask_loss drops the loss at the token that ends a document: data tokenized without
    one (the byte tokenizer) has none. A Megatron dataset records no tokenizer: its documents
    are taken to end with one, as Megatron's own flag takes them (preprocess --append-eod)."""
    if data.eod_mask_loss and eod_id is None:
        raise ValueError(
            f"data.eod_mask_loss=true, but {what} was tokenized without an end-of-document "
            f"token (the byte tokenizer): its documents end in text, whose loss would be "
            f"dropped. Fix: set data.eod_mask_loss=false, or prepare the text with a tokenizer "
            f"that has one (python -m trainer.prepare --tokenizer ...).")


def _check_vocab(vocab_size: int, what: str, model: ModelConfig) -> None:
    if vocab_size > model.vocab_size:
        raise ValueError(f"{what} has a vocabulary of {vocab_size} tokens but model.vocab_size="
                         f"{model.vocab_size}. Fix: set model.vocab_size >= {vocab_size}.")
