"""Muon's arithmetic without torch: the matrices it orthogonalises for a parameter, what a
matrix's Newton-Schulz iteration costs, the update's scale, and which rank orthogonalises which
matrix (trainer.parts.matrices says which parameters Muon takes; trainer.train.muon runs it).
"""
from __future__ import annotations

from parallel.layout.parallel_plan import ParallelPlan


def scale_factor(rows: int, cols: int, mode: str) -> float:
    if mode == "spectral":  # Kimi's: sqrt(max), with extra 0.2 AdamW's update RMS (Moonlight)
        return max(rows, cols) ** 0.5
    if mode == "shape_scaling":  # Keller Jordan's: torch.optim.Muon's "original"
        return max(1.0, rows / cols) ** 0.5
    if mode == "unit_rms_norm":  # Scion's
        return (rows / cols) ** 0.5
    raise ValueError(f"unknown muon scale mode {mode!r}")


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """One matrix's Newton-Schulz FLOPs: per step, on X of m x n (m <= n), the Gram matrix
    X X^T (2 m^2 n), its square (2 m^3) and the product with X (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def row_splits(name: str, shape: tuple[int, ...], plan: ParallelPlan, split: bool
               ) -> tuple[int, ...]:
    """The row blocks Muon orthogonalises apart within each matrix of parameter `name`: a fused
    q/k/v or gate/up projection's parts with optim.muon_split_qkv, else all its rows."""
    rows = shape[-2]
    if not split:
        return (rows,)
    module, _, leaf = name.rpartition(".")
    if len(shape) == 3:
        dim, parts = plan.expert_splits.get(leaf, (1, (1,)))
        parts = parts if dim == 1 else (1,)
    else:
        style, parts = plan.linear_style(module)
    return tuple(rows * p // sum(parts) for p in parts)


def matrices(name: str, shape: tuple[int, ...], plan: ParallelPlan, split: bool
             ) -> list[tuple[int, int]]:
    """The (rows, cols) matrices Muon orthogonalises for parameter `name`: one per expert of a
    3-D weight, each cut into its row blocks."""
    count = shape[0] if len(shape) == 3 else 1
    return [(rows, shape[-1]) for rows in row_splits(name, shape, plan, split)] * count


def assign_owners(costs: list[int], slots: int) -> list[int]:
    """Each matrix's owner among `slots` ranks, balancing the sum of costs: the costliest first,
    each to the least loaded slot (the lowest index on a tie), so every rank computes the same
    answer from the same list (longest-processing-time-first: at most 4/3 of the optimum)."""
    loads, owner = [0] * slots, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        slot = min(range(slots), key=lambda s: loads[s])
        owner[i] = slot
        loads[slot] += costs[i]
    return owner
