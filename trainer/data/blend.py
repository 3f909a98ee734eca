"""data.blend: several datasets mixed by weight, in Megatron's --data-path form (weight, path,
weight, path, ...; each path one of our dataset folders or a Megatron prefix).

Sample i of the mixture comes from part pattern[i % P], as that part's sample
(i // P) * count[part] + rank of i % P among the part's positions in the pattern. The pattern
of P = 4096 positions is Megatron's greedy blending order (each position goes to the part
furthest below its weight's share so far), so every period holds each part in proportion to
within one sample. A pure function of i, as each part's stream is: the same under every layout,
fetched in any order, and resumed from the consumed-sample count alone. No torch here (the
compose-time checks use it); the mixed stream is data.stream.BlendedStream.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

PERIOD = 4096


def parse_blend(values: Sequence[str]) -> list[tuple[float, str]]:
    """[(weight, path), ...] from data.blend; weights positive and finite (not normalised)."""
    if len(values) < 2 or len(values) % 2:
        raise ValueError(f"data.blend={list(values)} is not weight, path pairs. Fix: write it "
                         f"as Megatron's --data-path, e.g. data.blend=[0.3,/data/a,0.7,/data/b].")
    pairs = []
    for weight, path in zip(values[::2], values[1::2]):
        try:
            w = float(weight)
        except ValueError:
            w = math.nan
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"data.blend: weight {weight!r} of {path} is not a positive number. "
                             f"Fix: give each path a weight > 0 before it.")
        pairs.append((w, str(path)))
    return pairs


def blend_pattern(weights: Sequence[float], period: int = PERIOD
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(part of each position, its rank among that part's positions, samples per part)."""
    share = np.asarray(weights, dtype=np.float64) / sum(weights)
    taken = np.zeros(len(share), dtype=np.int64)
    part = np.empty(period, dtype=np.int64)
    rank = np.empty(period, dtype=np.int64)
    for i in range(period):
        d = int(np.argmax(share * (i + 1) - taken))
        part[i], rank[i] = d, taken[d]
        taken[d] += 1
    return part, rank, taken


def samples_per_part(weights: Sequence[float], count: int, period: int = PERIOD) -> list[int]:
    """How many samples of each part the first `count` samples of the mixture take."""
    part, _, per_period = blend_pattern(weights, period)
    whole, rest = divmod(count, period)
    return [int(whole * per_period[d] + (part[:rest] == d).sum()) for d in range(len(weights))]
