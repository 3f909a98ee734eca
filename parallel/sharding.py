"""GTP_remat weight sharding: a TP-local weight stored as 1/G of its rows on each gtp_remat rank.

Rows are padded to a multiple of G. The full weight is all-gathered just before use in forward
and freed after; a linear layer gathers it again in backward (weight rematerialisation) and
reduce-scatters its gradient back to the shard, so only the shard persists between uses. Here:
the layers gathered one by one (embedding, head); a transformer block's linears share one
message (parallel.bundle). Under bf16 the messages may be bf16 (CommDtypes); the shards stay.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from parallel.comm import Group
from parallel.weight_grads import DeferredWeightGrads, accumulate


@dataclass(frozen=True)
class CommDtypes:
    """The dtypes GTP_remat moves: gathered weights (`gather`) and reduce-scattered gradients
    (`reduce`); None: the master shard's own (fp32). Under bf16 autocast a gathered weight is
    cast to bf16 before use anyway, so gathering the bf16 copy gives the same values for half
    the bytes. Master shards, their gradients and Adam moments keep their dtype."""

    gather: torch.dtype | None = None
    reduce: torch.dtype | None = None


IN_MASTER_DTYPE = CommDtypes()  # every message in the shards' own dtype


def shard_rows(rows: int, group: Group) -> int:
    """Rows each rank stores of a TP-local weight of `rows` (padded to a multiple of the
    group; Layout.shard_rows is the same rule for the plan)."""
    return -(-rows // group.size)


def gather_rows(shard: torch.Tensor, group: Group, rows: int,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full TP-local weight from every rank's shard, padding removed, moved in `dtype`
    (None: the shard's)."""
    if dtype is not None:
        shard = shard.to(dtype)
    if group.size == 1:
        return shard
    return group.all_gather(shard)[:rows]


def _scatter_rows(grad_full: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum the full-weight gradient over the group (in its dtype), keep this rank's (padded)
    rows."""
    rows = grad_full.shape[0]
    per_rank = shard_rows(rows, group)
    if per_rank * group.size != rows:
        grad_full = F.pad(grad_full, (0, 0, 0, per_rank * group.size - rows))
    return group.reduce_scatter(grad_full)


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x as autocast would feed it to a matmul: saved for backward in that dtype, it costs half
    under bf16 (custom autograd Functions get no autocast casts of their own)."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return x.to(torch.get_autocast_dtype(kind))
    return x


def linear_weight_grad(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW of y = x @ W^T: the matmul autograd runs for F.linear (grad_y^T x, 2-D), in grad_y's
    dtype."""
    return grad_y.reshape(-1, grad_y.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]).to(
        grad_y.dtype))


def held_input(x: torch.Tensor) -> torch.Tensor:
    """A linear's saved input as its weight gradient holds it, perhaps until W: without its
    graph. Under activation recompute it is the rebuilt tensor, whose rebuilt graph never runs
    backward; held with it, that graph would keep the rebuilt block's input and saved tensors
    alive until W."""
    return x.detach()


def _deferred(store: DeferredWeightGrads | None, param: torch.Tensor,
              weight_grad: Callable[[], torch.Tensor], *holds: torch.Tensor) -> bool:
    """Leave `param`'s gradient (computed from `holds`) for W where a split backward's I is
    running (True); else the caller returns it to autograd, as a whole backward does."""
    return store is not None and store.defer(lambda: accumulate(param, weight_grad()), *holds)


