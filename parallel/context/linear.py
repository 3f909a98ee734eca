"""Context parallel for linear attention (Gated DeltaNet's linear_attention_fn, trainer.model.
gdn): the same three cp_comm_types as softmax attention, over the same zigzag chunks.

    p2p         Relay: the recurrent state (and the convolution's last width-1 inputs) passed
                from each chunk's owner to the next chunk's, in sequence order; backward
                passes their gradients the other way.
    a2a         heads <-> sequence all-to-all, as Ulysses: each rank runs the whole sequence
                for 1/C of the key heads (and their value heads); the local key heads must
                divide by runtime CP.
    all_gather  every rank gathers the whole sequence of its TP rank's heads, runs it all and
                keeps its chunks' outputs; the gradients of the gathered inputs are
                reduce-scattered back. C times the rule's work, no state passing.

Zigzag under p2p: rank r holds chunks r and 2C-1-r, so the sequence order walks the ranks up
(chunks 0..C-1) and back down (C..2C-1): rank C-1 passes its first chunk's state to its own
second chunk, every other boundary is one message. The chain is sequential: a rank waits for
the state of the chunk before each of its chunks, so the rule's forward takes the time of the
whole sequence on one rank (2C chunk steps), and its backward likewise; what context parallel
still divides by C is every projection, the norm and the MLP, and the rule's memory. The
recurrent state is [value heads, key_dim, value_dim] a sample, whatever the sequence length:
two messages of it and the convolution's inputs per chunk boundary, each way.

The core (the layer's own linear_attention_fn: convolution and chunked rule from given inputs
and state) is called on each chunk; packed documents are the whole sequence's ids, so a chunk
knows whether its first token starts a document (then the state it receives is dropped, and
the convolution's taps into the previous chunk are masked by their documents).
"""
from __future__ import annotations

from typing import Callable

import torch

from parallel.comm import Group, Pending
from parallel.context.chunks import sequence_order
from parallel.layout import Layout
from parallel.regions import all_to_all, gather_along
from parallel.tensor import share_of_parts

Core = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _widths(mixed: torch.Tensor, g: torch.Tensor, dims: tuple[int, int]) -> list[int]:
    """q's, k's and v's widths in mixed q|k|v (this rank's heads)."""
    value = g.shape[-1] * dims[1]
    key = (mixed.shape[-1] - value) // 2
    return [key, key, value]


class AllToAllLinearAttention:
    """The linear_attention_fn under runtime CP > 1 with cp_comm_type=a2a."""

    def __init__(self, core: Core, context: Group, layout: Layout, rank: int):
        self.core, self.context = core, context
        self.order = sequence_order(layout, context.ranks)
        self.inverse = torch.argsort(self.order)

    def __call__(self, mixed, conv_weight, g, beta, ids, dims, before=None, state=None,
                 recurrent=False):
        c, me, chunks = self.context.size, self.context.rank, len(self.order)
        b, s, _ = mixed.shape
        widths = _widths(mixed, g, dims)
        heads = g.shape[-1]
        # part i: the i-th share of q's, k's and v's heads (and g's and beta's, in g's dtype:
        # fp32 under bf16) of every local token; gathered, our share of every token is q|k|v
        # of our heads: the core's input as it is
        parts = [t.unflatten(-1, (c, -1)) for t in mixed.split(widths, -1)]
        mine = self._gather(torch.cat(parts, -1))
        del parts
        rates = torch.stack([g, beta.to(g.dtype)], -1).unflatten(-2, (c, -1)).flatten(-2)
        g_mine, beta_mine = self._gather(rates).unflatten(-1, (-1, 2)).unbind(-1)
        conv = share_of_parts(conv_weight, widths, c, me)  # our heads' channels
        out, _ = self.core(mine, conv, g_mine, beta_mine, ids, dims)
        out = out.unflatten(1, (chunks, -1)).index_select(1, self.inverse.to(out.device))
        out = out.flatten(1, 2)  # group order
        out = out.unflatten(1, (c, -1)).movedim(1, 0)  # part j: member j's tokens, our heads
        back = all_to_all(out.contiguous(), self.context)  # part i: our tokens, i's heads
        return back.permute(1, 2, 0, 3, 4).reshape(b, s, heads, -1), None

    def _gather(self, parts: torch.Tensor) -> torch.Tensor:
        """[b, s, c, w] -> [b, c*s, w] in sequence order: every member's tokens of our share."""
        whole = all_to_all(parts.movedim(2, 0).contiguous(), self.context)  # [c, b, s, w]
        whole = whole.movedim(0, 1).flatten(1, 2)  # group order
        order = self.order.to(whole.device)
        return whole.unflatten(1, (len(self.order), -1)).index_select(1, order).flatten(1, 2)


