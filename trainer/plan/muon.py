"""Muon's arithmetic without torch: the matrices it orthogonalises for a parameter, what a
matrix's Newton-Schulz iteration costs, the update's scale, and which rank orthogonalises which
matrix (trainer.parts.matrices says which parameters Muon takes; trainer.train.muon runs it).
"""
from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

from parallel.layout import Layout
from parallel.layout.parallel_plan import ParallelPlan
from trainer.config import ModelConfig, OptimConfig, Precision
from trainer.parts.assembly import parallel_plan, parameter_shapes
from trainer.parts.matrices import muon_names
from trainer.parts.tokens import FP32
from trainer.plan.hardware import Hardware


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


def matrix_blocks(name: str, shape: tuple[int, ...], plan: ParallelPlan, split: bool
                  ) -> tuple[tuple[int, int], ...]:
    """The (rows, cols) blocks Muon orthogonalises apart in one matrix of parameter `name`
    (a 3-D weight has one such matrix per expert)."""
    return tuple((rows, shape[-1]) for rows in row_splits(name, shape, plan, split))


def assign_owners(costs: list[int], slots: int) -> list[int]:
    """Each matrix's owner among `slots` ranks, balancing the sum of costs: the costliest first,
    each to the least loaded slot (the lowest index on a tie), so every rank computes the same
    answer from the same list (longest-processing-time-first: at most 4/3 of the optimum)."""
    heap, owner = [(0, s) for s in range(slots)], [0] * len(costs)  # (load, slot): a heap
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, slot = heapq.heappop(heap)
        owner[i] = slot
        heapq.heappush(heap, (load + costs[i], slot))
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
        return matrix_flops(self.blocks, steps)


@functools.lru_cache(maxsize=4096)
def matrix_flops(blocks: tuple[tuple[int, int], ...], steps: int) -> int:
    """A matrix's Newton-Schulz FLOPs, its (rows, cols) blocks each orthogonalised alone: the
    cost its owner is balanced by (the runtime's owners and the plan's are the same)."""
    return sum(ns_flops(r, c, steps) for r, c in blocks)


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
    local_rows, local_cols = layout.tp_local_shape(rows, cols, style == "column")
    shard = layout.shard_rows(local_rows)
    pieces = tuple(max(0, min(shard, local_rows - k * shard)) * local_cols
                   for _ in range(tp) for k in range(g))
    return [HeldMatrix(split, pieces, pieces)]


def ns_work_bytes(rows: int, cols: int, dtype_bytes: int) -> int:
    """What newton_schulz holds at its most for one block (m <= n its sides): the iterate and
    the next one (m x n each) beside the Gram matrix and its polynomial (m x m each)."""
    m, n = min(rows, cols), max(rows, cols)
    return (2 * m * n + 2 * m * m) * dtype_bytes


@dataclass(frozen=True)
class HeldBuffer:
    """One Muon flat buffer of a stage (trainer.plan.memory's MUON_* buffers): its matrices
    over `tile` x `replicas` owner ranks, and the part of it each replica updates."""

    name: str
    experts: bool  # over ETP and expert DP, else over the weight tile and weight_replica
    tile: int
    replicas: int
    part: int
    matrices: tuple[HeldMatrix, ...]


@dataclass(frozen=True)
class Slots:
    """A Muon buffer's matrices over its owner slots (slot = replica column x tile + tile rank),
    summed once per slot and per column, so each slot's figures cost no pass over the matrices
    (the layout search asks thousands of layouts)."""

    tile: int
    owner: list[int]  # per matrix: its slot
    owned: list[int]  # per slot: elements of the matrices it owns
    flops: list[int]  # per slot: their Newton-Schulz FLOPs
    own_sends: list[int]  # per slot: of its matrices, the pieces its own tile rank sends
    own_stores: list[int]  # per slot: of its matrices, the piece its tile rank stores
    back: list[int]  # per slot: of its matrices, every tile rank's stored piece
    gathered: list[int]  # per slot: of its matrices, every tile rank's sent piece
    column_sends: list[list[int]]  # per column, per tile rank: its pieces of the column's
    column_stores: list[list[int]]  # matrices it sends, and it stores
    work: list[int]  # per slot: the largest block's Newton-Schulz working set, in elements

    @classmethod
    def of(cls, matrices: tuple[HeldMatrix, ...], tile: int, replicas: int, steps: int
           ) -> Slots:
        return _slots(matrices, tile, replicas, steps)

    @classmethod
    def _of(cls, matrices: tuple[HeldMatrix, ...], tile: int, replicas: int,
            steps: int) -> Slots:
        costs = [m.cost(steps) for m in matrices]
        owner = assign_owners(costs, tile * replicas)
        n = tile * replicas
        out = cls(tile, owner, [0] * n, [0] * n, [0] * n, [0] * n, [0] * n, [0] * n,
                  [[0] * tile for _ in range(replicas)], [[0] * tile for _ in range(replicas)],
                  [0] * n)
        for m, cost, slot in zip(matrices, costs, owner):
            t, column = slot % tile, slot // tile
            out.owned[slot] += m.numel
            out.flops[slot] += cost
            out.own_sends[slot] += m.sends[t]
            out.own_stores[slot] += m.stores[t]
            out.back[slot] += sum(m.stores)
            out.gathered[slot] += sum(m.sends)
            for r in range(tile):
                out.column_sends[column][r] += m.sends[r]
                out.column_stores[column][r] += m.stores[r]
            out.work[slot] = max([out.work[slot]] + [ns_work_bytes(r, c, 1) for r, c in m.blocks])
        return out


