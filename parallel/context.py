"""Context parallel: each rank of the `context` group (runtime CP = configured CP x sequence
shards) keeps two zigzag chunks of every sequence and attends over the whole sequence.

This first version all-gathers K and V over the context group (backward: reduce-scatter of
their gradients) and masks causally by global token position. A ring of K/V blocks with an
online-softmax merge would overlap communication with compute; it is not built yet.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.comm import Group
from parallel.layout import Layout
from parallel.regions import gather_along

HEAD_SEQ_DIM = 2  # q, k, v are [batch, heads, seq, head_dim]


def local_positions(layout: Layout, rank: int) -> torch.Tensor:
    """Global positions, within a sequence, of the tokens `rank` keeps (in local order)."""
    return torch.tensor([p for chunk in layout.context_chunks(rank) for p in chunk])


def keep_local(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """This rank's tokens of x [batch, seq, ...] (tokens, labels or positions)."""
    if positions.numel() == x.shape[1]:  # no context parallelism: every position, in order
        return x
    return x.index_select(1, positions.to(x.device))


class ContextParallelAttention:
    """The model's attention_fn under runtime CP > 1."""

    def __init__(self, context: Group, layout: Layout, rank: int):
        self.context = context
        query_pos = local_positions(layout, rank)
        # Gathered K/V arrive in group order: member i's two chunks, then member i+1's.
        key_pos = torch.cat([local_positions(layout, member) for member in context.ranks])
        self.mask = query_pos[:, None] >= key_pos[None, :]  # True = may attend

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = gather_along(torch.stack((k, v)), self.context, HEAD_SEQ_DIM + 1)
        mask = self.mask.to(q.device)
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask)
