"""GTP_remat weight sharding: a TP-local weight stored as 1/G of its rows on each gtp_remat rank.

Rows are padded to a multiple of G. The full weight is all-gathered just before use in forward
and freed after; a linear layer gathers it again in backward (weight rematerialisation) and
reduce-scatters its gradient back to the shard, so only the shard persists between uses.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.comm import Group


def shard_rows_of(full: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's padded slice of `full`'s rows (a copy)."""
    rows = full.shape[0]
    per_rank = -(-rows // group.size)
    padded = full.new_zeros((per_rank * group.size, *full.shape[1:]))
    padded[:rows] = full
    return padded[group.rank * per_rank:(group.rank + 1) * per_rank].clone()


def gather_rows(shard: torch.Tensor, group: Group, rows: int) -> torch.Tensor:
    """The full TP-local weight from every rank's shard, padding removed."""
    if group.size == 1:
        return shard
    return group.all_gather(shard)[:rows]


def _scatter_rows(grad_full: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum the full-weight gradient over the group, keep this rank's (padded) rows."""
    rows = grad_full.shape[0]
    per_rank = -(-rows // group.size)
    if per_rank * group.size != rows:
        grad_full = F.pad(grad_full, (0, 0, 0, per_rank * group.size - rows))
    return group.reduce_scatter(grad_full)


class _ShardedLinear(torch.autograd.Function):
    """y = x @ W^T with W gathered in forward, gathered again in backward, never saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: torch.Tensor, group: Group, rows: int):
        ctx.group, ctx.rows = group, rows
        ctx.save_for_backward(x, shard)
        return F.linear(x, gather_rows(shard, group, rows))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, shard = ctx.saved_tensors
        # Under autocast the forward ran in grad_y's dtype; backward runs outside autocast, so
        # it casts explicitly. The gradient returns to the shard's (master) dtype.
        weight = gather_rows(shard, ctx.group, ctx.rows).to(grad_y.dtype)
        grad_x = grad_y @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(
            grad_y.dtype)
        return grad_x, _scatter_rows(grad_w.to(shard.dtype), ctx.group), None, None


class _ShardedEmbedding(torch.autograd.Function):
    """Lookup in a gathered table; the backward needs only the ids, so no second gather."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, shard: torch.Tensor, group: Group, rows: int):
        ctx.group, ctx.rows, ctx.dtype = group, rows, shard.dtype
        ctx.save_for_backward(ids)
        return F.embedding(ids, gather_rows(shard, group, rows))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        grad_w = grad_out.new_zeros((ctx.rows, grad_out.shape[-1]), dtype=ctx.dtype)
        grad_w.index_add_(0, ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.dtype))
        return None, _scatter_rows(grad_w, ctx.group), None, None


def sharded_linear(x: torch.Tensor, shard: torch.Tensor, group: Group, rows: int) -> torch.Tensor:
    if group.size == 1:
        return F.linear(x, shard)
    return _ShardedLinear.apply(x, shard, group, rows)


def sharded_embedding(ids: torch.Tensor, shard: torch.Tensor, group: Group,
                      rows: int) -> torch.Tensor:
    if group.size == 1:
        return F.embedding(ids, shard)
    return _ShardedEmbedding.apply(ids, shard, group, rows)
