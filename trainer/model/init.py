"""Initial weights that do not depend on the layout, computable one rectangle at a time.

A weight's rows are drawn in blocks of BLOCK_ROWS, each block from its own generator seeded by
(seed, parameter name, block index). A rank that keeps a slice of the rows draws only the
blocks it needs, so initialising a shard costs O(shard + one block), never O(model); one
process draws every block and gets the same full weights (torch's CPU generator cannot skip
ahead, so one stream over the whole model would make every rank draw every number).
"""
from __future__ import annotations

import hashlib

import torch

BLOCK_ROWS = 64


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def normal_rectangle(seed: int, name: str, full_cols: int, offsets: tuple[int, int],
                     shape: tuple[int, int]) -> torch.Tensor:
    """Rows offsets[0]..+shape[0], columns offsets[1]..+shape[1] of a standard-normal matrix
    of `full_cols` columns that is the same whoever asks for which part of it."""
    (row, col), (rows, cols) = offsets, shape
    out = torch.empty(shape)
    end = row + rows
    while row < end:
        block, within = divmod(row, BLOCK_ROWS)
        count = min(end - row, BLOCK_ROWS - within)
        gen = torch.Generator().manual_seed(block_seed(seed, name, block))
        # torch's CPU normal fill transforms 16 values at a time and redraws the last 16 of a
        # draw whose size is not a multiple of 16 (and fills one under 16 another way): only a
        # draw of a multiple of 16 values is a prefix of every longer one, so the rows a shard
        # needs are drawn rounded up to one (else a narrow weight's shard and its full weight
        # would differ).
        need = (within + count) * full_cols
        drawn = torch.randn(max(16, -(-need // 16) * 16), generator=gen)[:need]
        drawn = drawn.view(within + count, full_cols)[within:]
        out[row - offsets[0]:row - offsets[0] + count] = drawn[:, col:col + cols]
        row += count
    return out


def special_values(rule: tuple, seed: int, name: str, full: int, offset: int, size: int
                   ) -> torch.Tensor:
    """Entries offset..+size of a vector of `full` entries initialised by a part's rule
    (trainer.parts.part.Part.initial): ("ones",), or ("log_uniform", low, high), the log of a
    uniform draw in [low, high) per entry, the whole vector drawn from one generator of
    (seed, name) whoever asks for which part of it."""
    if rule[0] == "ones":
        return torch.ones(size)
    _, low, high = rule
    gen = torch.Generator().manual_seed(block_seed(seed, name, 0))
    drawn = torch.rand(full, generator=gen, dtype=torch.float64) * (high - low) + low
    return drawn.log().float()[offset:offset + size]
