"""Context parallel: each rank of the `context` group (runtime CP = configured CP x sequence
shards) keeps two zigzag chunks of every sequence (chunks.py); attention over the whole
sequence is one of three exchanges, Megatron's cp_comm_type:

    p2p         ring.py      K/V blocks around a ring, overlapped with compute; O(local) memory;
                window.py    under a sliding window, only the chunks it reaches, from their owners
    all_gather  gather.py    K/V gathered whole, attention by chunk pairs; O(sequence) K/V
    a2a         alltoall.py  Ulysses: heads <-> sequence all-to-all; heads must divide by CP

All three run PyTorch's fused attention kernels (kernels.py) and build no mask, also over
packed documents (data.reset_attention_mask): calls.py cuts each chunk pair into kernel calls
over the rows and keys a document and a sliding window allow, and attention sinks join each
row's softmax once, after the merge (kernels.add_sinks).
"""
from __future__ import annotations

from typing import Callable

import torch

from parallel.build import Build
from parallel.comm import Group
from parallel.context.alltoall import AllToAllAttention
from parallel.context.chunks import keep_local, local_positions
from parallel.context.gather import AllGatherAttention
from parallel.context.linear import (
    AllToAllLinearAttention,
    GatheredLinearAttention,
    RelayLinearAttention,
)
from parallel.context.ring import RingAttention
from parallel.layout import Layout

ATTENTION = {"p2p": RingAttention, "all_gather": AllGatherAttention, "a2a": AllToAllAttention}
# linear attention's (Gated DeltaNet's linear_attention_fn): linear.py
LINEAR = {"p2p": RelayLinearAttention, "all_gather": GatheredLinearAttention,
          "a2a": AllToAllLinearAttention}
CP_COMM_TYPES = tuple(ATTENTION)

__all__ = ["CP_COMM_TYPES", "context_attention", "inject_attention", "keep_local",
           "local_positions"]


def context_attention(cp_comm_type: str, context: Group, layout: Layout, rank: int
                      ) -> Callable[..., torch.Tensor]:
    """The attention_fn for runtime CP > 1."""
    if cp_comm_type not in ATTENTION:
        raise ValueError(f"cp_comm_type={cp_comm_type!r}: expected one of {CP_COMM_TYPES}")
    return NarrowValues(ATTENTION[cp_comm_type](context, layout, rank))


class NarrowValues:
    """Values narrower than queries and keys (multi-latent attention's) through an exchange
    and kernels that take one width: v padded with zeros to q's width, the output's padding
    cut off. Exact (the zero columns add nothing to any output and get no gradient); the cost
    is the padding's share of the K/V exchanged and of the AV product."""

    def __init__(self, attention: Callable[..., torch.Tensor]):
        self.attention = attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: torch.Tensor | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None, logits: torch.Tensor | None = None
                 ) -> torch.Tensor:
        width = v.shape[-1]
        if width == q.shape[-1]:
            return self.attention(q, k, v, documents, window, sinks, logits)
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - width))
        return self.attention(q, k, v, documents, window, sinks, logits)[..., :width]


def inject_attention(build: Build) -> None:
    """The context axis's step of parallelize (wire): with runtime CP > 1, every module that
    calls an attention_fn calls the configured exchange instead, and every linear attention
    its exchange around its own core (linear.py)."""
    if build.layout.runtime_context_parallel_size == 1:
        return
    kind, context = build.options.cp_comm_type, build.groups.context
    attention = context_attention(kind, context, build.layout, build.rank)
    for module in build.model.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = attention
        if hasattr(module, "linear_attention_fn"):  # its own core, run on each rank's part
            module.linear_attention_fn = LINEAR[kind](module.linear_attention_fn, context,
                                                      build.layout, build.rank)
