"""A rank's micro-batches of a global batch: its batch lane's samples, its context chunks.

A sample is a row of seq_length + 1 tokens: inputs are its first seq_length tokens, labels the
last seq_length. Which samples and which positions a rank keeps is the Layout's answer
(micro_batch_samples, context_chunks); this module only fetches and indexes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from parallel.context import keep_local, local_positions
from parallel.layout import Layout


@dataclass
class MicroBatch:
    """This rank's tokens of one micro-batch: [micro_batch_size, local seq] each."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor  # global positions within the sequence (RoPE, causal masks)


# Positions within the global batch -> those samples, [n, seq_length + 1] token ids.
Fetch = Callable[[Sequence[int]], torch.Tensor]


def rank_micro_batches(fetch: Fetch, layout: Layout, rank: int,
                       device: torch.device | None = None) -> list[MicroBatch]:
    """Only this rank's samples are fetched; every rank of a context group fetches the same."""
    lane, keep = layout.batch_partition(rank), local_positions(layout, rank)
    out = []
    for micro in range(layout.num_microbatches):
        samples = fetch(list(layout.micro_batch_samples(lane, micro)))
        if tuple(samples.shape) != (layout.micro_batch_size, layout.seq_length + 1):
            raise ValueError(f"fetched samples of shape {tuple(samples.shape)}, expected "
                             f"{(layout.micro_batch_size, layout.seq_length + 1)}")
        positions = torch.arange(layout.seq_length).expand(samples.shape[0], -1)
        tensors = (keep_local(samples[:, :-1], keep), keep_local(samples[:, 1:], keep),
                   keep_local(positions, keep))
        out.append(MicroBatch(*(t.to(device) if device else t for t in tensors)))
    return out
