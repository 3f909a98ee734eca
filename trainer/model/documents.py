"""Causal attention within packed documents on one rank (data.reset_attention_mask): one kernel
call per document of each sample, no mask (a variable-length loop; torch has no such kernel on
CPU).

Where the documents end is read from the data on the host, so the number and the shapes of the
calls are the data's. Traced by torch.compile, that read ends the block's graph (dynamo:
"Dynamic shape operator", aten.nonzero) in every block, forward and backward. A compiled block
calls the same loop as a torch.library operator instead (its backward another, which runs the
forward again under torch.func.vjp: an operator's inside is not traced, nor kept for
backward), so the block stays one graph. Eager blocks call the loop directly and keep its
autograd graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: torch.Tensor) -> torch.Tensor:
    """q [batch, heads, seq, head_dim], k and v [batch, groups, seq, head_dim]; documents
    [batch, seq]: where each position's document starts (any value that changes at a document's
    first position does)."""
    gqa = k.shape[1] != q.shape[1]  # the fused kernels read each K/V group for its query heads
    rows = []
    for b, row in enumerate(documents):
        edges = [0, *((row[1:] != row[:-1]).nonzero().flatten() + 1).tolist(), row.numel()]
        pieces = [F.scaled_dot_product_attention(q[b:b + 1, :, a:e], k[b:b + 1, :, a:e],
                                                 v[b:b + 1, :, a:e], is_causal=True,
                                                 enable_gqa=gqa)
                  for a, e in zip(edges, edges[1:])]
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows)


@torch.library.custom_op("gtp::document_attention", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             documents: torch.Tensor) -> torch.Tensor:
    with torch.autocast(q.device.type, enabled=False):  # the caller cast: the fake's dtype
        return per_document(q, k, v, documents).contiguous()  # as the fake's


@_forward.register_fake
def _(q, k, v, documents):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("gtp::document_attention_backward", mutates_args=())
def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # torch.func: an operator's inside runs below autograd, where a plain backward records nothing
    with torch.autocast(q.device.type, enabled=False):
        _, vjp = torch.func.vjp(lambda *qkv: per_document(*qkv, documents), q, k, v)
        dq, dk, dv = vjp(grad)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()  # as the fake's


@_backward.register_fake
def _(grad, q, k, v, documents):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _grads(ctx, grad):
    return (*_backward(grad, *ctx.saved_tensors), None)


torch.library.register_autograd("gtp::document_attention", _grads, setup_context=_save)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       documents: torch.Tensor) -> torch.Tensor:
    """per_document's result; inside a compiled region, by the operator (one graph)."""
    if not torch.compiler.is_compiling():
        return per_document(q, k, v, documents)
    device = q.device.type
    if torch.is_autocast_enabled(device):  # what the kernel's autocast would have cast to
        dtype = torch.get_autocast_dtype(device)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    return _forward(q, k, v, documents)
