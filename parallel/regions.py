"""Autograd-aware collectives: each forward collective paired with its backward dual.

    copy_to        identity   | all-reduce    (input of a column-parallel layer without SP)
    reduce_from    all-reduce | identity      (output of a row-parallel layer without SP)
    gather_along   all-gather | reduce-scatter (SP before column-parallel; K/V for CP)
    scatter_along  reduce-scatter | all-gather (SP after row-parallel)
    all_to_all     all-to-all | all-to-all   (CP a2a: sequence-split <-> head-split)
    all_to_all_rows  variable all-to-all | the reverse (expert parallel's rows)

All are identities on a one-rank group. Incoming gradients are made contiguous before any
collective: gloo silently mixes up strided gradients.
"""
from __future__ import annotations

import torch

from parallel.comm import Group


def all_gather_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    front = x.movedim(dim, 0).contiguous()
    return group.all_gather(front).movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over {group}")
    front = x.movedim(dim, 0).contiguous()
    return group.reduce_scatter(front).movedim(0, dim)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.all_reduce(grad.contiguous().clone()), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return group.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_dim(grad.contiguous(), ctx.group, ctx.dim), None, None


class _ScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_dim(grad.contiguous(), ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, parts: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return group.all_to_all(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # the gradient of part j goes back to member j
        return ctx.group.all_to_all(grad.contiguous()), None


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, group: Group, send: list[int], receive: list[int]
                ) -> torch.Tensor:
        ctx.group, ctx.send, ctx.receive = group, send, receive
        return group.all_to_all_rows(rows, send, receive)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # each row's gradient back to the rank it came from
        return ctx.group.all_to_all_rows(grad.contiguous(), ctx.receive, ctx.send), None, None, \
            None


def copy_to(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFrom.apply(x, group)


def gather_along(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x if group.size == 1 else _GatherAlong.apply(x, group, dim)


def scatter_along(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x if group.size == 1 else _ScatterAlong.apply(x, group, dim)


def all_to_all(parts: torch.Tensor, group: Group) -> torch.Tensor:
    """parts [size, ...]: part i goes to group rank i; part j of the result came from rank j."""
    return parts if group.size == 1 else _AllToAll.apply(parts, group)


def all_to_all_rows(rows: torch.Tensor, group: Group, send: list[int], receive: list[int]
                    ) -> torch.Tensor:
    """The next send[i] rows (dim 0) to group rank i; returns the receive[j] rows rank j sent."""
    return rows if group.size == 1 else _AllToAllRows.apply(rows, group, send, receive)


def split_along(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's contiguous slice of `x` along dim (no communication, no autograd dual)."""
    size = x.shape[dim] // group.size
    return x.narrow(dim, group.rank * size, size)
