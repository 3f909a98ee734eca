"""cp_comm_type=a2a (Ulysses): an all-to-all over the context group turns sequence-split q, k, v
(all local heads, this rank's tokens) into head-split ones (1/C of the heads, the whole
sequence); attention then runs locally, causally, in one fused call, and a second all-to-all
returns the output to sequence-split form. Each rank holds 1/C of the heads of the whole
sequence, as many bytes as its own tokens of all heads. The local heads must divide by the
runtime CP (checked at compose time). Attention sinks: each rank joins its heads' own.

The whole sequence arrives in group order (member j's two zigzag chunks, then member j+1's);
it is put in sequence order for the causal kernel and back afterwards, chunk by chunk. Packed
documents or a sliding window (calls.py): the calls they allow over the whole sequence.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.comm import Group
from parallel.context.calls import plan_calls
from parallel.context.chunks import sequence_order
from parallel.context.kernels import ChunkPairs, record_logits
from parallel.layout import Layout
from parallel.regions import all_to_all


class AllToAllAttention:
    """The model's attention_fn under runtime CP > 1 with cp_comm_type=a2a."""

    def __init__(self, context: Group, layout: Layout, rank: int):
        self.context = context
        self.order = sequence_order(layout, context.ranks)
        self.inverse = torch.argsort(self.order)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: torch.Tensor | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None, logits: torch.Tensor | None = None
                 ) -> torch.Tensor:
        b, heads, s, d = q.shape
        groups = k.shape[1]  # K/V heads (fewer than heads under grouped-query attention)
        c, chunks = self.context.size, len(self.order)
        order, inverse = self.order.to(q.device), self.inverse.to(q.device)
        # [b, heads + 2 groups, s, d] -> part i: heads i*heads/c.. and groups i*groups/c.. of
        # every local token, to member i (so each member keeps its query heads' K/V groups)
        split = [t.unflatten(1, (c, t.shape[1] // c)) for t in (q, k, v)]
        parts = torch.cat(split, dim=2).movedim(1, 0)
        whole = all_to_all(parts, self.context)  # part j: member j's tokens of our heads
        whole = whole.movedim(0, 2).flatten(2, 3)  # [b, (heads + 2 groups)/c, c * s, d]
        whole = whole.unflatten(2, (chunks, -1)).index_select(2, order).flatten(2, 3)
        q, k, v = whole.split([heads // c, groups // c, groups // c], dim=1)
        share = heads // c  # this rank's heads: rank * share onwards of the local heads
        if logits is not None:
            record_logits(q, k, plan_calls((0,), (0,), q.shape[2], documents, window),
                          logits[self.context.rank * share:][:share])
        if documents is None and window is None and sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=groups != heads)
        else:  # the whole sequence is here: the calls documents and window allow
            mine = None if sinks is None else sinks[self.context.rank * share:][:share]
            out = ChunkPairs.apply(q, k, v, plan_calls((0,), (0,), q.shape[2], documents,
                                                       window), mine)
        out = out.unflatten(2, (chunks, -1)).index_select(2, inverse)  # back to group order
        out = out.unflatten(2, (c, -1)).flatten(3, 4).movedim(2, 0)  # part j: member j's tokens
        back = all_to_all(out, self.context)  # part i: our tokens of heads i*heads/c..
        # one copy into [b, s, heads, d] memory order, so the model's reshape after is free
        return back.permute(1, 3, 0, 2, 4).reshape(b, s, heads, d).transpose(1, 2)