class _SplitLinear(torch.autograd.Function):
    """F.linear as autograd runs it (the same saved tensors: the input and the weight in the
    compute dtype; the same matmuls), with the weight's gradient left for W inside a split
    backward's I (parallel.weight_grads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, store: DeferredWeightGrads):
        x = autocast_input(x)
        used = weight.to(x.dtype)
        # The parameter itself, not a saved tensor: activation recompute hands saved tensors
        # back detached, and a deferred gradient must reach the parameter's own .grad.
        ctx.store, ctx.weight = store, weight
        ctx.save_for_backward(x, used)
        return F.linear(x, used)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        (x, used), weight = ctx.saved_tensors, ctx.weight
        x = held_input(x)
        grad_x = grad_y @ used if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None

        def weight_grad() -> torch.Tensor:
            return linear_weight_grad(grad_y, x).to(weight.dtype)

        if _deferred(ctx.store, weight, weight_grad, grad_y, x):
            return grad_x, None, None
        return grad_x, weight_grad(), None


class _ShardedLinear(torch.autograd.Function):
    """y = x @ W^T with W gathered in forward, gathered again in backward, never saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: torch.Tensor, group: Group, rows: int,
                dtypes: CommDtypes, store: DeferredWeightGrads | None = None):
        ctx.group, ctx.rows, ctx.dtypes, ctx.store = group, rows, dtypes, store
        ctx.shard = shard  # the parameter (recompute hands saved tensors back detached)
        x = autocast_input(x)
        ctx.save_for_backward(x, shard)
        return F.linear(x, gather_rows(shard, group, rows, dtypes.gather))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, shard = ctx.saved_tensors
        x = held_input(x)
        # Under autocast the forward ran in grad_y's dtype; backward runs outside autocast, so
        # it casts explicitly. The gradient is summed in the reduce dtype (default: the
        # shard's) and returns to the shard's (master) dtype.
        weight = gather_rows(shard, ctx.group, ctx.rows, ctx.dtypes.gather).to(grad_y.dtype)
        grad_x = grad_y @ weight if ctx.needs_input_grad[0] else None
        del weight
        if not ctx.needs_input_grad[1]:  # a frozen weight (peft=lora's base): nothing to sum
            return grad_x, None, None, None, None, None

        group, reduce = ctx.group, ctx.dtypes.reduce or shard.dtype

        def weight_grad() -> torch.Tensor:  # reduce-scattered where it is formed (in W)
            grad_w = _scatter_rows(linear_weight_grad(grad_y, x).to(reduce), group)
            return grad_w.to(shard.dtype)

        if _deferred(ctx.store, ctx.shard, weight_grad, grad_y, x):
            return grad_x, None, None, None, None, None
        return grad_x, weight_grad(), None, None, None, None


class _ShardedEmbedding(torch.autograd.Function):
    """Lookup in a gathered table; the backward needs only the ids, so no second gather.

    The rows come back in the shard's dtype, so the residual stream stays in the master dtype
    (autocast leaves embeddings alone); with a gather dtype their values are that dtype's, on
    one rank too (the looked-up rows rounded: the same values as a rounded table), so every
    layout trains the same model. The gradient is summed in the master dtype."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, shard: torch.Tensor, group: Group, rows: int,
                dtypes: CommDtypes):
        ctx.group, ctx.rows, ctx.dtype, ctx.reduce = group, rows, shard.dtype, dtypes.reduce
        ctx.save_for_backward(ids)
        if group.size == 1:
            return F.embedding(ids, shard).to(dtypes.gather).to(shard.dtype)
        return F.embedding(ids, gather_rows(shard, group, rows, dtypes.gather)).to(shard.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        grad_w = grad_out.new_zeros((ctx.rows, grad_out.shape[-1]), dtype=ctx.dtype)
        rows = grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.dtype)
        grad_w.index_add_(0, ids.reshape(-1), rows)
        grad_w = _scatter_rows(grad_w.to(ctx.reduce or ctx.dtype), ctx.group)
        return None, grad_w.to(ctx.dtype), None, None, None


def sharded_linear(x: torch.Tensor, shard: torch.Tensor, group: Group, rows: int,
                   dtypes: CommDtypes = IN_MASTER_DTYPE,
                   weight_grads: DeferredWeightGrads | None = None) -> torch.Tensor:
    """weight_grads: set where the schedule splits the backward (its weight gradient may
    wait for W)."""
    if group.size == 1 and weight_grads is None:  # autocast casts the weight itself
        return F.linear(x, shard)
    if group.size == 1:
        return _SplitLinear.apply(x, shard, weight_grads)
    return _ShardedLinear.apply(x, shard, group, rows, dtypes, weight_grads)


def sharded_embedding(ids: torch.Tensor, shard: torch.Tensor, group: Group, rows: int,
                      dtypes: CommDtypes = IN_MASTER_DTYPE) -> torch.Tensor:
    if group.size == 1 and dtypes.gather is None:
        return F.embedding(ids, shard)
    return _ShardedEmbedding.apply(ids, shard, group, rows, dtypes)
