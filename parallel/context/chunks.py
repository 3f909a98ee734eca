"""Zigzag chunks: which tokens of a sequence a context rank keeps, and in which order gathered
chunks arrive.

A sequence is cut into 2C chunks (C = runtime CP); runtime CP rank r keeps chunks r and 2C-1-r,
so every rank does the same causal work. Which (query chunk, key chunk) pairs attention needs,
and by which kernel calls, is calls.py's: a query chunk attends fully to every earlier key chunk
(or to the part its window reaches), causally to itself, and not at all to later chunks, which
are skipped, never masked. A fully masked block would be wrong anyway: the CPU kernel reports
its log-sum-exp as 0, not -inf.
"""
from __future__ import annotations

import torch

from parallel.layout import Layout


def sequence_order(layout: Layout, members: list[int]) -> torch.Tensor:
    """Chunks gathered from `members` arrive in group order (member i's two chunks, then
    member i+1's); entry c of the result is where chunk c of the sequence is among them."""
    gathered = [c for member in members for c in layout.context_chunk_ids(member)]
    return torch.tensor(sorted(range(len(gathered)), key=gathered.__getitem__))


def local_positions(layout: Layout, rank: int) -> torch.Tensor:
    """Global positions, within a sequence, of the tokens `rank` keeps (in local order)."""
    return torch.tensor([p for chunk in layout.context_chunks(rank) for p in chunk])


def keep_local(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """This rank's tokens of x [batch, seq, ...] (tokens, labels or positions)."""
    if positions.numel() == x.shape[1]:  # no context parallelism: every position, in order
        return x
    return x.index_select(1, positions.to(x.device))
