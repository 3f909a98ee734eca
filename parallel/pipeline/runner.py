"""Running a schedule on one rank: its stage's forwards and backwards, in the schedule's order,
with activations and their gradients crossing stages point-to-point over the pp group.

Every rank replays the list parallel.layout.pipeline_schedules gives its stage, so the dry run's
figures (bubble, micro-batches in flight) are the run's. A micro-batch's hidden states go to the
next stage with their token positions; gradients come back the same way. Packed documents
(where each position's document starts, a few integers a sample) are not sent: every stage
has its micro-batches' own. Sends never block, and a receive is posted one action before its data is
needed, so it arrives while the rank computes; a rank only waits for what it is about to use.
Each message has its own tag, so two ranks may post theirs in any order. A peer that died or raised
leaves a receive waiting, which the process group's timeout (cluster.timeout_s) fails. On CPU
(gloo) one helper thread posts them into buffers this thread allocates: gloo's irecv takes the
peer's lock, which its I/O thread holds while it moves another message, and posting from the
computing thread stalled it up to 60 ms a step on a V's turning stage (bench/pipeline.py).

Without pipeline parallelism the same code runs each micro-batch forward then backward, with
no messages: one path for every layout.

A zero-bubble schedule splits a backward into I and W (parallel.weight_grads): I runs autograd's
backward with the linears' weight gradients collected, sends the input's gradient on, and keeps
the collection for the pair's W. A V-shaped schedule's turn (the last stage's first chunk into
its second, and the gradient back) stays on the rank: handed over, not sent.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from parallel.comm import Pending
from parallel.layout import Layout
from parallel.layout.pipeline_schedules import (
    FORWARD,
    INPUT,
    RECEIVE_AHEAD,
    V_SHAPED,
    WEIGHT,
    Action,
    last_stage,
    model_chunk,
    stage_actions,
    stage_of,
)
from parallel.weight_grads import Collected, DeferredWeightGrads

# The last chunk's logits of micro-batch i -> the tensor its backward starts from (training),
# or anything (evaluation). The caller keeps what it needs of the loss.
LastStage = Callable[[int, torch.Tensor], torch.Tensor]
ACTIVATION, POSITIONS, GRADIENT = range(3)  # message kinds, part of each tag


class PipelineRunner:
    def __init__(self, model: torch.nn.Module, layout: Layout, schedule: str, hidden_size: int,
                 weight_grads: DeferredWeightGrads | None = None):
        """model: a parallel.parallelize.ParallelModel (which builds its runner);
        weight_grads: its linears' store, where the schedule splits the backward."""
        self.model, self.layout, self.schedule = model, layout, schedule
        self.weight_grads = weight_grads
        self.pp = model.groups.pp
        self.stage, self.size = self.pp.rank, self.pp.size
        self.virtual = layout.virtual_pipeline_size
        self.v_shape = schedule in V_SHAPED
        self._poster: ThreadPoolExecutor | None = None  # posts the receives on CPU
        self.last_chunk = self.size * self.virtual - 1
        self.last_stage = last_stage(schedule, self.size, self.virtual)  # the loss's
        # Between blocks the residual stream stays in the masters' dtype (parallel.sharding),
        # split over TP along the sequence with SP.
        self.dtype = next(model.parameters()).dtype
        self.hidden_shape = (layout.micro_batch_size, layout.residual_local_length, hidden_size)
        self.positions_shape = (layout.micro_batch_size, layout.context_local_length)
        # Set to measure what the schedule keeps: the bytes autograd saves in each forward
        # (weights excluded), summed over the (micro-batch, chunk) pairs in flight, and what
        # the pairs between their I and W hold for W; the most
        # of the last run, and the most pairs in flight, beside the dry run's plan of them.
        # Also the most bytes of received messages held at once (posted receives, and the
        # action's own: a backward's gradient, a forward's positions).
        self.measure = False
        self.peak_saved_bytes = self.peak_in_flight = self.peak_message_bytes = 0
        # Seconds of the last run: all of it, and computing (forwards, loss, backwards; not
        # waiting for messages). 1 - busy / total is the bubble this stage saw.
        self.run_s = self.busy_s = 0.0
        self.busy_by_kind: dict[str, float] = {}  # of busy_s, per action kind (F, B, I, W)
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
        started, self.busy_s, self.busy_by_kind = time.perf_counter(), 0.0, {}
        for i, action in enumerate(actions):
            for upcoming in actions[i:i + 1 + RECEIVE_AHEAD]:
                self._post_receives(upcoming, flight)
            if self.measure:
                self.peak_message_bytes = max(self.peak_message_bytes, _message_bytes(
                    flight, action, self._model_chunk(action)))
            if action.kind == FORWARD:
                self._forward(action, inputs, last, train, flight)
            elif action.kind == WEIGHT:
                self._weight(action, flight)
            else:
                self._backward(action, flight)
            flight.sends = [s for s in flight.sends if not s.completed()]  # let buffers go
            if self.progress is not None:
                self.progress(i + 1, len(actions), action)
        for send in flight.sends:
            send.wait()
        self.run_s = time.perf_counter() - started

    def _model_chunk(self, action: Action) -> int:
        return model_chunk(self.stage, action.chunk, self.size, self.v_shape)

    def _forward(self, action: Action, inputs: Sequence, last: LastStage, train: bool,
                 flight: _InFlight) -> None:
        chunk = self._model_chunk(action)
        with torch.set_grad_enabled(train), _SavedBytes(self.measure, self.model) as size:
            x, positions = self._inputs(action, inputs, train, flight)
            busy = time.perf_counter()
            # the rest of the micro-batch's inputs: its documents (and what the model takes
            # after them: multi-token prediction's ids), which every stage has
            out = self.model.forward_chunk(action.chunk, x, positions,
                                           *inputs[action.microbatch][2:])
            if chunk == self.last_chunk:
                out = last(action.microbatch, out)
            self._busy(action.kind, busy)
            if chunk != self.last_chunk:
                flight.sends += self._send_forward(chunk, action.microbatch, out, positions,
                                                   flight)
                if not self._local(chunk + 1):  # handed over, it is the next chunk's input
                    _release_data(out)
        if train:  # kept until its backward: the pair's graph, and its input for the gradient
            key = (action.microbatch, action.chunk)
            flight.saved[key], flight.kept[key] = (x, out), size.bytes
            self.peak_in_flight = max(self.peak_in_flight, len(flight.saved))
            self._measure_kept(flight)

    def _backward(self, action: Action, flight: _InFlight) -> None:
        """B, or I: the same backward with the linears' weight gradients left for W."""
        chunk = self._model_chunk(action)
        key = (action.microbatch, action.chunk)
        x, out = flight.saved.pop(key)
        flight.kept.pop(key)
        grad = None if chunk == self.last_chunk else self._received(action, flight)[0]
        busy = time.perf_counter()
        if action.kind == INPUT:
            with self.weight_grads.collect() as collected:
                torch.autograd.backward(out, grad)
            flight.weights[key] = collected
            if self.measure:
                flight.held[key] = collected.held_bytes()
        else:
            torch.autograd.backward(out, grad)
        self.model.wait_grad_reduces()  # this pass's reduce-scatters end with it
        self._busy(action.kind, busy)
        del out, grad
        if chunk > 0:
            flight.sends += self._send(x.grad, chunk - 1, chunk, action.microbatch, GRADIENT,
                                       flight)
            if self._local(chunk - 1):  # a V's turn: the first chunk's output was this input,
                # kept by this chunk until now; the first's backward needs its graph only
                turned = next(c for c in range(self.virtual) if model_chunk(
                    self.stage, c, self.size, self.v_shape) == chunk - 1)
                _release_data(flight.saved[(action.microbatch, turned)][1])
        self._measure_kept(flight)

    def _weight(self, action: Action, flight: _InFlight) -> None:
        """W: the weight gradients the pair's I left (and the reductions that follow them)."""
        key = (action.microbatch, action.chunk)
        collected: Collected = flight.weights.pop(key)
        flight.held.pop(key, None)
        busy = time.perf_counter()
        collected.run()
        self.model.wait_grad_reduces()
        self._busy(action.kind, busy)

    def _busy(self, kind: str, since: float) -> None:
        seconds = time.perf_counter() - since
        self.busy_s += seconds
        self.busy_by_kind[kind] = self.busy_by_kind.get(kind, 0.0) + seconds

    def _measure_kept(self, flight: _InFlight) -> None:
        if self.measure:
            self.peak_saved_bytes = max(self.peak_saved_bytes, sum(flight.kept.values())
                                        + sum(flight.held.values()))

    def _local(self, chunk: int) -> bool:
        """Whether model chunk `chunk` runs on this stage (a V's turn): its messages are
        handed over, not sent."""
        return stage_of(chunk, self.size, self.v_shape) == self.stage

    # ------------------------------------------------------------------------------ messages

    def _post_receives(self, action: Action, flight: _InFlight) -> None:
        """Post the receives `action` needs, once: gloo moves a message's bytes only once its
        receive is posted, so one posted an action early arrives while this rank computes.
        What a V's turn hands over on this rank needs none."""
        key = (action.kind, action.microbatch, action.chunk)
        chunk = self._model_chunk(action)
        if key in flight.posted:
            return
        flight.posted.add(key)
        if action.kind == FORWARD and chunk > 0 and not self._local(chunk - 1):
            flight.receives[key] = [
                self._recv(self.positions_shape, torch.long, chunk - 1, chunk,
                           action.microbatch, POSITIONS),
                self._recv(self.hidden_shape, self.dtype, chunk - 1, chunk, action.microbatch,
                           ACTIVATION)]
        elif action.kind not in (FORWARD, WEIGHT) and chunk < self.last_chunk \
                and not self._local(chunk + 1):
            flight.receives[key] = [self._recv(self.hidden_shape, self.dtype, chunk + 1,
                                               chunk + 1, action.microbatch, GRADIENT)]

    def _received(self, action: Action, flight: _InFlight) -> list[torch.Tensor]:
        chunk = self._model_chunk(action)
        kind = ACTIVATION if action.kind == FORWARD else GRADIENT
        handed = flight.handed.pop((chunk, action.microbatch, kind), None)
        if handed is not None:
            return handed
        pending = flight.receives.pop((action.kind, action.microbatch, action.chunk))
        return [p.wait() for p in pending]

    def _inputs(self, action: Action, inputs: Sequence, train: bool, flight: _InFlight
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._model_chunk(action) == 0:
            return inputs[action.microbatch][:2]
        positions, x = self._received(action, flight)
        return x.detach().requires_grad_(train), positions

    def _send_forward(self, chunk: int, microbatch: int, out: torch.Tensor,
                      positions: torch.Tensor, flight: _InFlight) -> list[Pending]:
        if tuple(out.shape) != self.hidden_shape or out.dtype != self.dtype:
            raise RuntimeError(
                f"pipeline stage {self.stage}: model chunk {chunk} returned "
                f"{tuple(out.shape)} {out.dtype}, the next stage expects {self.hidden_shape} "
                f"{self.dtype}")
        if self._local(chunk + 1):
            flight.handed[(chunk + 1, microbatch, ACTIVATION)] = [positions, out.detach()]
            return []
        return (self._send(positions, chunk + 1, chunk + 1, microbatch, POSITIONS, flight)
                + self._send(out.detach(), chunk + 1, chunk + 1, microbatch, ACTIVATION,
                             flight))

    def _tag(self, chunk: int, microbatch: int, kind: int) -> int:
        """Unique within a step: which micro-batch, which model chunk (the receiver of hidden
        states, the sender of a gradient), what."""
        return (microbatch * (self.last_chunk + 1) + chunk) * 3 + kind

    def _send(self, tensor: torch.Tensor, to_chunk: int, chunk: int, microbatch: int,
              kind: int, flight: _InFlight) -> list[Pending]:
        """To the stage of model chunk `to_chunk` (`chunk`: the tag's); handed over where that
        is this stage."""
        destination = stage_of(to_chunk, self.size, self.v_shape)
        if destination == self.stage:
            flight.handed[(to_chunk, microbatch, kind)] = [tensor]
            return []
        return [self.pp.start_send(tensor, destination, self._tag(chunk, microbatch, kind))]

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, from_chunk: int, chunk: int,
              microbatch: int, kind: int) -> Pending | _Posted:
        args = (shape, dtype, self._device, stage_of(from_chunk, self.size, self.v_shape),
                self._tag(chunk, microbatch, kind))
        if self._device.type != "cpu":  # NCCL's receives stay on the thread that sends
            return self.pp.start_recv(*args)
        if self._poster is None:
            self._poster = ThreadPoolExecutor(1, thread_name_prefix="pipeline-receives")
        into = self.pp.recv_buffer(shape, dtype, self._device)  # counted on this thread
        return _Posted(self._poster.submit(self.pp.start_recv, *args, into=into), into)


