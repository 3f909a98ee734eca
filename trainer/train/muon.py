"""optim=muon's orthogonalisation on any layout: each matrix whole, exactly once per step.

Muon (momentum orthogonalised by Newton-Schulz) needs every hidden matrix whole, while a rank
holds a piece of it: TP and GTP_remat cut it over the weight tile, the sharded optimizer cuts
the flat buffer it lives in over the replicas. Per step and per Muon buffer
(trainer.train.optim.FlatBuffer):

1. each replica forms the momentum of its part (elementwise, as AdamW's moments) and the
   all-gather over the replicas puts the (Nesterov) momentum of every local piece on each rank;
2. each matrix has one owner among tile x replica ranks (balanced by Newton-Schulz FLOPs,
   trainer.plan.muon.assign_owners); within the owner's replica column one all-to-all over the
   weight tile brings it every piece, it orthogonalises the whole matrix (its fused q/k/v or
   gate/up parts apart with optim.muon_split_qkv), and a second all-to-all sends each tile rank
   its piece of the result;
3. a reduce-scatter over the replicas (each element is non-zero on one column only, so the sum
   is exact) leaves each rank the orthogonalised update of its part.

The experts' buffer does the same over expert tensor parallel (tile) and expert data parallel
(replicas), one matrix per expert. A linear kept whole on every rank (multi-latent attention's
down-projections) is sent by tile rank 0 and received by all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parallel.comm import Group
from trainer.plan.muon import assign_owners, matrix_flops, scale_factor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (torch.optim.Muon's)
NS_EPS = 1e-7


def newton_schulz(matrix: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalised `matrix` (torch.optim.Muon's iteration), computed in `dtype` and
    returned in it: x / |x|_F, then x <- a x + (b A + c A^2) x with A = x x^T on the wide side."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype, copy=True)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@dataclass(frozen=True)
class Matrix:
    """One matrix Muon orthogonalises: a 2-D weight, or one expert's of a 3-D weight."""

    name: str
    expert: int  # its global expert index (0 for a 2-D weight)
    rows: int
    cols: int
    blocks: tuple[int, ...]  # rows of the parts orthogonalised apart (optim.muon_split_qkv)

    def cost(self, steps: int) -> int:
        """Its Newton-Schulz FLOPs, what its owner is balanced by (the plan's count)."""
        return matrix_flops(tuple((rows, self.cols) for rows in self.blocks), steps)

    def block_of(self, row: int) -> int:
        edge = 0
        for i, rows in enumerate(self.blocks):
            edge += rows
            if row < edge:
                return i
        raise ValueError(f"row {row} is past {self.name}'s {self.rows} rows")


@dataclass(frozen=True)
class Piece:
    """A rectangle of a matrix a rank holds: where it sits in the matrix, and in the rank's
    flat buffer (slot offset, the local tensor's shape, the index into it)."""

    matrix: int
    row: int
    col: int
    rows: int
    cols: int
    offset: int = 0
    shape: tuple[int, ...] = ()
    index: tuple = ()

    def meta(self) -> list[int]:
        return [self.matrix, self.row, self.col, self.rows, self.cols]

    def local(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset:self.offset + math.prod(self.shape)].view(self.shape)[self.index]


