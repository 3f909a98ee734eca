"""Zigzag chunks: which tokens of a sequence a context rank keeps, and which (query chunk, key
chunk) pairs causal attention needs between them.

A sequence is cut into 2C chunks (C = runtime CP); runtime CP rank r keeps chunks r and 2C-1-r,
so every rank does the same causal work. At chunk granularity causality needs no mask: a query
chunk attends fully to every earlier key chunk, causally to itself (the kernels' own is_causal,
with equal lengths) and not at all to later chunks, which are skipped, never masked. A fully
masked block would be wrong anyway: the CPU kernel reports its log-sum-exp as 0, not -inf.
"""
from __future__ import annotations

from enum import Enum

import torch

from parallel.layout import Layout


class Pair(Enum):
    FULL = "full"
    CAUSAL = "causal"


def pair(query_chunk: int, key_chunk: int) -> Pair | None:
    """How query chunk attends to key chunk (global chunk indices); None: not at all."""
    if key_chunk < query_chunk:
        return Pair.FULL
    return Pair.CAUSAL if key_chunk == query_chunk else None


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


Block = tuple[int, int, int, bool]  # (query chunk, first key chunk, end key chunk, causal)


def blocks(query_chunks: tuple[int, ...], key_chunks: tuple[int, ...]) -> list[Block]:
    """The attention calls between local query chunks and a row of key chunks (global chunk
    ids, in their order in memory): indices into both, adjacent fully visible key chunks
    joined into one call, causal chunks alone, later chunks left out."""
    out: list[Block] = []
    for qi, q in enumerate(query_chunks):
        for ki, k in enumerate(key_chunks):
            kind = pair(q, k)
            if kind is None:
                continue
            last = out[-1] if out else None
            if (kind is Pair.FULL and last is not None and last[0] == qi and last[2] == ki
                    and not last[3]):
                out[-1] = (qi, last[1], ki + 1, False)
            else:
                out.append((qi, ki, ki + 1, kind is Pair.CAUSAL))
    return out