class _Posted:
    """A receive the helper thread posts (in the order asked) into `output`."""

    def __init__(self, future: Future, output: torch.Tensor):
        self._future, self.output = future, output

    def wait(self) -> torch.Tensor:
        return self._future.result().wait()


def _release_data(out: torch.Tensor) -> None:
    """Free a sent output's data (Megatron's deallocate_output_tensor): its backward needs only
    its graph (a chunk ends in the residual add, which saves nothing), and the send holds its
    own reference until delivered (a V's turn: the next chunk's input, until its backward).
    One element expanded to the output's shape keeps the shape torch.autograd.backward checks
    its gradient against."""
    out.data = torch.empty(1, dtype=out.dtype, device=out.device).expand(out.shape)


def _message_bytes(flight: _InFlight, action: Action, chunk: int) -> int:
    """Bytes of the receive buffers held as `action` (of model chunk `chunk`) runs: every
    posted one but the hidden states a forward takes as its chunk's input (its activations
    count those), and likewise what a V's turn hands over on the stage."""
    total = 0
    for (to_chunk, microbatch, _), tensors in flight.handed.items():
        own = action.kind == FORWARD and (to_chunk, microbatch) == (chunk, action.microbatch)
        total += sum(t.nbytes for t in (tensors[:1] if own else tensors))
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
    receives: dict[tuple[str, int, int], list[Pending | _Posted]] = field(default_factory=dict)
    # (model chunk, micro-batch, message kind) -> what a V's turn hands over on this stage
    handed: dict[tuple[int, int, int], list[torch.Tensor]] = field(default_factory=dict)
    weights: dict[tuple[int, int], Collected] = field(default_factory=dict)  # I's, for W
    held: dict[tuple[int, int], int] = field(default_factory=dict)  # their bytes (measure)
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
