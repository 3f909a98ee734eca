"""cp_comm_type=p2p under a sliding window (model.window_size): the K/V chunks the window reaches,
fetched straight from their owners, instead of a ring that carries every chunk past every rank.

A query chunk reaches a key chunk when the key chunk is not after it and its last key is within
the window of the query chunk's first row. With zigzag chunks and a window no longer than a chunk,
rank r needs only chunk r - 1 (from member r - 1) and chunk 2C - 2 - r (from member r + 1): two
chunks in, two chunks out, whatever C is, where the ring moves 2(C - 1) chunks each way and back
again in backward. Only the chunks someone reaches are sent; every rank computes the same plan from
the layout (parallel.layout.axes.context.window_exchange), so each send meets its receive. Where
a rank would receive more than two chunks (a window longer than about a chunk) the ring runs
instead: it skips the pairs the window never reaches and holds one block in flight, not all.

Forward: the messages start, the rank's own chunks are computed while they travel, then the
received ones; sinks are joined after both (kernels.add_sinks). The received K/V are kept for
backward (the window's reach, not the sequence: the memory plan counts them). Backward: the
received chunks' gradients first, sent home while the rank's own are computed, then added into
the gradients of its own K/V.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from parallel.comm import Group
from parallel.context.calls import Call, plan_calls
from parallel.context.kernels import (
    Merge,
    attend_calls,
    kv_gradients,
    lse_dtype,
    merged_output,
    sink_gradient,
)
from parallel.layout import Layout
from parallel.layout.axes.context import reached_slots, window_exchange

KV_SEQ_DIM = 3  # K and V stacked: [2, batch, groups, seq, head_dim]


class Exchange(NamedTuple):
    """What this rank sends and receives: (group rank, that member's chunk slots 0/1) each."""

    sends: list[tuple[int, list[int]]]
    receives: list[tuple[int, list[int]]]
    far: tuple[int, ...]  # the received chunks' global ids, in the received buffer's order


class WindowedPeers:
    """The context group's members and their chunks; the exchange a window needs."""

    def __init__(self, group: Group, layout: Layout, rank: int):
        self.group = group
        self.chunks = [layout.context_chunk_ids(member) for member in group.ranks]
        self.positions = [layout.runtime_cp_rank(member) for member in group.ranks]
        self.mine = layout.context_chunk_ids(rank)
        self._exchanges: dict[tuple[int, int], Exchange | None] = {}

    def exchange(self, chunk: int, window: int) -> Exchange | None:
        """The exchange for chunks of `chunk` tokens; None where the window reaches more than
        a ring step holds (Layout's window_exchange: the ring runs then)."""
        key = (chunk, window)
        if key not in self._exchanges:
            self._exchanges[key] = self._plan(chunk, window)
        return self._exchanges[key]

    def _plan(self, chunk: int, window: int) -> Exchange | None:
        size, me, at = self.group.size, self.group.rank, self.positions

        def needs(d: int, m: int) -> list[int]:  # slots of member m that member d reaches
            return reached_slots(at[d], at[m], size, chunk, window)
        if window_exchange(size, chunk, window) is None:
            return None
        sends = [(d, needs(d, me)) for d in range(size) if d != me and needs(d, me)]
        receives = [(m, needs(me, m)) for m in range(size) if m != me and needs(me, m)]
        far = tuple(self.chunks[m][s] for m, slots in receives for s in slots)
        return Exchange(sends, receives, far)

    def calls(self, exchange: Exchange, chunk: int, documents: torch.Tensor | None,
              window: int) -> tuple[list[Call], list[Call]]:
        """(calls over this rank's own chunks, calls over the received ones)."""
        return (plan_calls(self.mine, self.mine, chunk, documents, window),
                plan_calls(self.mine, exchange.far, chunk, documents, window))


def _slots(kv: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """The chunks `slots` of a rank's K/V (or their gradients): [2, b, groups, 2 chunk, d]."""
    if len(slots) == 2:
        return kv
    chunk = kv.shape[KV_SEQ_DIM] // 2
    return kv.narrow(KV_SEQ_DIM, slots[0] * chunk, chunk)


def _shape(kv: torch.Tensor, slots: list[int]) -> tuple[int, ...]:
    shape = list(kv.shape)
    shape[KV_SEQ_DIM] = shape[KV_SEQ_DIM] // 2 * len(slots)
    return tuple(shape)


class _WindowedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                exchange: Exchange, calls: tuple[list[Call], list[Call]],
                sinks: torch.Tensor | None, logits: torch.Tensor | None = None):
        with torch.autocast(q.device.type, enabled=False):
            kv = torch.stack((k, v))
            pending = group.start_exchange(
                [(d, _slots(kv, slots)) for d, slots in exchange.sends],
                [(m, _shape(kv, slots)) for m, slots in exchange.receives], kv)
            merge, own_aux, far_aux = Merge(q, lse_dtype(q)), {}, {}
            attend_calls(q, kv[0], kv[1], calls[0], merge, own_aux, logits)
            received = pending.wait()
            far = received[0] if len(received) == 1 else torch.cat(received, KV_SEQ_DIM)
            attend_calls(q, far[0], far[1], calls[1], merge, far_aux, logits)
            out, lse = merged_output(merge, q, sinks)
        ctx.group, ctx.exchange, ctx.calls, ctx.aux = group, exchange, calls, (own_aux, far_aux)
        ctx.save_for_backward(q, kv, far, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, kv, far, out, lse, sinks = ctx.saved_tensors
        exchange, total = ctx.exchange, lse.dtype
        dq = torch.zeros(q.shape, dtype=total, device=q.device)
        d_far = torch.zeros(far.shape, dtype=total, device=q.device)
        kv_gradients(grad_out, q, far, out, lse, ctx.calls[1], ctx.aux[1], dq, d_far)
        home = d_far.split([len(slots) * far.shape[KV_SEQ_DIM] // len(exchange.far)
                            for _, slots in exchange.receives], KV_SEQ_DIM)
        pending = ctx.group.start_exchange(
            [(m, piece) for (m, _), piece in zip(exchange.receives, home)],
            [(d, _shape(kv, slots)) for d, slots in exchange.sends], d_far)
        dkv = torch.zeros(kv.shape, dtype=total, device=q.device)
        kv_gradients(grad_out, q, kv, out, lse, ctx.calls[0], ctx.aux[0], dq, dkv)
        for (_, slots), grads in zip(exchange.sends, pending.wait()):
            _slots(dkv, slots).add_(grads)
        d_sinks = None if sinks is None else sink_gradient(grad_out, out, lse, sinks)
        return (dq.to(q.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), None, None, None,
                d_sinks, None)


def windowed_attention(peers: WindowedPeers, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       documents: torch.Tensor | None, window: int,
                       sinks: torch.Tensor | None, logits: torch.Tensor | None = None
                       ) -> torch.Tensor | None:
    """The attention of this rank's queries under the window, by the exchange; None where the
    window reaches everything (the ring's work then)."""
    chunk = q.shape[2] // 2
    exchange = peers.exchange(chunk, window)
    if exchange is None:
        return None
    calls = peers.calls(exchange, chunk, documents, window)
    return _WindowedAttention.apply(q, k, v, peers.group, exchange, calls, sinks, logits)
