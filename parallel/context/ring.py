"""cp_comm_type=p2p: ring attention. Each rank of the context group keeps its two zigzag chunks
of q, k and v; K/V blocks travel around the group, one hop per step, the next hop in flight
while the current block is computed. After C steps every query chunk has seen every key chunk
it may see, merged by log-sum-exp in fp32. A rank holds its own tokens plus one block in
flight: O(local tokens), never the whole sequence.

Backward runs the ring again: K/V travel as in forward, and the gradients of each K/V block
travel with it, each rank adding its share, then take one last hop home to their owner. The
gradient hop starts after the rank's block is computed and completes while it computes the
next one. Messages between two neighbours are always posted in the same order on both sides
(K/V, then gradients, each step), which is what keeps the point-to-point pairs matched.
"""
from __future__ import annotations

import torch

from parallel.comm import Group
from parallel.context.chunks import Block, blocks
from parallel.context.kernels import Merge, attend_blocks, attend_blocks_backward, merged_output
from parallel.layout import Layout


class Ring:
    """The context group seen as a ring, and the blocks each step computes on this rank."""

    def __init__(self, group: Group, layout: Layout, rank: int):
        self.group, self.size = group, group.size
        chunks = [layout.context_chunk_ids(member) for member in group.ranks]
        mine = layout.context_chunk_ids(rank)
        # step i holds the K/V of the member i hops before this one
        self.steps: list[list[Block]] = [
            blocks(mine, chunks[(group.rank - i) % self.size]) for i in range(self.size)]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring):
        chunk = q.shape[2] // 2
        with torch.autocast(q.device.type, enabled=False):
            kv = torch.stack((k, v))
            merges = [Merge(), Merge()]
            for i, step in enumerate(ring.steps):
                hop = ring.group.start_shift([kv]) if i + 1 < ring.size else None
                attend_blocks(q, kv[0], kv[1], step, chunk, merges)
                if hop is not None:
                    kv = hop.wait()[0]
            out, lse = merged_output(merges, q)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, chunk, total = ctx.ring, q.shape[2] // 2, lse.dtype
        dq = torch.zeros(q.shape, dtype=total, device=q.device)
        kv = torch.stack((k, v))
        travelling = None  # the gradients of the K/V block this rank holds, on their way
        for i, step in enumerate(ring.steps):
            hop = ring.group.start_shift([kv]) if i + 1 < ring.size else None
            dkv = torch.zeros(kv.shape, dtype=total, device=q.device)
            attend_blocks_backward(grad_out, q, kv[0], kv[1], out, lse, step, chunk, dq,
                                   dkv[0], dkv[1])
            if travelling is not None:
                dkv += travelling.wait()[0]
            travelling = ring.group.start_shift([dkv])  # after the last step: home
            if hop is not None:
                kv = hop.wait()[0]
        dkv = travelling.wait()[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class RingAttention:
    """The model's attention_fn under runtime CP > 1 with cp_comm_type=p2p."""

    def __init__(self, context: Group, layout: Layout, rank: int):
        self.ring = Ring(context, layout, rank)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, self.ring)