@functools.lru_cache(maxsize=4096)
def _slots(matrices: tuple[HeldMatrix, ...], tile: int, replicas: int, steps: int) -> Slots:
    """Slots.of, once per stage shape: the search meets the same stage under many layouts."""
    return Slots._of(matrices, tile, replicas, steps)


def owner_balance(held: HeldBuffer, steps: int) -> dict[str, float]:
    """Who orthogonalises how much of a Muon buffer: its matrices over its owner ranks, the
    most one rank owns, and the busiest rank's Newton-Schulz FLOPs over the mean."""
    slots = Slots.of(held.matrices, held.tile, held.replicas, steps)
    ranks = held.tile * held.replicas
    mean = sum(slots.flops) / len(slots.flops)
    return {"matrices": len(held.matrices), "ranks": ranks,
            "most_owned": max(slots.owner.count(s) for s in range(ranks)),
            "flops_max_over_mean": round(max(slots.flops) / mean, 4) if mean else 0.0}


@functools.lru_cache(maxsize=4096)
def exchange_bytes(held: HeldBuffer, steps: int, master_bytes: int, ns_bytes: int) -> int:
    """The most one rank of a Muon buffer holds at once in its update, over the buffer's ranks
    (each slot its owned matrices): with replicas, the reduce-scatter's part; then
    orthogonalise's (trainer.train.muon): the pieces going out S beside the matrices arriving
    O and their whole matrices O; one block's iteration beside O; the pieces going back B
    beside O, then beside what returns. With a tile of one, a message is its own arrival.
    master_bytes: the buffer's dtype; ns_bytes: the iteration's. Once per stage shape: the
    search meets the same stage under many layouts."""
    tile, replicas = held.tile, held.replicas
    slots = Slots.of(held.matrices, tile, replicas, steps)
    most = held.part * master_bytes if replicas > 1 else 0
    for slot in range(tile * replicas):
        t, column = slot % tile, slot // tile
        sent, owned = slots.column_sends[column][t], slots.owned[slot]
        back, returned = slots.back[slot], slots.column_stores[column][t]
        if tile == 1:
            phases = [sent + owned, owned + back]
        else:  # the message, the arrivals and the whole matrices at once; then back
            phases = [sent + 2 * owned, owned + back, back + returned]
        most = max(most, max(phases) * master_bytes,
                   owned * master_bytes + slots.work[slot] * ns_bytes)
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
    flops: int = 0  # every matrix's Newton-Schulz FLOPs, the whole model's
    largest: int = 0  # the costliest matrix's (one rank orthogonalises it whole)

    def floor_s(self, world_size: int, hw: Hardware) -> float:
        """At least the update's Newton-Schulz time on any layout: the model's FLOPs spread
        evenly over every rank, or its costliest matrix, whichever is more (the search prunes
        with it before sizing a layout)."""
        return max(self.flops / world_size, self.largest) / hw.flops(self.precision)

    @property
    def precision(self) -> Precision:
        return Precision.bf16 if self.ns_bytes == 2 else Precision.fp32


def muon_plan(model: ModelConfig, optim: OptimConfig) -> MuonPlan | None:
    """optim=muon's matrices of `model` for the memory plan; None under adamw."""
    if optim.name != "muon":
        return None
    names, plan, shapes = muon_names(model, optim), parallel_plan(model), parameter_shapes(model)
    steps, split = optim.muon_num_ns_steps, optim.muon_split_qkv
    costs = []  # per matrix: one per 2-D weight, one per expert of a 3-D weight
    for n in names:
        shape = shapes[n]
        costs += [matrix_flops(matrix_blocks(n, shape, plan, split), steps)] * (
            shape[0] if len(shape) == 3 else 1)
    return MuonPlan(names, plan, split, steps, 2 if optim.muon_ns_dtype == "bf16" else 4,
                    sum(costs), max(costs, default=0))


def update_seconds(buffers: tuple[HeldBuffer, ...], layout: Layout, hw: Hardware,
                   muon: MuonPlan) -> float:
    """A stage's Muon update on its slowest rank, buffer after buffer (trainer.train.muon):
    the Newton-Schulz FLOPs of the matrices it owns at the hardware's rate; the all-to-alls
    over its tile (each as long as the larger of what the rank sends and receives: its pieces
    of the column's matrices others own out, the other tile ranks' pieces of its own in; the
    same back); the momentum's all-gather and the update's reduce-scatter over the replicas.
    Nothing hidden: the update runs after the backward."""
    rate = hw.flops(muon.precision)
    total = 0.0
    for held in buffers:
        tile_group, replica_group = (("expert_tensor_parallel", "expert_data_parallel")
                                     if held.experts else ("weight_tile", "weight_replica"))
        tile_link, replica_link = hw.link(layout, tile_group), hw.link(layout, replica_group)
        total += _slowest(held, muon.steps, rate, tile_link.bandwidth)
        total += 2 * replica_link.ring(held.replicas, held.part * held.replicas * FP32)
    return total


@functools.lru_cache(maxsize=4096)
def _slowest(held: HeldBuffer, steps: int, rate: float, bandwidth: float) -> float:
    """The slowest owner slot's Newton-Schulz time and tile all-to-alls."""
    tile, replicas = held.tile, held.replicas
    slots, slowest = Slots.of(held.matrices, tile, replicas, steps), 0.0
    for slot in range(tile * replicas):
        t, column = slot % tile, slot // tile
        there = max(slots.column_sends[column][t] - slots.own_sends[slot],
                    slots.gathered[slot] - slots.own_sends[slot])
        back = max(slots.back[slot] - slots.own_stores[slot],
                   slots.column_stores[column][t] - slots.own_stores[slot])
        slowest = max(slowest, slots.flops[slot] / rate + (there + back) * FP32 / bandwidth)
    return slowest
