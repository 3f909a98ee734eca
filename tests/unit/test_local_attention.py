"""One process's sliding window and attention sinks (trainer.model.attention.causal_attention)
against their definition, written here as a dense masked softmax with a sink column: query i
sees key j when its document's start <= j <= i and i - window <= j; a sink is one more logit per
head in every row's softmax, whose value is zero. Outputs and the gradients of q, k, v and the
sinks, in fp64, with grouped-query heads and packed documents; and a wrong window or a dropped
sink moves the output far past the tolerance (so the comparison can fail)."""
from __future__ import annotations

import itertools

import pytest
import torch

from trainer.model.attention import causal_attention

B, HEADS, GROUPS, SEQ, DIM = 2, 4, 2, 24, 8


def dense(q, k, v, starts, window, sinks):
    """softmax(q k^T / sqrt(d) masked, with a sink column) v, every score formed."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    i, j = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]
    allowed = (j <= i).expand(q.shape[0], SEQ, SEQ)
    if starts is not None:
        allowed = allowed & (starts[:, :, None] <= j)
    if window is not None:
        allowed = allowed & (j >= i - window)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        column = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = scores.softmax(-1)
    return (probs[..., :SEQ] if sinks is not None else probs) @ v


def inputs(seed: int, sinks: bool):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64,  # noqa: E731
                                      requires_grad=True)
    q, k, v = make(B, HEADS, SEQ, DIM), make(B, GROUPS, SEQ, DIM), make(B, GROUPS, SEQ, DIM)
    return q, k, v, (make(HEADS) if sinks else None)


def documents() -> torch.Tensor:
    starts = torch.zeros(B, SEQ, dtype=torch.int64)
    for b, cuts in enumerate(([5, 17], [11])):
        for cut in cuts:
            starts[b, cut:] = cut
    return starts


@pytest.mark.parametrize("window,sinks,packed", [
    case for case in itertools.product([None, 1, 3, 7, 20, 40], [False, True], [False, True])
    if case[0] is not None or case[1]])
def test_window_and_sinks_are_the_masked_softmax(window, sinks, packed):
    q, k, v, s = inputs(window or 0, sinks)
    starts = documents() if packed else None
    got, want = causal_attention(q, k, v, starts, window, s), dense(q, k, v, starts, window, s)
    assert (got - want).abs().max() < 1e-12
    grad = torch.randn_like(want)
    leaves = [t for t in (q, k, v, s) if t is not None]
    ours, theirs = torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)
    for a, b in zip(ours, theirs):
        assert (a - b).abs().max() < 1e-12


def test_a_wrong_window_or_a_dropped_sink_is_far_off():
    q, k, v, s = inputs(0, True)
    want = dense(q, k, v, None, 3, s)
    assert (causal_attention(q, k, v, None, 4, s) - want).abs().max() > 1e-2
    assert (causal_attention(q, k, v, None, 3, None) - want).abs().max() > 1e-2
