"""An expert's capacity (model.moe_expert_capacity_factor, Megatron's key): which of the
(token, expert) pairs the router chose each expert keeps when it may run at most
C = ceil(tokens x top-k / experts x factor) of them (ModelConfig.expert_capacity), dropping
the rest by router weight (Megatron's moe_token_drop_policy=probs). Single-device code like
the router; `token_sum` is its hook for the ranks that hold other tokens of the micro-batch.

Megatron counts a capacity over each rank's own tokens, so what it drops depends on the
layout. Here C and the choice are the micro-batch's, whatever the layout: each expert keeps the
pairs whose weight is at least its C-th largest over the whole micro-batch. That weight is found
exactly by a radix select over the weights' bits (8 at a time: 4 rounds in fp32, 8 in fp64),
each round one sum of a [experts, 256] histogram over the ranks, so no rank gathers another's
weights. Pairs tied with the C-th largest weight are all kept (an expert may run a few more
than C on exact ties; no order among equal weights is needed, so every layout keeps the same).
"""
from __future__ import annotations

from typing import Callable

import torch

Sum = Callable[[torch.Tensor], torch.Tensor]
DIGIT = 8  # bits a round of the radix select decides
INTS = {torch.float32: torch.int32, torch.float64: torch.int64}


def keep_within_capacity(weights: torch.Tensor, chosen: torch.Tensor, counts: torch.Tensor,
                         limit: int, token_sum: Sum) -> tuple[torch.Tensor, torch.Tensor]:
    """weights, chosen [N, k] (each token's experts and their non-negative weights), counts
    [E] the micro-batch's pairs per expert (summed over the ranks) -> (keep [N, k] bool, the
    pairs the micro-batch drops, summed over the ranks)."""
    experts = counts.shape[0]
    full = counts > limit  # only these experts drop pairs
    expert = chosen.reshape(-1)
    # Non-negative floats order as their bit patterns do (as integers).
    key = weights.detach().reshape(-1).contiguous().view(INTS[weights.dtype]).to(torch.int64)
    bits = 8 * weights.element_size()
    need = torch.full((experts,), float(limit), dtype=torch.float64, device=weights.device)
    prefix = torch.zeros(experts, dtype=torch.int64, device=weights.device)
    for shift in range(bits - DIGIT, -1, -DIGIT):
        # Pairs whose higher digits equal their expert's prefix so far, by their next digit.
        rows, digit = expert, (key >> shift) & 255
        if shift + DIGIT < bits:
            match = (key >> (shift + DIGIT)) == prefix[expert]
            rows, digit = expert[match], digit[match]
        hist = torch.zeros(experts * 256, dtype=torch.float64, device=weights.device)
        hist = token_sum(hist.index_add_(0, rows * 256 + digit,
                                         torch.ones_like(digit, dtype=torch.float64)))
        hist = hist.view(experts, 256)
        at_least = hist.flip(1).cumsum(1).flip(1)  # [e, d]: pairs whose digit is d or more
        pick = ((at_least >= need[:, None]).sum(1) - 1).clamp(min=0)  # the largest such d
        above = torch.cat([at_least[:, 1:], at_least.new_zeros(experts, 1)], 1)
        need = need - above.gather(1, pick[:, None]).squeeze(1)
        ties = hist.gather(1, pick[:, None]).squeeze(1)
        prefix = (prefix << DIGIT) | pick
    threshold = torch.where(full, prefix, torch.zeros_like(prefix))
    keep = (key >= threshold[expert]).view_as(chosen)
    kept = torch.where(full, limit - need + ties, counts.to(torch.float64))
    return keep, counts.sum().to(torch.float64) - kept.sum()
