"""A rank's micro-batches of a global batch: its batch lane's samples, its context chunks.

Sample i of the global batch is a row of seq_length + 1 tokens: inputs are its first
seq_length tokens, labels the last seq_length. Which samples and which positions a rank keeps
is the Layout's answer (micro_batch_samples, context_chunks); this module only indexes.
"""
from __future__ import annotations

import torch

from parallel.context import keep_local, local_positions
from parallel.layout import Layout
from trainer.step import MicroBatch


def rank_micro_batches(global_batch: torch.Tensor, layout: Layout, rank: int) -> list[MicroBatch]:
    """global_batch: [global_batch_size, seq_length + 1] token ids."""
    expected = (layout.global_batch_size, layout.seq_length + 1)
    if tuple(global_batch.shape) != expected:
        raise ValueError(f"global batch has shape {tuple(global_batch.shape)}, the layout "
                         f"expects {expected} (global_batch_size, seq_length + 1)")
    lane, keep = layout.batch_partition(rank), local_positions(layout, rank)
    out = []
    for micro in range(layout.num_microbatches):
        samples = global_batch[list(layout.micro_batch_samples(lane, micro))]
        positions = torch.arange(layout.seq_length).expand(samples.shape[0], -1)
        out.append(MicroBatch(tokens=keep_local(samples[:, :-1], keep),
                              labels=keep_local(samples[:, 1:], keep),
                              positions=keep_local(positions, keep)))
    return out
