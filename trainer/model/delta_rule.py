"""The gated delta rule of Gated DeltaNet's layer (trainer.model.gdn): chunked, token by token,
and as torch.library operators for compiled blocks.

Each value head keeps a state S [key_dim, value_dim]. Token t decays it by exp(g_t), then
writes its value with strength beta_t where the key already reads something (the delta rule),
and its query reads it:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t

`gated_delta_rule` is the chunked form (chunks of CHUNK tokens, the state carried from chunk to
chunk), `recurrent_gated_delta_rule` the token-by-token recurrence it is held to (and what
generation decodes with). Within packed documents the state restarts at every document's first
token, exactly as separate sequences would.

Backward rebuilds one chunk at a time from the chunk's inputs and the state that entered it.
Eagerly that is autograd's own graph of the chunk (_ChunkedRule). Traced by torch.compile, a
backward that calls autograd ends the block's graph, forward and backward; a compiled block
calls the same loops as two operators instead (the backward's under torch.func.vjp: an
operator's inside runs below autograd), so the block stays one graph.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from trainer.parts.gdn import CHUNK

Tensor = torch.Tensor
# (q, k, v, g, beta of one chunk, its ids, the entering state's document, the entering state,
# the gradients of its output and final state) -> the gradients of the first five and the state
ChunkGrads = Callable[..., tuple[Tensor, ...]]


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     ids: Tensor | None = None, state: Tensor | None = None,
                     chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """The chunked gated delta rule. q, k [b, s, key heads, dk] (prepared), v [b, s, h, dv], g
    and beta [b, s, h] (h value heads, a multiple of the key heads), all in one dtype; ids
    [b, s] (trainer.model.gdn.document_ids) or None; state [b, h, dk, dv] the state before the
    first token (None: zeros), read by the first document only -> (o [b, s, h, dv], the state
    after the last token)."""
    b, s, h, dv = v.shape
    pad = -s % chunk
    n = (s + pad) // chunk
    if ids is None:
        ids = torch.zeros(b, s, dtype=torch.long, device=q.device)
    # padded positions write nothing (k, v, beta zero) and decay nothing (g zero): the final
    # state is the last token's
    ids = torch.cat([ids, ids[:, -1:].expand(b, pad)], dim=1).view(b, 1, n, chunk)
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2).reshape(*t.shape[:1], -1, n,
                                                                      chunk, t.shape[-1])
               for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)).transpose(1, 2).reshape(b, h, n, chunk)
               for t in (g, beta))
    if state is None:
        state = q.new_zeros(b, h, q.shape[-1], dv)
    if torch.compiler.is_compiling():
        o, final, _ = torch.ops.gtp.gated_delta_rule(q, k, v, g, beta, ids, state.to(q.dtype))
    else:
        o, final = _ChunkedRule.apply(q, k, v, g, beta, ids, state.to(q.dtype))
    return o.reshape(b, h, n * chunk, dv)[:, :, :s].transpose(1, 2), final


def _entering_documents(ids: Tensor) -> Tensor:
    """[b, 1, chunks]: the document of the state entering each chunk (the last token's before
    it; the first chunk's own first)."""
    return torch.cat([ids[:, :, :1, 0], ids[:, :, :-1, -1]], dim=2)


def _forward_chunks(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ids: Tensor,
                    state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The chunks in order, each from the state the one before left -> (the output, the final
    state, the state entering each chunk [chunks, b, h, dk, dv])."""
    n, prev = v.shape[2], _entering_documents(ids)
    # written in place chunk by chunk (a list then a stack would hold both at once)
    entering = state.new_empty(n, *state.shape)
    out = v.new_empty(*v.shape)
    for i in range(n):
        entering[i] = state
        out[:, :, i], state = _chunk_step(*(t[:, :, i] for t in (q, k, v, g, beta, ids)),
                                          prev[:, :, i], state)
    return out, state, entering


def _backward_chunks(d_out: Tensor, d_state: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                     g: Tensor, beta: Tensor, ids: Tensor, entering: Tensor,
                     chunk_grads: ChunkGrads) -> tuple[Tensor, ...]:
    """The chunks in reverse, each rebuilt from its inputs and entering state and walked back
    by `chunk_grads` -> the gradients of q, k, v, g, beta and the state before the first."""
    prev = _entering_documents(ids)
    grads = [torch.zeros_like(t) for t in (q, k, v, g, beta)]
    d_state = torch.zeros_like(entering[0]) if d_state is None else d_state
    for i in reversed(range(v.shape[2])):
        found = chunk_grads(*(t[:, :, i] for t in (q, k, v, g, beta, ids)), prev[:, :, i],
                            entering[i], d_out[:, :, i], d_state)
        for grad, d in zip(grads, found[:5]):
            grad[:, :, i] = d
        d_state = found[5]
        del found  # not alive through the next chunk's rebuild
    return (*grads, d_state)


def _autograd_chunk_grads(q, k, v, g, beta, ids, prev, state, d_out, d_state):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta, state)]
    with torch.enable_grad():
        o, final = _chunk_step(*leaves[:5], ids, prev, leaves[5])
    return torch.autograd.grad([o, final], leaves, [d_out, d_state])


def _vjp_chunk_grads(q, k, v, g, beta, ids, prev, state, d_out, d_state):
    _, vjp = torch.func.vjp(lambda *a: _chunk_step(*a[:5], ids, prev, a[5]),
                            q, k, v, g, beta, state)
    return vjp((d_out, d_state))


class _ChunkedRule(torch.autograd.Function):
    """The rule eagerly. It keeps its inputs and the state entering each chunk; backward
    rebuilds one chunk's step at a time from them (flash-linear-attention's way): the rule
    keeps O(tokens + chunks x state), never a chunk's C x C matrices for the whole sequence,
    and backward holds one chunk's graph at a time."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, ids, state):
        out, final, entering = _forward_chunks(q, k, v, g, beta, ids, state)
        ctx.save_for_backward(q, k, v, g, beta, ids, entering)
        return out, final

    @staticmethod
    def backward(ctx, d_out, d_state):
        *grads, d_state = _backward_chunks(d_out, d_state, *ctx.saved_tensors,
                                           _autograd_chunk_grads)
        return (*grads, None, d_state)


def _chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, ids: torch.Tensor, prev: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: q, k [b, key heads, C, dk], v [b, h, C, dv], g, beta [b, h, C], ids [b, 1, C],
    prev [b, 1] (the document of `state`, [b, h, dk, dv]) -> (o [b, h, C, dv], the state after
    the chunk).

    The delta rule's writes within the chunk are solved at once (a unit lower-triangular
    system: the UT transform), the state read and written once. Across documents every
    pairwise decay is zero, and so is a position's read of the carried state unless it is of
    the state's document: exact per document, with no loop over them."""
    chunk, share = v.shape[2], v.shape[1] // k.shape[1]
    if share > 1:  # each key head serves `share` value heads
        q, k = q.repeat_interleave(share, dim=1), k.repeat_interleave(share, dim=1)
    same = ids[..., :, None] == ids[..., None, :]  # [b, 1, C, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    cum = g.cumsum(-1)  # within the chunk; differences within a document are its decays
    pair = torch.where(same & causal, cum[..., :, None] - cum[..., None, :], -math.inf).exp()
    reads = torch.where(ids == prev[..., None], cum, -math.inf).exp()  # the state's decay
    last = ids[..., -1:]
    to_end = torch.where(ids == last, cum[..., -1:] - cum, -math.inf).exp()
    carried = torch.where(last[..., 0] == prev, cum[..., -1], -math.inf).exp()
    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * pair).tril(-1)  # I + this: writes' interplay
    system = system + torch.eye(chunk, dtype=q.dtype, device=q.device)
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                           unitriangular=True)
    keys_read = torch.linalg.solve_triangular(system, k_beta * reads[..., None], upper=False,
                                              unitriangular=True)
    new = values - keys_read @ state
    out = (q * reads[..., None]) @ state + ((q @ k.transpose(-1, -2)) * pair) @ new
    state = state * carried[..., None, None] + (k * to_end[..., None]).transpose(-1, -2) @ new
    return out, state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor,
                               ids: torch.Tensor | None = None,
                               state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule token by token (the definition; generation's decode step): the state
    restarts at zero at each document's first token."""
    b, s, h, dv = v.shape
    share = h // k.shape[2]
    if share > 1:
        q, k = q.repeat_interleave(share, dim=2), k.repeat_interleave(share, dim=2)
    state = q.new_zeros(b, h, k.shape[-1], dv) if state is None else state.to(q.dtype)
    out = []
    for t in range(s):
        if ids is not None and t > 0:
            state = state * (ids[:, t] == ids[:, t - 1]).to(q.dtype)[:, None, None, None]
        state = state * g[:, t].exp()[..., None, None]
        read = (state * k[:, t, :, :, None]).sum(-2)  # S^T k [b, h, dv]
        write = (v[:, t] - read) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * write[:, :, None, :]
        out.append((state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, dim=1), state


@torch.library.custom_op("gtp::gated_delta_rule", mutates_args=())
def _rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ids: Tensor,
          state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # contiguous, as the fake's: inductor may hand the operator strided views
    return tuple(t.contiguous() for t in _forward_chunks(q, k, v, g, beta, ids, state))


@_rule.register_fake
def _(q, k, v, g, beta, ids, state):
    return v.new_empty(v.shape), state.new_empty(state.shape), \
        state.new_empty(v.shape[2], *state.shape)


@torch.library.custom_op("gtp::gated_delta_rule_backward", mutates_args=())
def _rule_backward(d_out: Tensor, d_state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                   beta: Tensor, ids: Tensor, entering: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.contiguous() for t in _backward_chunks(d_out, d_state, q, k, v, g, beta, ids,
                                                          entering, _vjp_chunk_grads))


@_rule_backward.register_fake
def _(d_out, d_state, q, k, v, g, beta, ids, entering):
    return (*(t.new_empty(t.shape) for t in (q, k, v, g, beta)), d_state.new_empty(d_state.shape))


def _save(ctx, inputs, output) -> None:
    q, k, v, g, beta, ids, _ = inputs
    ctx.save_for_backward(q, k, v, g, beta, ids, output[2])


def _grads(ctx, d_out, d_final, _):
    q, k, v, g, beta, ids, entering = ctx.saved_tensors
    d_out = torch.zeros_like(v) if d_out is None else d_out
    d_final = torch.zeros_like(entering[0]) if d_final is None else d_final
    *grads, d_state = _rule_backward(d_out, d_final, q, k, v, g, beta, ids, entering)
    return (*grads, None, d_state)


torch.library.register_autograd("gtp::gated_delta_rule", _grads, setup_context=_save)
