"""GTP_remat weight sharding: a TP-local weight stored as 1/G of its rows on each gtp_remat rank.

Rows are padded to a multiple of G. The full weight is all-gathered just before use in forward
and freed after; a linear layer gathers it again in backward (weight rematerialisation) and
reduce-scatters its gradient back to the shard, so only the shard persists between uses. The
linears of one transformer block form a ShardBundle: one collective for all of them instead of
one each (the shards, the optimizer and checkpoints do not change, only the messages merge).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.comm import Group


def shard_rows(rows: int, group: Group) -> int:
    """Rows each rank stores of a TP-local weight of `rows` (padded to a multiple of the
    group; Layout.shard_rows is the same rule for the plan)."""
    return -(-rows // group.size)


def gather_rows(shard: torch.Tensor, group: Group, rows: int) -> torch.Tensor:
    """The full TP-local weight from every rank's shard, padding removed."""
    if group.size == 1:
        return shard
    return group.all_gather(shard)[:rows]


def _scatter_rows(grad_full: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum the full-weight gradient over the group, keep this rank's (padded) rows."""
    rows = grad_full.shape[0]
    per_rank = shard_rows(rows, group)
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
        rows = grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.dtype)
        grad_w.index_add_(0, ids.reshape(-1), rows)
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


class ShardBundle:
    """Sharded linears of one block, gathered and reduce-scattered together: one message for
    all of them instead of one each. No assumption on how often a member runs per forward:

    forward: the first use gathers every member's weight; they are freed when the block's
    forward ends (release_forward, a forward hook on the block set by parallelize), so a
    member may run twice and a recomputed forward gathers again.
    backward: every use recorded in the autograd graph is counted; the first backward use
    gathers the weights again, each use's gradient is added to its member's, and when the
    last counted use is done one reduce-scatter returns all shard gradients.
    """

    def __init__(self, group: Group):
        self.group = group
        self.members: list[tuple[torch.nn.Parameter, int]] = []  # (shard, TP-local rows)
        self._forward: list[torch.Tensor] | None = None
        self._backward: list[torch.Tensor] | None = None
        self._pending = 0  # recorded uses whose backward has not run yet
        self._grads: dict[int, torch.Tensor] = {}

    def add(self, shard: torch.nn.Parameter, rows: int) -> int:
        self.members.append((shard, rows))
        return len(self.members) - 1

    def _gather(self) -> list[torch.Tensor]:
        shards = [shard.detach() for shard, _ in self.members]
        flat = torch.cat([shard.reshape(-1) for shard in shards])
        gathered = self.group.all_gather(flat).view(self.group.size, -1)  # row i: rank i's shards
        out, offset = [], 0
        for shard, (_, rows) in zip(shards, self.members):
            block = gathered[:, offset:offset + shard.numel()]
            out.append(block.reshape(self.group.size * shard.shape[0], *shard.shape[1:])[:rows])
            offset += shard.numel()
        return out

    def forward_weight(self, index: int, recorded: bool) -> torch.Tensor:
        """`recorded`: this use enters the autograd graph, so its backward will come."""
        if self._forward is None:
            self._forward = self._gather()
        self._pending += recorded
        return self._forward[index]

    def release_forward(self) -> None:
        self._forward = None

    def backward_weight(self, index: int) -> torch.Tensor:
        if self._backward is None:
            self._backward = self._gather()
        return self._backward[index]

    def add_grad(self, index: int, grad_full: torch.Tensor) -> None:
        previous = self._grads.get(index)
        self._grads[index] = grad_full if previous is None else previous + grad_full
        self._pending -= 1
        if self._pending > 0:
            return
        size = self.group.size
        parts = []
        for i, (shard, rows) in enumerate(self.members):
            grad = self._grads.get(i)
            if grad is None:  # a member this forward did not use
                grad = shard.new_zeros((rows, *shard.shape[1:]))
            parts.append(F.pad(grad, (0, 0, 0, shard.shape[0] * size - rows)).view(size, -1))
        mine = self.group.reduce_scatter(torch.cat(parts, dim=1).reshape(-1))
        offset = 0
        for shard, _ in self.members:
            grad = mine[offset:offset + shard.numel()].view_as(shard)
            offset += shard.numel()
            if shard.grad is None:
                shard.grad = grad.clone()
            else:
                shard.grad.add_(grad)
        self._grads.clear()
        self._backward = None


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now: a forward run from there is activation
    recompute, whose uses the original forward already counted."""
    return torch._C._current_graph_task_id() != -1


class _BundledLinear(torch.autograd.Function):
    """y = x @ W^T with W from its bundle; the shard's gradient goes through the bundle."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: torch.Tensor, bundle: ShardBundle, index: int,
                recorded: bool):
        ctx.bundle, ctx.index = bundle, index
        ctx.save_for_backward(x)
        return F.linear(x, bundle.forward_weight(index, recorded))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        (x,) = ctx.saved_tensors
        bundle, index = ctx.bundle, ctx.index
        weight = bundle.backward_weight(index).to(grad_y.dtype)
        grad_x = grad_y @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(
            grad_y.dtype)
        bundle.add_grad(index, grad_w.to(bundle.members[index][0].dtype))
        return grad_x, None, None, None, None  # the shard's gradient was added by the bundle


def bundled_linear(x: torch.Tensor, shard: torch.Tensor, bundle: ShardBundle,
                   index: int) -> torch.Tensor:
    # Autograd records the node (and will run its backward) only under grad mode with an input
    # that needs a gradient; inside Function.forward grad mode is always off, so decide here.
    recorded = (torch.is_grad_enabled() and (x.requires_grad or shard.requires_grad)
                and not _in_backward())
    return _BundledLinear.apply(x, shard, bundle, index, recorded)
