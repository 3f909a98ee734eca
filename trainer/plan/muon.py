"""Muon's arithmetic without torch: the matrices it orthogonalises for a parameter, what a
matrix's Newton-Schulz iteration costs, the update's scale, and which rank orthogonalises which
matrix (trainer.parts.matrices says which parameters Muon takes; trainer.train.muon runs it).
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel.layout import Layout
from parallel.layout.parallel_plan import ParallelPlan
from trainer.config import ModelConfig, OptimConfig
from trainer.parts.assembly import parallel_plan
from trainer.parts.matrices import muon_names


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
        _, parts = plan.linear_style(module)
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


@dataclass(frozen=True)
class HeldMatrix:
    """One matrix of a Muon buffer as its tile holds it (trainer.train.muon.MuonExchange)."""

    blocks: tuple[tuple[int, int], ...]  # (rows, cols) of each block orthogonalised apart
    sends: tuple[int, ...]  # elements each tile rank sends its owner
    stores: tuple[int, ...]  # elements each tile rank stores (and gets back)

    @property
    def numel(self) -> int:
        return sum(r * c for r, c in self.blocks)

    def cost(self, steps: int) -> int:
        return sum(ns_flops(r, c, steps) for r, c in self.blocks)


def held_matrices(name: str, shape: tuple[int, ...], style: str, layout: Layout,
                  blocks: tuple[int, ...]) -> list[HeldMatrix]:
    """Parameter `name`'s matrices as this stage's tile holds them: a TP-split weight's rows
    over GTP_remat (padded as parallel.sharding pads them), a whole weight sent by tile rank 0
    and stored by all, an expert's over ETP (`style`: column, row, whole or expert)."""
    rows, cols = shape[-2:]
    split = tuple((r, cols) for r in blocks)
    if style == "whole":
        tile = layout.weight_tile_size
        numel = rows * cols
        return [HeldMatrix(split, (numel,) + (0,) * (tile - 1), (numel,) * tile)]
    if style == "expert":  # one matrix per expert on this rank, each over ETP
        etp = layout.etp_size
        piece = rows * cols // etp
        count = shape[0] // layout.ep_size
        return [HeldMatrix(split, (piece,) * etp, (piece,) * etp)] * count
    tp, g = layout.tp_size, layout.gtp_remat_size
    local_rows, local_cols = (rows // tp, cols) if style == "column" else (rows, cols // tp)
    shard = layout.shard_rows(local_rows)
    pieces = tuple(max(0, min(shard, local_rows - k * shard)) * local_cols
                   for _ in range(tp) for k in range(g))
    return [HeldMatrix(split, pieces, pieces)]


def ns_work_bytes(rows: int, cols: int, dtype_bytes: int) -> int:
    """What newton_schulz holds at its most for one block (m <= n its sides): the iterate and
    the next one (m x n each) beside the Gram matrix and its polynomial (m x m each)."""
    m, n = min(rows, cols), max(rows, cols)
    return (2 * m * n + 2 * m * m) * dtype_bytes


def exchange_bytes(matrices: list[HeldMatrix], tile: int, replicas: int, part: int,
                   steps: int, master_bytes: int, ns_bytes: int) -> int:
    """The most one rank of a Muon buffer holds at once in its update, over the buffer's ranks
    (each slot its owned matrices): with replicas, the reduce-scatter's part; then
    orthogonalise's (trainer.train.muon): the pieces going out S beside the matrices arriving
    O and their whole matrices O; one block's iteration beside O; the pieces going back B
    beside O, then beside what returns. With a tile of one, a message is its own arrival.
    master_bytes: the buffer's dtype; ns_bytes: the iteration's."""
    owner = assign_owners([m.cost(steps) for m in matrices], tile * replicas)
    most = part * master_bytes if replicas > 1 else 0
    for slot in range(tile * replicas):
        t, column = slot % tile, slot // tile
        mine = [m for m, o in zip(matrices, owner) if o == slot]
        col = [m for m, o in zip(matrices, owner) if o // tile == column]
        sent, owned = sum(m.sends[t] for m in col), sum(m.numel for m in mine)
        back, returned = sum(sum(m.stores) for m in mine), sum(m.stores[t] for m in col)
        work = max((ns_work_bytes(r, c, ns_bytes) for m in mine for r, c in m.blocks),
                   default=0)
        if tile == 1:
            phases = [sent + owned, owned + back]
        else:  # the message, the arrivals and the whole matrices at once; then back
            phases = [sent + 2 * owned, owned + back, back + returned]
        most = max(most, max(phases) * master_bytes, owned * master_bytes + work)
    return most


@dataclass(frozen=True)
class MuonPlan:
    """What the memory plan needs of optim=muon: its matrices, how it splits them, its
    iteration count and the bytes per element the iteration runs in."""

    names: frozenset[str]
    plan: ParallelPlan
    split: bool
    steps: int
    ns_bytes: int  # 4: master fp32; 2: bf16


def muon_plan(model: ModelConfig, optim: OptimConfig) -> MuonPlan | None:
    """optim=muon's matrices of `model` for the memory plan; None under adamw."""
    if optim.name != "muon":
        return None
    return MuonPlan(muon_names(model, optim), parallel_plan(model), optim.muon_split_qkv,
                    optim.muon_num_ns_steps, 2 if optim.muon_ns_dtype == "bf16" else 4)