class GatheredLinearAttention:
    """The linear_attention_fn under runtime CP > 1 with cp_comm_type=all_gather."""

    def __init__(self, core: Core, context: Group, layout: Layout, rank: int):
        self.core, self.context = core, context
        self.order = sequence_order(layout, context.ranks)
        mine = list(layout.context_chunk_ids(rank))
        self.mine = torch.tensor(mine)

    def __call__(self, mixed, conv_weight, g, beta, ids, dims, before=None, state=None,
                 recurrent=False):
        chunks = len(self.order)
        whole = [self._whole(t) for t in (mixed, g, beta)]
        out, _ = self.core(*whole[:1], conv_weight, *whole[1:], ids, dims)
        mine = self.mine.to(out.device)
        return out.unflatten(1, (chunks, -1)).index_select(1, mine).flatten(1, 2), None

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        gathered = gather_along(x.contiguous(), self.context, 1)  # group order
        order = self.order.to(x.device)
        return gathered.unflatten(1, (len(self.order), -1)).index_select(1, order).flatten(1, 2)


class RelayLinearAttention:
    """The linear_attention_fn under runtime CP > 1 with cp_comm_type=p2p: the state relayed
    from chunk to chunk in sequence order (the module docstring)."""

    def __init__(self, core: Core, context: Group, layout: Layout, rank: int):
        self.core, self.context = core, context
        self.mine = layout.context_chunk_ids(rank)  # in local order, ascending
        self.owner = {chunk: member for member, r in enumerate(context.ranks)
                      for chunk in layout.context_chunk_ids(r)}
        self.last = 2 * context.size - 1

    def __call__(self, mixed, conv_weight, g, beta, ids, dims, before=None, state=None,
                 recurrent=False):
        return _Relay.apply(mixed, conv_weight, g, beta, ids, dims, self), None

    def peer(self, chunk: int) -> int | None:
        """The member that holds `chunk`, None if this rank does or there is none."""
        if chunk < 0 or chunk > self.last or self.owner[chunk] == self.context.rank:
            return None
        return self.owner[chunk]


class _Relay(torch.autograd.Function):
    """Both of a rank's chunks, each from the state and inputs before it. Forward in sequence
    order, without a graph; it saves the inputs and what it received. Backward in reverse
    order: each chunk's forward is rebuilt from those (no message) and walked at once, so one
    chunk's graph is alive at a time, and the order of the messages is ours (autograd's
    choice between two chunks could wait on a neighbour that waits on us)."""

    @staticmethod
    def forward(ctx, mixed, conv_weight, g, beta, ids, dims, relay: RelayLinearAttention):
        length, width = mixed.shape[1] // 2, conv_weight.shape[-1]
        ctx.relay, ctx.length, ctx.dims, ctx.ids = relay, length, dims, ids
        outs, received, sends, carried = [], [], [], None
        for i, chunk in enumerate(relay.mine):
            state, tail = _incoming(relay, chunk, carried, mixed, g, dims, width)
            received += [state, tail]
            local = slice(i * length, (i + 1) * length)
            out, final, inputs = _chunk(relay, chunk, mixed[:, local], conv_weight,
                                        g[:, local], beta[:, local], ids, dims, state, tail)
            outs.append(out)
            carried, peer = None, relay.peer(chunk + 1)
            if chunk < relay.last and peer is None:
                carried = (final, inputs)
            elif peer is not None:
                sends += _send(relay.context, peer, chunk + 1, (final, inputs), 0)
        for pending in sends:
            pending.wait()
        ctx.save_for_backward(mixed, conv_weight, g, beta, *received)
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(ctx, grad):
        # first: under selective recompute this rebuilds the forward, messages and all, on
        # every rank at the same point (before any of backward's messages)
        mixed, conv_weight, g, beta, *received = ctx.saved_tensors
        relay, length = ctx.relay, ctx.length
        needs = ctx.needs_input_grad
        # each chunk's gradients written into their place (the weight's summed), no copy
        grads = [torch.zeros_like(t) if needs[j] else None
                 for j, t in enumerate((mixed, conv_weight, g, beta))]
        sends, carried = [], None
        for i in reversed(range(len(relay.mine))):
            chunk = relay.mine[i]
            local = slice(i * length, (i + 1) * length)
            leaves = [t.detach().requires_grad_(True) for t in (
                mixed[:, local], conv_weight, g[:, local], beta[:, local],
                *received[2 * i:2 * i + 2])]
            with torch.enable_grad():
                out, final, inputs = _chunk(relay, chunk, *leaves[:4], ctx.ids, ctx.dims,
                                            *leaves[4:])
            # the gradients of its final state and last inputs, from the chunk after it (none
            # after the last): the inputs' are a view of the chunk's own, added in place
            # below rather than through autograd (which would widen them to the chunk)
            outputs, given, d_inputs = [out], [grad[:, local]], None
            if chunk < relay.last:
                peer = relay.peer(chunk + 1)
                d_final, d_inputs = carried if peer is None else _receive(
                    relay.context, peer, chunk + 1, (final, inputs), 1)
                outputs.append(final)
                given.append(d_final)
            found = torch.autograd.grad(outputs, leaves, given, allow_unused=True)
            found = [torch.zeros_like(t) if d is None else d for t, d in zip(leaves, found)]
            for j, d in enumerate(found[:4]):
                if grads[j] is not None:  # the convolution's weight is the chunks' sum
                    (grads[j] if j == 1 else grads[j][:, local]).add_(d)
            if d_inputs is not None and d_inputs.numel() and grads[0] is not None:
                grads[0][:, local][:, length - d_inputs.shape[1]:].add_(d_inputs)
            # the tail's gradient is a narrow view of the convolution's input gradient: a copy
            # of its own, or it would keep all of that alive through the next chunk
            d_state, d_tail = found[4], found[5].clone()
            del out, final, inputs, leaves, found, outputs, given, d_inputs
            carried, peer = None, relay.peer(chunk - 1)
            if chunk > 0 and peer is None:
                carried = (d_state, d_tail)
            elif peer is not None:
                sends += _send(relay.context, peer, chunk, (d_state, d_tail), 1)
        for pending in sends:
            pending.wait()
        return (*grads, None, None, None)


