"""A process group this rank belongs to, with the collectives we use, each counted in CommStats.

Every byte the engine moves goes through a Group, so benchmarks and logs can read bytes per step
by collective kind. Bytes are what this rank sends under the bandwidth-optimal ring algorithm
(NCCL's "bus bytes"): all-gather and reduce-scatter (n-1) x shard, all-reduce 2(n-1)/n x tensor,
all-to-all (n-1)/n x tensor (the part it keeps does not move), point-to-point the tensor,
broadcast the tensor on its root. A
group of one rank moves nothing and calls nothing. A collective started asynchronously
(start_*) is counted when it starts, and once more in `overlapped`, so a test can tell overlap
from a synchronous fallback.

CommStats also knows which collective this rank waits in now, and since when: a hang watch
(another thread) reads it to tell the ranks stuck in a collective from the one that never
reached it.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial, wraps
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all_gather", "reduce_scatter", "all_reduce"
ALL_TO_ALL, P2P, BROADCAST = "all_to_all", "p2p", "broadcast"

# torch 2.13 renamed the tensor forms (the old names warn); older torch has only the old ones.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The eager twins of every kept_eager call, filled by compile_ready().
_TWINS: list[tuple[Callable, list[Callable]]] = []


def kept_eager(call: Callable) -> Callable:
    """A call that starts, waits for or asks after a message. Under torch.compile
    (train.compile=blocks) it runs eagerly, counted and watched as without compile: dynamo
    reaches its twin made by torch.compiler.disable, so the compiled graph ends before it and
    the next starts after it. Nothing is patched: an eager caller runs `call` itself."""
    twin: list[Callable] = []  # [torch.compiler.disable(call)], made by compile_ready()

    @wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if not twin:
                raise RuntimeError(f"{call.__qualname__} reached by torch.compile before "
                                   f"parallel.comm.compile_ready()")
            return twin[0](*args, **kwargs)
        return call(*args, **kwargs)

    _TWINS.append((call, twin))
    return run


def compile_ready() -> None:
    """Before blocks are compiled (trainer.train.compile): each collective's eager twin. Made
    here, not at import: torch.compiler.disable imports dynamo, about a second of every rank's
    start. Idempotent."""
    for call, twin in _TWINS:
        if not twin:
            twin.append(torch.compiler.disable(call))


class Wait(NamedTuple):
    """A collective this rank is blocked in: its group kind and global ranks, since when."""
    group: str
    op: str
    ranks: tuple[int, ...]
    since: float  # time.monotonic()


@dataclass
class CommStats:
    """Bytes sent and calls made by this rank, keyed by (group kind, collective kind); the
    collective it waits in now (None: none) and how many waits have ended."""

    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    overlapped: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    waiting: Wait | None = None
    waits_done: int = 0

    @contextmanager
    def waiting_in(self, group: str, op: str, ranks: list[int]) -> Iterator[None]:
        """Around the call that blocks until the peers take part (one assignment each way: a
        watch thread reads `waiting` without a lock)."""
        self.waiting = Wait(group, op, tuple(ranks), time.monotonic())
        try:
            yield
        finally:
            self.waiting = None
            self.waits_done += 1

    def record(self, group: str, op: str, nbytes: int, overlapped: bool = False) -> None:
        self.bytes[(group, op)] += nbytes
        self.calls[(group, op)] += 1
        if overlapped:
            self.overlapped[(group, op)] += 1

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (_, op), nbytes in self.bytes.items():
            out[op] += nbytes
        return dict(out)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.overlapped.clear()


class Pending:
    """A collective started with async_op=True: `wait()` returns its output once complete. It
    keeps the input alive until then (the backend may still be reading it)."""

    def __init__(self, output: Any, work: dist.Work | list[dist.Work] | None,
                 source: Any = None, sends: int = 0, waits: Any = None):
        """waits: the group's wait(op), entered while this blocks."""
        self.output, self._source, self._waits = output, source, waits
        self._works = [] if work is None else work if isinstance(work, list) else [work]
        self._sends = sends  # the first `sends` works are sends of `source`, one per tensor

    @kept_eager
    def wait_sent(self) -> None:
        """Wait only for the sends and let their sources go, where the backend reports sends
        apart from receives (gloo does; NCCL coalesces a batch into one work, kept whole)."""
        if self._sends and len(self._works) == self._sends + len(self.output):
            with self._waits():
                for work in self._works[:self._sends]:
                    work.wait()
            self._works, self._source, self._sends = self._works[self._sends:], None, 0

    @kept_eager
    def completed(self) -> bool:
        """Whether it has completed (without waiting)."""
        return all(work.is_completed() for work in self._works)

    @kept_eager
    def wait(self) -> Any:
        if self._works:
            with self._waits():
                for work in self._works:
                    work.wait()
        self._works, self._source = [], None
        return self.output


