"""A rank's micro-batches of a global batch: its batch lane's samples, its context chunks.

A sample is a row of seq_length + 1 tokens: inputs are its first seq_length tokens, labels the
last seq_length. Which samples and which positions a rank keeps is the Layout's answer
(micro_batch_samples, context_chunks); this module only fetches and indexes.

Packed documents (Megatron's data flags; the documents come from the dataset's document index,
trainer.data.stream): reset_attention_mask gives the model, for every position of the whole
sequence, where its document starts (the attention needs no more, trainer.model.attention's
AttentionFn); reset_position_ids restarts the RoPE positions at each document; eod_mask_loss
drops the loss where the input is a document's last token (its end-of-document token), whose
target is the next document's first token. A dataset with a loss mask (a prompt's tokens,
trainer.prepare --chat) drops the loss where the target is a token it does not count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from parallel.context import keep_local, local_positions
from parallel.layout import Layout
from trainer.config import DataConfig

IGNORE = -100  # label of a position that carries no loss


@dataclass
class MicroBatch:
    """This rank's tokens of one micro-batch: [micro_batch_size, local seq] each."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor  # RoPE positions: global positions, or within the document
    # data.reset_attention_mask: where each position's document starts, [micro_batch_size,
    # seq_length], every position (not only this rank's), kept on the CPU; else None
    documents: torch.Tensor | None = None
    empty_samples: int = 0  # samples with no counted token (counted by one rank of each)
    # Multi-token prediction (model.mtp_num_layers = D): [D, micro_batch_size, local seq], the
    # token k ahead of each position (depth k's input) and the token k + 1 ahead (its label,
    # IGNORE past the sample's end, across a document, or where the main label is ignored)
    ahead: torch.Tensor | None = None
    ahead_labels: torch.Tensor | None = None
    # data.reset_attention_mask: which document of its sample each of this rank's positions
    # is in (0, 1, ...: a preference pair is documents 2j and 2j + 1), [micro_batch_size,
    # local seq]; else None
    document_index: torch.Tensor | None = None


# Positions within the global batch -> those samples, [n, seq_length + 1] token ids.
Fetch = Callable[[Sequence[int]], np.ndarray | torch.Tensor]


class Samples(Protocol):
    """A sample stream (trainer.data.stream) by stream index: [n, seq_length + 1] arrays."""

    def get(self, indices: Sequence[int]) -> np.ndarray: ...  # token ids

    def document_starts(self, indices: Sequence[int]) -> np.ndarray: ...  # see stream

    def loss_mask(self, indices: Sequence[int]) -> np.ndarray | None: ...  # 0: not a target


class _Tokens:
    """Samples of a plain fetch (tests, the measured dry run): tokens, no documents, no mask."""

    def __init__(self, fetch: Fetch):
        self.get = fetch

    def document_starts(self, indices: Sequence[int]) -> np.ndarray:
        raise ValueError("packed documents need a sample stream's document index")

    def loss_mask(self, indices: Sequence[int]) -> None:
        return None


@dataclass(frozen=True)
class DocumentRules:
    """data.reset_attention_mask, reset_position_ids, eod_mask_loss."""

    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False

    @classmethod
    def of(cls, data: DataConfig) -> DocumentRules:
        return cls(data.reset_attention_mask, data.reset_position_ids, data.eod_mask_loss)

    @property
    def needed(self) -> bool:
        return self.reset_attention_mask or self.reset_position_ids or self.eod_mask_loss


NO_DOCUMENTS = DocumentRules()


def rank_micro_batches(samples: Samples | Fetch, layout: Layout, rank: int,
                       device: torch.device | None = None, rules: DocumentRules = NO_DOCUMENTS,
                       offset: int = 0, mtp_depths: int = 0) -> list[MicroBatch]:
    """Only this rank's samples are fetched (stream indices offset + their position in the
    global batch); every rank of a context group fetches the same. A plain fetch gives tokens
    only. mtp_depths: multi-token prediction's D (model.mtp_num_layers), 0 for none."""
    source = samples if hasattr(samples, "document_starts") else _Tokens(samples)
    lane, keep = layout.batch_partition(rank), local_positions(layout, rank)
    seq = layout.seq_length
    # Samples that count no token are counted once: by runtime CP rank 0 of each batch lane
    # (the step sums them with the loss tokens over token_distinct).
    counts_empty = layout.runtime_cp_rank(rank) == 0
    out = []
    for micro in range(layout.num_microbatches):
        indices = [offset + i for i in layout.micro_batch_samples(lane, micro)]
        # A stream reads numpy arrays (the data room imports no torch); a plain fetch may give
        # tensors already.
        tokens = torch.as_tensor(source.get(indices))
        if tuple(tokens.shape) != (layout.micro_batch_size, seq + 1):
            raise ValueError(f"fetched samples of shape {tuple(tokens.shape)}, expected "
                             f"{(layout.micro_batch_size, seq + 1)}")
        positions = torch.arange(seq).expand(tokens.shape[0], -1)
        labels, documents, begin = tokens[:, 1:], None, None
        mask = source.loss_mask(indices)
        if mask is not None:
            # the dataset's own: a token that is no target (a prompt's)
            mask = torch.as_tensor(mask)
            labels = labels.masked_fill(mask[:, 1:] == 0, IGNORE)
        if rules.needed:
            # [n, seq + 1]: each token's document start
            begin = torch.as_tensor(source.document_starts(indices))
            if rules.reset_position_ids:
                positions = positions - begin[:, :-1]
            if rules.eod_mask_loss:  # the target starts a document: the input ended one
                labels = labels.masked_fill(begin[:, 1:] == torch.arange(1, seq + 1), IGNORE)
            if rules.reset_attention_mask:
                documents = begin[:, :-1].contiguous()
        empty = int(((labels != IGNORE).sum(1) == 0).sum()) if counts_empty else 0
        ahead = _ahead(tokens, labels, begin, mtp_depths) if mtp_depths else ()
        tensors = (keep_local(tokens[:, :-1], keep), keep_local(labels, keep),
                   keep_local(positions, keep),
                   *(torch.stack([keep_local(t, keep) for t in depth]) for depth in ahead))
        tensors = [t.to(device) if device else t for t in tensors]
        index = None
        if documents is not None:  # a new document where a position is its own start
            index = keep_local((documents == torch.arange(seq)).cumsum(1) - 1, keep)
            index = index.to(device) if device else index
        out.append(MicroBatch(*tensors[:3], documents, empty, *tensors[3:],
                              document_index=index))
    return out


def _ahead(tokens: torch.Tensor, labels: torch.Tensor, begin: torch.Tensor | None,
           depths: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Multi-token prediction's inputs and labels of each depth k = 1..D, over the whole
    sequence (before a rank keeps its positions, so under context parallel the tokens ahead of
    a chunk's last positions are there without asking the rank that holds them): at position
    i the token i + k and the label i + k + 1 (the main label at i + k, so what the main loss
    ignores is ignored), IGNORE past the sample's end and, where documents are known (begin:
    each token's document start), where token i + k + 1 is not in token i's document."""
    seq = labels.shape[1]
    inputs, targets = [], []
    for k in range(1, depths + 1):
        ahead = torch.zeros_like(labels)
        ahead[:, :seq - k + 1] = tokens[:, k:]
        target = torch.full_like(labels, IGNORE)
        target[:, :seq - k] = labels[:, k:]
        if begin is not None:
            crossing = begin[:, :seq - k] != begin[:, k + 1:]
            target[:, :seq - k].masked_fill_(crossing, IGNORE)
        inputs.append(ahead)
        targets.append(target)
    return inputs, targets