def _chunk(relay: RelayLinearAttention, chunk: int, mixed, conv_weight, g, beta, ids, dims,
           state, tail):
    """The core on sequence chunk `chunk` (its mixed, g and beta) from `state` and `tail` (the
    convolution's inputs before it) -> (its output, its final state, its last width-1
    inputs). A document starting at the chunk's first token drops the state it received; the
    convolution's taps into the tail are masked by the documents they belong to."""
    width, length = conv_weight.shape[-1], mixed.shape[1]
    chunk_ids = before_ids = None
    if ids is not None:
        start = chunk * length
        chunk_ids = ids[:, start:start + length]
        before_ids = ids[:, start - width + 1:start] if start else None
        if start:
            state = state * (ids[:, start] == ids[:, start - 1]).to(state.dtype)[:, None, None,
                                                                                None]
    out, final = relay.core(mixed, conv_weight, g, beta, chunk_ids, dims, tail, state,
                            before_ids=before_ids)
    # the convolution's last width-1 inputs: a view of the chunk's own (the check refuses a
    # width past a chunk), not of a copy of its whole input
    inputs = mixed[:, length - (width - 1):]
    return out, final, inputs


def _incoming(relay: RelayLinearAttention, chunk: int, carried, mixed: torch.Tensor,
              g: torch.Tensor, dims: tuple[int, int], width: int):
    """The state and the convolution's last inputs before `chunk`: zeros before the first,
    this rank's own where it holds the chunk before, else received from its owner."""
    b, heads = mixed.shape[0], g.shape[-1]
    dtype = torch.promote_types(mixed.dtype, torch.float32)
    like = (torch.zeros(b, heads, *dims, dtype=dtype, device=mixed.device),
            mixed.new_zeros(b, width - 1, mixed.shape[-1]))
    if chunk == 0:
        return like
    if carried is not None:
        return carried
    return _receive(relay.context, relay.peer(chunk - 1), chunk, like, 0)


def _tag(boundary: int, which: int, direction: int) -> int:
    """A message's tag: the chunk boundary it crosses, state or inputs, forward or backward."""
    return 4 * boundary + 2 * direction + which


def _send(group: Group, peer: int, boundary: int, tensors, direction: int) -> list[Pending]:
    return [group.start_send(t.detach(), peer, _tag(boundary, i, direction))
            for i, t in enumerate(tensors) if t.numel()]


def _receive(group: Group, peer: int, boundary: int, like, direction: int):
    pending = [group.start_recv(t.shape, t.dtype, t.device, peer, _tag(boundary, i, direction))
               if t.numel() else None for i, t in enumerate(like)]
    return tuple(p.wait() if p is not None else torch.zeros_like(t)
                 for p, t in zip(pending, like))