def local_offsets(local: torch.Tensor, view: torch.Tensor) -> tuple[int, ...]:
    """Where `view` (a narrowed view of contiguous `local`) starts in it, per dim."""
    assert view.stride() == local.stride(), "a chunk is a narrowed view of its parameter"
    delta, out = view.storage_offset() - local.storage_offset(), []
    for stride in local.stride():
        out.append(delta // stride)
        delta %= stride
    return tuple(out)


class MuonExchange:
    """The matrices of one Muon buffer, their owners and this rank's pieces; orthogonalise()
    runs steps 2 and 3 of the module's description."""

    def __init__(self, model, slots: list[tuple[str, int, torch.Size]], tile: Group,
                 replica: Group, blocks_of, whole: set[str], steps: int, scale_mode: str,
                 extra_scale: float, dtype: torch.dtype | None):
        self.tile, self.replica, self.steps = tile, replica, steps
        self.dtype = dtype  # None: the buffer's own
        self.matrices: list[Matrix] = []
        found: dict[tuple[str, int], int] = {}
        self.sends: list[Piece] = []  # this rank's pieces it sends to their owners
        self.receives: list[Piece] = []  # the pieces of the result it stores
        def number(key: tuple[str, int], rows: int, cols: int) -> int:
            if key not in found:
                found[key] = len(self.matrices)
                self.matrices.append(Matrix(key[0], key[1], rows, cols, blocks_of(key[0])))
            return found[key]

        for name, offset, shape in slots:
            local = torch.empty(shape, device="meta")
            global_shape = model.global_shape(name)
            if len(shape) == 2:  # numbered alike on every tile rank, one holding only padding
                number((name, 0), *global_shape)  # rows of a weight shard included
            for offsets, view in model.global_chunks(name, local):
                start = local_offsets(local, view)
                experts = range(view.shape[0]) if len(shape) == 3 else [None]
                for e in experts:  # a 3-D chunk spans experts: one piece per expert
                    # (every expert-tensor rank holds a piece of each of its experts)
                    key = (name, 0 if e is None else offsets[0] + e)
                    number(key, *global_shape[-2:])
                    g_row, g_col = offsets[-2:]
                    rows, cols = view.shape[-2:]
                    index = tuple(slice(s, s + n) for s, n in zip(start[-2:], (rows, cols)))
                    if e is not None:
                        index = (start[0] + e, *index)
                    piece = Piece(found[key], g_row, g_col, rows, cols, offset, tuple(shape),
                                  index)
                    self.receives.append(piece)
                    if name not in whole or tile.rank == 0:
                        self.sends.append(piece)
        # Every tile rank's piece lists, to know what it sends and receives (once, at build).
        self.all_sends = self._gather_meta(self.sends)
        self.all_receives = self._gather_meta(self.receives)
        self._check_coverage()
        costs = [m.cost(steps) for m in self.matrices]
        # slot = replica column * tile size + tile rank
        self.owner = assign_owners(costs, tile.size * replica.size)
        self.ratios = [[extra_scale * scale_factor(b, m.cols, scale_mode) for b in m.blocks]
                       for m in self.matrices]
        self._route()

    def _route(self) -> None:
        """What each step's two all-to-alls move, fixed by the owners: per tile rank, the
        pieces this rank sends it and the ones it sends back (and their sizes)."""
        column, size = self.replica.rank, self.tile.size
        me = column * size + self.tile.rank
        self.owned = [m for m in range(len(self.matrices)) if self.owner[m] == me]
        mine = set(self.owned)
        # there: this rank's pieces of its column's matrices, by owner; the owners' arrivals
        self.outgoing = [[p for p in self.sends if self.column(p.matrix) == (d, column)]
                         for d in range(size)]
        self.arriving = [[q for q in self.all_sends[s] if q[0] in mine] for s in range(size)]
        # back: each tile rank's stored pieces of the matrices this rank owns; what returns
        self.leaving = [[q for q in self.all_receives[d] if q[0] in mine] for d in range(size)]
        self.returning = [[p for p in self.receives if self.column(p.matrix) == (s, column)]
                          for s in range(size)]
        self.sizes = ([sum(p.rows * p.cols for p in ps) for ps in self.outgoing],
                      [sum(q[3] * q[4] for q in qs) for qs in self.arriving],
                      [sum(q[3] * q[4] for q in qs) for qs in self.leaving],
                      [sum(p.rows * p.cols for p in ps) for ps in self.returning])

    def _gather_meta(self, pieces: list[Piece]) -> list[list[list[int]]]:
        mine = torch.tensor([p.meta() for p in pieces] or [[-1] * 5], dtype=torch.int64)
        if self.tile.size == 1:
            return [[p.meta() for p in pieces]]
        counts = self.tile.all_gather(torch.tensor([len(pieces)]))
        most = max(1, int(counts.max()))
        padded = torch.full((most, 5), -1, dtype=torch.int64)
        padded[:len(pieces)] = mine[:len(pieces)]
        every = self.tile.all_gather(padded).view(self.tile.size, most, 5)
        return [every[s, :int(counts[s])].tolist() for s in range(self.tile.size)]

    def _check_coverage(self) -> None:
        """The tile's sent pieces cover each matrix exactly (padding rows excluded)."""
        area = [0] * len(self.matrices)
        for pieces in self.all_sends:
            for m, _, _, rows, cols in pieces:
                area[m] += rows * cols
        for m, a in zip(self.matrices, area):
            assert a == m.rows * m.cols, f"{m.name}: the tile's pieces cover {a} of " \
                                         f"{m.rows * m.cols} elements"

    def column(self, matrix: int) -> tuple[int, int]:
        """(tile rank, replica column) of a matrix's owner."""
        return self.owner[matrix] % self.tile.size, self.owner[matrix] // self.tile.size

    @torch.no_grad()
    def orthogonalise(self, flat: torch.Tensor) -> None:
        """flat: the (Nesterov) momentum of every local piece in, the orthogonalised update of
        the pieces owned in this rank's replica column out (zero elsewhere). Each message is
        one preallocated tensor, let go as soon as it is read (trainer.plan.muon.exchange_bytes
        counts them)."""
        out_sizes, in_sizes, back_sizes, return_sizes = self.sizes
        # The whole matrices are allocated before the messages: gloo's worker thread lets a
        # message go a moment after the collective returns, so what is alive at once must not
        # depend on when (the plan counts message, arrivals and wholes together).
        wholes = flat.new_empty(sum(self.matrices[m].rows * self.matrices[m].cols
                                    for m in self.owned))
        views, at = {}, 0
        for m in self.owned:
            matrix = self.matrices[m]
            views[m] = wholes[at:at + matrix.rows * matrix.cols].view(matrix.rows, matrix.cols)
            at += matrix.rows * matrix.cols
        message = _pack([p.local(flat) for pieces in self.outgoing for p in pieces], flat)
        received = self.tile.all_to_all_rows(message, out_sizes, in_sizes)
        del message
        at = 0
        for pieces in self.arriving:
            for m, row, col, rows, cols in pieces:
                views[m][row:row + rows, col:col + cols] = received[at:at + rows * cols].view(
                    rows, cols)
                at += rows * cols
        del received
        for m in self.owned:  # each block orthogonalised in place
            for block in views[m].split(list(self.matrices[m].blocks)):
                block.copy_(newton_schulz(block, self.steps, self.dtype or block.dtype))
        # Back: to each tile rank its stored pieces of the matrices this rank owns.
        message = _pack([views[m][row:row + rows, col:col + cols]
                         for pieces in self.leaving for m, row, col, rows, cols in pieces], flat)
        del views, wholes
        result = self.tile.all_to_all_rows(message, back_sizes, return_sizes)
        del message
        flat.zero_()
        at = 0
        for pieces in self.returning:
            for p in pieces:
                p.local(flat).copy_(result[at:at + p.rows * p.cols].view(p.rows, p.cols))
                at += p.rows * p.cols

    def runs(self, part_start: int, part_size: int) -> list[tuple[int, int, float]]:
        """(start, end, ratio) runs of a part (flat positions relative to it) over which the
        update is scaled alike: the ratio of the matrix block each element belongs to. A
        piece's rows are each contiguous in the flat buffer (its local tensor is)."""
        out: list[tuple[int, int, float]] = []
        for p in self.receives:
            strides = torch.empty(p.shape, device="meta").stride()
            first = p.offset + sum(i.start * st if isinstance(i, slice) else i * st
                                   for i, st in zip(p.index, strides))
            full = p.cols == p.shape[-1]  # whole local rows: consecutive rows are contiguous
            matrix, row = self.matrices[p.matrix], 0
            while row < p.rows:
                block = matrix.block_of(p.row + row)
                edge = sum(matrix.blocks[:block + 1]) - p.row  # the block's end, in the piece
                last = min(p.rows, edge) if full else row + 1
                start = first + row * strides[-2] - part_start
                end = start + (last - row) * p.cols if full else start + p.cols
                start, end = max(start, 0), min(end, part_size)
                if start < end:
                    out.append((start, end, self.ratios[p.matrix][block]))
                row = last
        out.sort()
        merged: list[tuple[int, int, float]] = []
        for run in out:
            if merged and merged[-1][1] == run[0] and merged[-1][2] == run[2]:
                merged[-1] = (merged[-1][0], run[1], run[2])
            else:
                merged.append(run)
        return merged


def _pack(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The pieces' values one after another in one new flat tensor."""
    out = like.new_empty(sum(p.numel() for p in pieces))
    at = 0
    for piece in pieces:
        out[at:at + piece.numel()].view(piece.shape).copy_(piece)
        at += piece.numel()
    return out
