"""Running a schedule on one rank: its stage's forwards and backwards, in the schedule's order,
with activations and their gradients crossing stages point-to-point over the pp group.

Every rank replays the list parallel.layout.pipeline_schedules gives its stage, so the dry run's
figures (bubble, micro-batches in flight) are the run's. A micro-batch's hidden states go to the
next stage with their token positions; gradients come back the same way. Packed documents
(where each position's document starts, a few integers a sample) are not sent: every stage
has its micro-batches' own. Sends never block, and a receive is posted one action before its data is
needed, so it arrives while the rank computes; a rank only waits for what it is about to use.
Each message has its own tag, so two ranks may post theirs in any order. A peer that died or raised
leaves a receive waiting, which the process group's timeout (cluster.timeout_s) fails.

Without pipeline parallelism the same code runs each micro-batch forward then backward, with
no messages: one path for every layout.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from parallel.comm import Pending
from parallel.layout import Layout
from parallel.layout.pipeline_schedules import (
    FORWARD,
    RECEIVE_AHEAD,
    Action,
    model_chunk,
    stage_actions,
)

# The last chunk's logits of micro-batch i -> the tensor its backward starts from (training),
# or anything (evaluation). The caller keeps what it needs of the loss.
LastStage = Callable[[int, torch.Tensor], torch.Tensor]
ACTIVATION, POSITIONS, GRADIENT = range(3)  # message kinds, part of each tag


class PipelineRunner:
    def __init__(self, model: torch.nn.Module, layout: Layout, schedule: str, hidden_size: int):
        """model: a parallel.parallelize.ParallelModel (which builds its runner)."""
        self.model, self.layout, self.schedule = model, layout, schedule
        self.pp = model.groups.pp
        self.stage, self.size = self.pp.rank, self.pp.size
        self.virtual = layout.virtual_pipeline_size
        self.last_chunk = self.size * self.virtual - 1
        # Between blocks the residual stream stays in the masters' dtype (parallel.sharding),
        # split over TP along the sequence with SP.
        self.dtype = next(model.parameters()).dtype
        self.hidden_shape = (layout.micro_batch_size, layout.residual_local_length, hidden_size)
        self.positions_shape = (layout.micro_batch_size, layout.context_local_length)
        # Set to measure what the schedule keeps: the bytes autograd saves in each forward
        # (weights excluded), summed over the (micro-batch, chunk) pairs in flight; the most
        # of the last run, and the most pairs in flight, beside the dry run's plan of them.
        # Also the most bytes of received messages held at once (posted receives, and the
        # action's own: a backward's gradient, a forward's positions).
        self.measure = False
        self.peak_saved_bytes = self.peak_in_flight = self.peak_message_bytes = 0
        # Seconds of the last run: all of it, and computing (forwards, loss, backwards; not
        # waiting for messages). 1 - busy / total is the bubble this stage saw.
        self.run_s = self.busy_s = 0.0
        # Told (actions done, actions of the run, the action) after each action, where set
        # (the measured dry run's progress lines).
        self.progress: Callable[[int, int, Action], None] | None = None

    def run(self, inputs: Sequence[tuple[torch.Tensor | None, ...]],
            last: LastStage, train: bool = True) -> None:
        """inputs: (tokens, positions, documents, ...) of each micro-batch, as this rank keeps
        them (what follows the documents is passed on to the model's forward as it is)
        (a stage after the first uses only the documents: its tokens and positions come with
        the hidden states). train=False runs the
        forwards only, in the schedule's order, without autograd."""
        actions = stage_actions(self.schedule, self.stage, self.size, len(inputs), self.virtual)
        if not train:
            actions = [a for a in actions if a.kind == FORWARD]
        self._device = inputs[0][0].device
        flight = _InFlight()
        self.peak_saved_bytes = self.peak_in_flight = self.peak_message_bytes = 0
        started, self.busy_s = time.perf_counter(), 0.0
        for i, action in enumerate(actions):
            for upcoming in actions[i:i + 1 + RECEIVE_AHEAD]:
                self._post_receives(upcoming, flight)
            if self.measure:
                self.peak_message_bytes = max(self.peak_message_bytes,
                                              _message_bytes(flight, action))
            if action.kind == FORWARD:
                self._forward(action, inputs, last, train, flight)
            else:
                self._backward(action, flight)
            flight.sends = [s for s in flight.sends if not s.completed()]  # let buffers go
            if self.progress is not None:
                self.progress(i + 1, len(actions), action)
        for send in flight.sends:
            send.wait()
        self.run_s = time.perf_counter() - started

    def _forward(self, action: Action, inputs: Sequence, last: LastStage, train: bool,
                 flight: _InFlight) -> None:
        chunk = model_chunk(self.stage, action.chunk, self.size)
        with torch.set_grad_enabled(train), _SavedBytes(self.measure, self.model) as size:
            x, positions = self._inputs(action, inputs, train, flight)
            busy = time.perf_counter()
            # the rest of the micro-batch's inputs: its documents (and what the model takes
            # after them: multi-token prediction's ids), which every stage has
            out = self.model.forward_chunk(action.chunk, x, positions,
                                           *inputs[action.microbatch][2:])
            if chunk == self.last_chunk:
                out = last(action.microbatch, out)
            self.busy_s += time.perf_counter() - busy
            if chunk != self.last_chunk:
                flight.sends += self._send_forward(chunk, action.microbatch, out, positions)
                _release_data(out)
        if train:  # kept until its backward: the pair's graph, and its input for the gradient
            key = (action.microbatch, action.chunk)
            flight.saved[key], flight.kept[key] = (x, out), size.bytes
            self.peak_in_flight = max(self.peak_in_flight, len(flight.saved))
            self.peak_saved_bytes = max(self.peak_saved_bytes, sum(flight.kept.values()))

    def _backward(self, action: Action, flight: _InFlight) -> None:
        chunk = model_chunk(self.stage, action.chunk, self.size)
        x, out = flight.saved.pop((action.microbatch, action.chunk))
        flight.kept.pop((action.microbatch, action.chunk))
        grad = None if chunk == self.last_chunk else self._received(action, flight)[0]
        busy = time.perf_counter()
        torch.autograd.backward(out, grad)
        self.model.wait_grad_reduces()  # this pass's reduce-scatters end with it
        self.busy_s += time.perf_counter() - busy
        del out
        if chunk > 0:
            flight.sends.append(self._send(x.grad, -1, chunk, action.microbatch, GRADIENT))

    # ------------------------------------------------------------------------------ messages

    def _post_receives(self, action: Action, flight: _InFlight) -> None:
        """Post the receives `action` needs, once: gloo moves a message's bytes only once its
        receive is posted, so one posted an action early arrives while this rank computes."""
        key = (action.kind, action.microbatch, action.chunk)
        chunk = model_chunk(self.stage, action.chunk, self.size)
        if key in flight.posted:
            return
        flight.posted.add(key)
        if action.kind == FORWARD and chunk > 0:
            flight.receives[key] = [
                self._recv(self.positions_shape, torch.long, -1, chunk, action.microbatch,
                           POSITIONS),
                self._recv(self.hidden_shape, self.dtype, -1, chunk, action.microbatch,
                           ACTIVATION)]
        elif action.kind != FORWARD and chunk < self.last_chunk:
            flight.receives[key] = [self._recv(self.hidden_shape, self.dtype, +1, chunk + 1,
                                               action.microbatch, GRADIENT)]

    def _received(self, action: Action, flight: _InFlight) -> list[torch.Tensor]:
        pending = flight.receives.pop((action.kind, action.microbatch, action.chunk))
        return [p.wait() for p in pending]

    def _inputs(self, action: Action, inputs: Sequence, train: bool, flight: _InFlight
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if model_chunk(self.stage, action.chunk, self.size) == 0:
            return inputs[action.microbatch][:2]
        positions, x = self._received(action, flight)
        return x.requires_grad_(train), positions

    def _send_forward(self, chunk: int, microbatch: int, out: torch.Tensor,
                      positions: torch.Tensor) -> list[Pending]:
        if tuple(out.shape) != self.hidden_shape or out.dtype != self.dtype:
            raise RuntimeError(
                f"pipeline stage {self.stage}: model chunk {chunk} returned "
                f"{tuple(out.shape)} {out.dtype}, the next stage expects {self.hidden_shape} "
                f"{self.dtype}")
        return [self._send(positions, +1, chunk + 1, microbatch, POSITIONS),
                self._send(out.detach(), +1, chunk + 1, microbatch, ACTIVATION)]

    def _tag(self, chunk: int, microbatch: int, kind: int) -> int:
        """Unique within a step: which micro-batch, which model chunk receives it, what."""
        return (microbatch * (self.last_chunk + 1) + chunk) * 3 + kind

    def _send(self, tensor: torch.Tensor, step: int, chunk: int, microbatch: int,
              kind: int) -> Pending:
        """To the stage `step` (+1 next, -1 previous; model chunks wrap around the stages)."""
        return self.pp.start_send(tensor, (self.stage + step) % self.size,
                                  self._tag(chunk, microbatch, kind))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, step: int, chunk: int,
              microbatch: int, kind: int) -> Pending:
        return self.pp.start_recv(shape, dtype, self._device, (self.stage + step) % self.size,
                                  self._tag(chunk, microbatch, kind))


def _release_data(out: torch.Tensor) -> None:
    """Free a sent output's data (Megatron's deallocate_output_tensor): its backward needs only
    its graph (a chunk ends in the residual add, which saves nothing), and the send holds its
    own reference until delivered. One element expanded to the output's shape keeps the shape
    torch.autograd.backward checks its gradient against."""
    out.data = torch.empty(1, dtype=out.dtype, device=out.device).expand(out.shape)


def _message_bytes(flight: _InFlight, action: Action) -> int:
    """Bytes of the receive buffers held as `action` runs: every posted one but the hidden
    states a forward takes as its chunk's input (its activations count those)."""
    total = 0
    for key, pending in flight.receives.items():
        buffers = [p.output for p in pending]
        if key == (action.kind, action.microbatch, action.chunk) and action.kind == FORWARD:
            buffers = buffers[:1]  # its positions
        total += sum(b.nbytes for b in buffers)
    return total


@dataclass
class _InFlight:
    """One run's pairs between their forward and backward, and its sends not yet delivered."""

    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    kept: dict[tuple[int, int], int] = field(default_factory=dict)  # their saved bytes (measure)
    sends: list[Pending] = field(default_factory=list)
    receives: dict[tuple[str, int, int], list[Pending]] = field(default_factory=dict)
    posted: set[tuple[str, int, int]] = field(default_factory=set)  # (kind, micro-batch, chunk)


class _SavedBytes:
    """Bytes of the distinct storages autograd saves inside the block (weights excluded), when
    `on`; otherwise nothing is hooked."""

    def __init__(self, on: bool, model: torch.nn.Module):
        self.on, self.model, self.bytes = on, model, 0

    def __enter__(self) -> _SavedBytes:
        if self.on:
            weights = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
            storages: dict[int, int] = {}

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in weights:
                    storages[storage.data_ptr()] = storage.nbytes()
                return tensor

            self._storages = storages
            self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.on:
            self._hooks.__exit__(*exc)
            self.bytes = sum(self._storages.values())
