"""cp_comm_type=all_gather: K and V all-gathered over the context group (their gradients
reduce-scattered back), then each local query chunk attends to the key chunks before it in full
and to its own causally: two fused-kernel calls per chunk, merged by log-sum-exp, no mask. The
simple option: one collective per layer, but every rank holds the whole sequence's K/V. With a
sliding window the calls cover only the keys the window reaches; the gather is still whole.
"""
from __future__ import annotations

import torch

from parallel.comm import Group
from parallel.context.calls import Call, plan_calls
from parallel.context.chunks import sequence_order
from parallel.context.kernels import ChunkPairs
from parallel.layout import Layout
from parallel.regions import gather_along

HEAD_SEQ_DIM = 2  # q, k, v are [batch, heads, seq, head_dim]


class AllGatherAttention:
    """The model's attention_fn under runtime CP > 1 with cp_comm_type=all_gather."""

    def __init__(self, context: Group, layout: Layout, rank: int):
        self.context = context
        self.order = sequence_order(layout, context.ranks)  # gathered K/V in sequence order
        self.mine = layout.context_chunk_ids(rank)
        # without documents: by chunk length and window
        self._plain: dict[tuple[int, int | None], list[Call]] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: torch.Tensor | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None, logits: torch.Tensor | None = None
                 ) -> torch.Tensor:
        kv = gather_along(torch.stack((k, v)), self.context, HEAD_SEQ_DIM + 1)
        chunks = kv.unflatten(HEAD_SEQ_DIM + 1, (len(self.order), -1))
        kv = chunks.index_select(HEAD_SEQ_DIM + 1, self.order.to(kv.device)).flatten(3, 4)
        chunk = q.shape[2] // 2
        calls = self._plain.get((chunk, window)) if documents is None else None
        if calls is None:
            calls = plan_calls(self.mine, tuple(range(len(self.order))), chunk, documents,
                               window)
            if documents is None:
                self._plain[chunk, window] = calls
        return ChunkPairs.apply(q, kv[0], kv[1], calls, sinks, logits)