class Group:
    """One of this rank's process groups: its kind (a Layout group name), its global ranks in
    group order, this rank's position in it, and counted collectives."""

    def __init__(self, kind: str, ranks: list[int], rank: int,
                 handle: dist.ProcessGroup | None, stats: CommStats):
        self.kind, self.ranks, self.stats = kind, list(ranks), stats
        self.size = len(ranks)
        self.rank = ranks.index(rank)  # position in the group, not the global rank
        self.handle = handle
        if self.size > 1 and handle is None:
            raise ValueError(f"group {kind} {ranks} needs a process group")
        # torch's fake backend (one process simulating a rank of a large world) returns at once:
        # all-gather, reduce-scatter and all-to-all copy this rank's own input into their
        # outputs, all-reduce leaves its tensor as it was, a receive writes nothing, and no work
        # ever reports itself complete. So a receive's buffer is allocated zeroed (values stay
        # finite), and a send is complete at once (start_send): as a delivered message would,
        # it lets its buffer go, so a measured rank holds what a real one holds.
        self._fake = handle is not None and dist.get_backend(handle) == "fake"
        self._new = torch.Tensor.new_zeros if self._fake else torch.Tensor.new_empty

    def __repr__(self) -> str:
        return f"Group({self.kind}, ranks={self.ranks}, rank={self.rank})"

    @kept_eager
    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """output[i * len(shard) : (i+1) * len(shard)] = shard of group rank i (along dim 0)."""
        if self.size == 1:
            return output.copy_(shard)
        self.stats.record(self.kind, ALL_GATHER, (self.size - 1) * _nbytes(shard))
        with self.wait(ALL_GATHER)():
            _all_gather_tensor(output, shard.contiguous(), group=self.handle)
        return output

    @kept_eager
    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        out = self._new(shard, (self.size * shard.shape[0], *shard.shape[1:]))
        return self.all_gather_into(out, shard)

    @kept_eager
    def start_all_gather(self, shard: torch.Tensor) -> Pending:
        """all_gather, started now and completed by Pending.wait(): compute can run between."""
        if self.size == 1:
            return Pending(shard, None)
        out = self._new(shard, (self.size * shard.shape[0], *shard.shape[1:]))
        self.stats.record(self.kind, ALL_GATHER, (self.size - 1) * _nbytes(shard), True)
        source = shard.contiguous()
        return Pending(out, _all_gather_tensor(out, source, group=self.handle, async_op=True),
                       source, waits=self.wait(ALL_GATHER))

    @kept_eager
    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        """Sum over the group of `full` (dim 0 divisible by size); returns this rank's slice."""
        if self.size == 1:
            return full
        out = self._new(full, (full.shape[0] // self.size, *full.shape[1:]))
        self.stats.record(self.kind, REDUCE_SCATTER, (self.size - 1) * _nbytes(out))
        with self.wait(REDUCE_SCATTER)():
            _reduce_scatter_tensor(out, full.contiguous(), group=self.handle)
        return out

    @kept_eager
    def start_reduce_scatter(self, full: torch.Tensor) -> Pending:
        """reduce_scatter, started now and completed by Pending.wait()."""
        if self.size == 1:
            return Pending(full, None)
        out = self._new(full, (full.shape[0] // self.size, *full.shape[1:]))
        self.stats.record(self.kind, REDUCE_SCATTER, (self.size - 1) * _nbytes(out), True)
        source = full.contiguous()
        return Pending(out, _reduce_scatter_tensor(out, source, group=self.handle,
                                                   async_op=True), source,
                       waits=self.wait(REDUCE_SCATTER))

    @kept_eager
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM
                   ) -> torch.Tensor:
        """In place."""
        if self.size == 1:
            return tensor
        self.stats.record(self.kind, ALL_REDUCE, 2 * (self.size - 1) * _nbytes(tensor) // self.size)
        with self.wait(ALL_REDUCE)():
            dist.all_reduce(tensor, op=op, group=self.handle)
        return tensor

    @kept_eager
    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """In place: every member gets group rank `root`'s `tensor`."""
        if self.size == 1:
            return tensor
        self.stats.record(self.kind, BROADCAST, _nbytes(tensor) if self.rank == root else 0)
        with self.wait(BROADCAST)():
            dist.broadcast(tensor, group=self.handle, group_src=root)
        return tensor

    @kept_eager
    def start_send(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        """Point-to-point to group rank `peer`; the receiver's start_recv has the same tag (a
        tag per message, so messages between two ranks match whatever order they are posted
        in). Pending.wait() once the tensor may be reused."""
        source = tensor.contiguous()
        self.stats.record(self.kind, P2P, _nbytes(source), True)
        if self._fake:  # delivered at once (see __init__); nothing will receive it
            return Pending(None, None)
        return Pending(None, dist.isend(source, group=self.handle, group_dst=peer, tag=tag),
                       source, waits=self.wait(P2P))

    def recv_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                    ) -> torch.Tensor:
        """A new tensor for start_recv to receive into (zeros under the fake group)."""
        return self._new(torch.empty(0, dtype=dtype, device=device), shape)

    @kept_eager
    def start_recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                   peer: int, tag: int, into: torch.Tensor | None = None) -> Pending:
        """The message group rank `peer` sends with `tag`, into a new tensor (Pending.wait()),
        or into `into` (recv_buffer's: allocated by the caller's thread)."""
        out = into if into is not None else self.recv_buffer(shape, dtype, device)
        return Pending(out, dist.irecv(out, group=self.handle, group_src=peer, tag=tag),
                       waits=self.wait(P2P))


    @kept_eager
    def all_to_all(self, parts: torch.Tensor) -> torch.Tensor:
        """parts [size, ...]: part i goes to group rank i; returns [size, ...] where part j
        came from group rank j."""
        if self.size == 1:
            return parts
        if parts.shape[0] != self.size:
            raise ValueError(f"all_to_all needs dim 0 = {self.size} parts, got {parts.shape}")
        out = self._new(parts, parts.shape)
        self.stats.record(self.kind, ALL_TO_ALL, (self.size - 1) * _nbytes(parts) // self.size)
        with self.wait(ALL_TO_ALL)():
            dist.all_to_all_single(out, parts.contiguous(), group=self.handle)
        return out

    @kept_eager
    def all_to_all_rows(self, rows: torch.Tensor, send: list[int], receive: list[int]
                        ) -> torch.Tensor:
        """Variable all-to-all along dim 0: the next send[i] rows go to group rank i; returns
        the receive[j] rows group rank j sent, in group rank order."""
        if self.size == 1:
            return rows
        out = self._new(rows, (sum(receive), *rows.shape[1:]))
        row = _nbytes(rows) // max(rows.shape[0], 1)
        self.stats.record(self.kind, ALL_TO_ALL, (sum(send) - send[self.rank]) * row)
        with self.wait(ALL_TO_ALL)():
            dist.all_to_all_single(out, rows.contiguous(), receive, send, group=self.handle)
        return out

    @kept_eager
    def start_shift(self, tensors: list[torch.Tensor],
                    into: list[torch.Tensor] | None = None) -> Pending:
        """Ring step: send `tensors` to the next group rank and receive the previous rank's
        (same shapes and dtypes) into new buffers, or into `into` (contiguous, not in use);
        Pending.wait() returns those. Every member must call it at the same point with the
        same shapes."""
        if self.size == 1:
            return Pending(list(tensors), None)
        sources = [t.contiguous() for t in tensors]
        received = into if into is not None else [self._new(t, t.shape) for t in sources]
        after, before = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ops = [dist.P2POp(dist.isend, t, group=self.handle, group_peer=after) for t in sources]
        ops += [dist.P2POp(dist.irecv, t, group=self.handle, group_peer=before)
                for t in received]
        self.stats.record(self.kind, P2P, sum(_nbytes(t) for t in sources), True)
        return Pending(received, dist.batch_isend_irecv(ops), sources, len(sources),
                       self.wait(P2P))


    @kept_eager
    def start_exchange(self, sends: list[tuple[int, torch.Tensor]],
                       receives: list[tuple[int, tuple[int, ...]]], like: torch.Tensor
                       ) -> Pending:
        """Point-to-point messages in one batch: each (group rank, tensor) of `sends` sent, each
        (group rank, shape) of `receives` received into a new buffer of like's dtype and
        device (Pending.wait() returns them, in order). Every message's peer must post its
        twin in the same order (two messages between a pair match in posting order)."""
        sources = [t.contiguous() for _, t in sends]
        received = [self._new(like, shape) for _, shape in receives]
        ops = [dist.P2POp(dist.isend, t, group=self.handle, group_peer=peer)
               for (peer, _), t in zip(sends, sources)]
        ops += [dist.P2POp(dist.irecv, t, group=self.handle, group_peer=peer)
                for (peer, _), t in zip(receives, received)]
        self.stats.record(self.kind, P2P, sum(_nbytes(t) for t in sources), True)
        if not ops:
            return Pending(received, None)
        return Pending(received, dist.batch_isend_irecv(ops), sources, len(sources),
                       self.wait(P2P))

    def wait(self, op: str) -> Any:
        """What a blocking call enters: CommStats.waiting_in for this group and op."""
        return partial(self.stats.waiting_in, self.kind, op, self.ranks)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
