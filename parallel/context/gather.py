"""cp_comm_type=all_gather: K and V all-gathered over the context group (their gradients
reduce-scattered back), then each local query chunk attends to the key chunks before it in full
and to its own causally: two fused-kernel calls per chunk, merged by log-sum-exp, no mask. The
simple option: one collective per layer, but every rank holds the whole sequence's K/V.
"""
from __future__ import annotations

import torch

from parallel.comm import Group
from parallel.context.calls import Call, plan_calls
from parallel.context.chunks import sequence_order
from parallel.context.kernels import (
    Merge,
    attend_calls,
    call_gradients,
    lse_dtype,
    merged_output,
)
from parallel.layout import Layout
from parallel.regions import gather_along

HEAD_SEQ_DIM = 2  # q, k, v are [batch, heads, seq, head_dim]


class ChunkPairs(torch.autograd.Function):
    """Local queries over the whole sequence's keys and values (in sequence order), by calls
    (calls.plan_calls)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: list[Call]):
        with torch.autocast(q.device.type, enabled=False):
            merge, aux = Merge(q, lse_dtype(q)), {}
            attend_calls(q, k, v, calls, merge, aux)
            out, lse = merged_output(merge, q)
        ctx.calls, ctx.aux = calls, aux
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = (torch.zeros(t.shape, dtype=lse.dtype, device=t.device) for t in (q, k, v))
        for samples, rows, keys, grads in call_gradients(grad_out, q, k, v, out, lse, ctx.calls,
                                                         ctx.aux):
            for total, grad in zip((dq[samples, :, rows], dk[samples, :, keys],
                                    dv[samples, :, keys]), grads):
                total += grad
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class AllGatherAttention:
    """The model's attention_fn under runtime CP > 1 with cp_comm_type=all_gather."""

    def __init__(self, context: Group, layout: Layout, rank: int):
        self.context = context
        self.order = sequence_order(layout, context.ranks)  # gathered K/V in sequence order
        self.mine = layout.context_chunk_ids(rank)
        self._plain: dict[int, list[Call]] = {}  # without documents: by chunk length

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
        kv = gather_along(torch.stack((k, v)), self.context, HEAD_SEQ_DIM + 1)
        chunks = kv.unflatten(HEAD_SEQ_DIM + 1, (len(self.order), -1))
        kv = chunks.index_select(HEAD_SEQ_DIM + 1, self.order.to(kv.device)).flatten(3, 4)
        chunk = q.shape[2] // 2
        calls = self._plain.get(chunk) if documents is None else None
        if calls is None:
            calls = plan_calls(self.mine, tuple(range(len(self.order))), chunk, documents)
            if documents is None:
                self._plain[chunk] = calls
        return ChunkPairs.apply(q, kv[0], kv[1], calls)
