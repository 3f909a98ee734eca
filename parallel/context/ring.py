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

Memory in backward (bench/context.py measures it): the travelling K/V alternate between the
saved K/V buffer and one more (so a backward runs once per forward, which the training step
does; a second one raises), a block's gradients are summed straight into the gradients
arriving for it, and our copy of those is let go as soon as the neighbour has it.
"""
from __future__ import annotations

import torch

from parallel.comm import Group
from parallel.context.calls import Call, plan_calls
from parallel.context.kernels import (
    Merge,
    added_kv,
    attend_calls,
    kv_gradients,
    lse_dtype,
    merged_output,
    sink_gradient,
)
from parallel.context.window import WindowedPeers, windowed_attention
from parallel.layout import Layout


class Ring:
    """The context group seen as a ring, and the calls each step computes on this rank."""

    def __init__(self, group: Group, layout: Layout, rank: int):
        self.group, self.size = group, group.size
        chunks = [layout.context_chunk_ids(member) for member in group.ranks]
        self.mine = layout.context_chunk_ids(rank)
        # step i holds the K/V of the member i hops before this one
        self.held = [chunks[(group.rank - i) % self.size] for i in range(self.size)]
        # without documents: by chunk length and window
        self._plain: dict[tuple[int, int | None], list[list[Call]]] = {}

    def steps(self, chunk: int, documents: torch.Tensor | None, window: int | None = None
              ) -> list[list[Call]]:
        """Each step's calls for chunks of `chunk` tokens (documents, window: see calls.py)."""
        if documents is None and (chunk, window) in self._plain:
            return self._plain[chunk, window]
        steps = [plan_calls(self.mine, held, chunk, documents, window) for held in self.held]
        if documents is None:
            self._plain[chunk, window] = steps
        return steps


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                steps: list[list[Call]], sinks: torch.Tensor | None,
                logits: torch.Tensor | None = None):
        with torch.autocast(q.device.type, enabled=False):
            kv = first = torch.stack((k, v))
            merge, aux = Merge(q, lse_dtype(q)), [{} for _ in steps]
            for i, step in enumerate(steps):
                hop = ring.group.start_shift([kv]) if i + 1 < ring.size else None
                attend_calls(q, kv[0], kv[1], step, merge, aux[i], logits)
                if hop is not None:
                    kv = hop.wait()[0]
            out, lse = merged_output(merge, q, sinks)
        ctx.ring, ctx.steps, ctx.aux = ring, steps, aux
        # K and V stacked (the ring's first block) are kept instead of k and v themselves, so
        # the qkv projection's output (v is a view of it) need not outlive the forward.
        ctx.save_for_backward(q, first, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if ctx.ring is None:
            raise RuntimeError("ring attention's backward runs once per forward: it reuses "
                               "its saved K/V buffer (retain_graph is not supported)")
        q, kv, out, lse, sinks = ctx.saved_tensors
        ring, total = ctx.ring, lse.dtype
        ctx.ring = None
        dq = torch.zeros(q.shape, dtype=total, device=q.device)
        travelling = None  # the gradients of the K/V block this rank holds, on their way
        spare = None  # the K/V buffer of two steps ago (from step 2 on, the saved one)
        for i, step in enumerate(ctx.steps):
            hop = None
            if i + 1 < ring.size:  # double-buffered: no third K/V block is ever allocated
                hop = ring.group.start_shift([kv], None if spare is None else [spare])
            if travelling is not None:  # the neighbour has taken them: free our copy
                travelling.wait_sent()
            if travelling is None:  # our own block: its gradients start here
                dkv = torch.zeros(kv.shape, dtype=total, device=q.device)
                kv_gradients(grad_out, q, kv, out, lse, step, ctx.aux[i], dq, dkv)
            else:  # added into the gradients arriving for this block, once they are here
                key_grads = kv_gradients(grad_out, q, kv, out, lse, step, ctx.aux[i], dq)
                dkv = added_kv(travelling.wait()[0], key_grads)
                del key_grads
            travelling = ring.group.start_shift([dkv])  # after the last step: home
            del dkv  # the shift holds it while it is sent
            if hop is not None:
                kv, spare = hop.wait()[0], kv
        dkv = travelling.wait()[0]
        d_sinks = None if sinks is None else sink_gradient(grad_out, out, lse, sinks)
        return (dq.to(q.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), None, None, d_sinks,
                None)


class RingAttention:
    """The model's attention_fn under runtime CP > 1 with cp_comm_type=p2p: the ring, or under
    a sliding window that leaves chunks unreached, the window's exchange (window.py)."""

    def __init__(self, context: Group, layout: Layout, rank: int):
        self.ring = Ring(context, layout, rank)
        self.peers = WindowedPeers(context, layout, rank)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: torch.Tensor | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None, logits: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if window is not None:
            out = windowed_attention(self.peers, q, k, v, documents, window, sinks, logits)
            if out is not None:
                return out
        return _RingAttention.apply(q, k, v, self.ring,
                                    self.ring.steps(q.shape[2] // 2, documents, window), sinks,
                                    logits)
