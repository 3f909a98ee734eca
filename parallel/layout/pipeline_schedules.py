"""Pipeline schedules: the order in which each stage runs its forwards and backwards.

Pure Python (no torch): the config resolver and the dry run import it at compose time to report
a schedule's bubble and activation memory, and the executor replays the same lists on the pp
group, so the figures printed before a run are the ones the run follows.

A stage runs `virtual` model chunks; its chunk `c` is model chunk `c * pp + stage`, so a
micro-batch walks stage 0..pp-1 once per chunk (Megatron's interleaved placement).
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Action:
    """One forward or backward of one micro-batch through one of this stage's chunks."""

    kind: str  # FORWARD or BACKWARD
    microbatch: int  # 0..m-1
    chunk: int  # this stage's virtual chunk, 0..v-1; the model chunk is chunk * pp + stage

    def __str__(self) -> str:
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk})"


def model_chunk(stage: int, chunk: int, pp: int) -> int:
    """The model chunk (0 = first layers) that `stage` runs as its virtual chunk `chunk`."""
    return chunk * pp + stage


# ------------------------------------------------------------------------------ the schedules


def _check_arguments(schedule: str, stage: int, pp: int, microbatches: int, virtual: int) -> None:
    """Reject what no schedule can run, naming the argument and the rule it breaks."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}.")
    if pp < 1:
        raise ValueError(f"pipeline size pp={pp} must be >= 1.")
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} is out of range for pp={pp} (stages are 0..{pp - 1}).")
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches} must be >= 1.")
    if schedule == "interleaved_1f1b":
        if virtual < 2:
            raise ValueError(
                f"schedule 'interleaved_1f1b' needs virtual >= 2 model chunks per stage, got "
                f"virtual={virtual}; use '1f1b' for one chunk per stage.")
        if microbatches % pp:
            raise ValueError(
                f"schedule 'interleaved_1f1b' needs microbatches to be a multiple of pp: "
                f"microbatches={microbatches} % pp={pp} = {microbatches % pp}.")
    elif virtual != 1:
        raise ValueError(
            f"schedule {schedule!r} runs one model chunk per stage, so virtual must be 1, got "
            f"virtual={virtual}; use 'interleaved_1f1b' for virtual chunks.")


def _warmup_steady_cooldown(forwards: list[Action], backwards: list[Action],
                            warmup: int) -> list[Action]:
    """`warmup` forwards, then one forward and one backward while forwards remain, then the rest
    of the backwards. The warmup fills the pipeline so the steady state never waits for input."""
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    order += backwards[len(forwards) - warmup:]
    return order


def _interleaved_action(kind: str, k: int, pp: int, virtual: int) -> Action:
    """Megatron's k-th forward (or backward) of an interleaved stage: micro-batches go in groups
    of pp; each group runs through chunk 0, then chunk 1, ... (backwards: the last chunk first)
    before the next group starts, so a stage has work while the group crosses the other stages."""
    chunk = (k // pp) % virtual
    if kind == BACKWARD:
        chunk = virtual - 1 - chunk
    microbatch = (k // (pp * virtual)) * pp + k % pp
    return Action(kind, microbatch, chunk)


def stage_actions(schedule: str, stage: int, pp: int, microbatches: int,
                  virtual: int = 1) -> list[Action]:
    """The order in which `stage` of `pp` runs every forward and backward of one step."""
    _check_arguments(schedule, stage, pp, microbatches, virtual)
    m = microbatches
    if schedule == "gpipe":
        # All forwards then all backwards: simplest, but holds all m activations at once.
        return ([Action(FORWARD, i, 0) for i in range(m)]
                + [Action(BACKWARD, i, 0) for i in range(m)])
    if schedule == "1f1b":
        # A stage s runs ahead of the last stage by pp - s - 1 forwards; after that each
        # backward frees an activation before the next forward makes one.
        forwards = [Action(FORWARD, i, 0) for i in range(m)]
        backwards = [Action(BACKWARD, i, 0) for i in range(m)]
        return _warmup_steady_cooldown(forwards, backwards, min(pp - stage - 1, m))
    total = m * virtual
    forwards = [_interleaved_action(FORWARD, k, pp, virtual) for k in range(total)]
    backwards = [_interleaved_action(BACKWARD, k, pp, virtual) for k in range(total)]
    # Megatron's warmup: the first backward reaches this stage after the first group has gone
    # through every chunk but this stage's last one, (v - 1) * pp forwards, plus two per later
    # stage (the forward there and the backward coming back).
    warmup = min((pp - stage - 1) * 2 + (virtual - 1) * pp, total)
    return _warmup_steady_cooldown(forwards, backwards, warmup)


def in_flight(actions: list[Action]) -> int:
    """The most (micro-batch, chunk) activations the stage holds at once: forwarded, not yet
    backwarded. In chunk units: with v chunks, one unit is 1/v of a stage's layers."""
    held: set[tuple[int, int]] = set()
    most = 0
    for action in actions:
        key = (action.microbatch, action.chunk)
        if action.kind == FORWARD:
            held.add(key)
            most = max(most, len(held))
        else:
            held.discard(key)
    return most


# The runner posts an action's receives this many actions before it (each then holds its
# message until it is used), so a message arrives while the rank computes.
RECEIVE_AHEAD = 1


def message_counts(actions: list[Action], stage: int, pp: int, virtual: int = 1
                   ) -> set[tuple[int, int]]:
    """The received messages a stage holds during each of its actions, as (hidden-state
    messages, position messages) pairs, the dominated ones dropped: the receives posted for the
    next RECEIVE_AHEAD actions (a forward of a chunk after the model's first: its hidden states
    and their positions; a backward of a chunk before the last: the gradient), and the action's
    own: a backward holds its gradient throughout, a forward its positions (its hidden states
    become the chunk's input, which its activations count)."""
    last = pp * virtual - 1

    def received(action: Action, own: bool) -> tuple[int, int]:
        chunk = model_chunk(stage, action.chunk, pp)
        if action.kind == FORWARD:
            return (0, 0) if chunk == 0 else (0 if own else 1, 1)
        return (0, 0) if chunk == last else (1, 0)

    counts = set()
    for i, action in enumerate(actions):
        ahead = [received(a, False) for a in actions[i + 1:i + 1 + RECEIVE_AHEAD]]
        own = received(action, True)
        counts.add((own[0] + sum(a for a, _ in ahead), own[1] + sum(p for _, p in ahead)))
    return {c for c in counts if not any(d != c and d[0] >= c[0] and d[1] >= c[1]
                                         for d in counts)}


def message_bytes(counts: set[tuple[int, int]], hidden_bytes: int, positions_bytes: int) -> int:
    """The most bytes of message_counts' messages alive at once."""
    return max((a * hidden_bytes + p * positions_bytes for a, p in counts), default=0)


def ideal_bubble_fraction(pp: int, microbatches: int, virtual: int = 1) -> float:
    """Idle share of a step when forward and backward times do not vary: (pp - 1) fill and
    drain slots over v * m work slots (interleaving shortens each slot to 1/v of a stage)."""
    if pp < 1 or microbatches < 1 or virtual < 1:
        raise ValueError(f"pp={pp}, microbatches={microbatches} and virtual={virtual} must all "
                         f"be >= 1.")
    return (pp - 1) / (virtual * microbatches + pp - 1)


# ------------------------------------------------------------------------------ the simulation


@dataclass(frozen=True)
class Simulation:
    """What a schedule costs on one step: the time it takes and how idle and full each stage is."""

    makespan: float
    busy: tuple[float, ...]  # per stage, time spent computing
    bubble_fraction: float  # 1 - mean(busy) / makespan
    in_flight: tuple[int, ...]  # per stage, in_flight(stage_actions(...))


def _input_of(action: Action, stage: int, pp: int, virtual: int) -> tuple[str, int, int] | None:
    """(kind, micro-batch, model chunk) that must finish before `action` can start; None for the
    forward of model chunk 0, whose input is the data."""
    chunk = model_chunk(stage, action.chunk, pp)
    if action.kind == FORWARD:
        return None if chunk == 0 else (FORWARD, action.microbatch, chunk - 1)
    if chunk == pp * virtual - 1:
        return (FORWARD, action.microbatch, chunk)  # the loss: the last chunk's own forward
    return (BACKWARD, action.microbatch, chunk + 1)


def simulate_orders(orders: list[list[Action]], pp: int, virtual: int = 1,
                    forward_time: float = 1.0, backward_time: float = 2.0,
                    hop_time: float = 0.0) -> Simulation:
    """Run each stage's order as a dataflow: an action starts once its stage is free and its input
    has arrived (its producer finished, plus hop_time when that producer is another stage).
    Raises RuntimeError if the orders deadlock, naming what each stuck stage waits for."""
    if pp < 1 or len(orders) != pp:
        raise ValueError(f"got {len(orders)} stage orders for pp={pp}; need one per stage.")
    duration = {FORWARD: forward_time / virtual, BACKWARD: backward_time / virtual}
    finished: dict[tuple[str, int, int], float] = {}
    next_index = [0] * pp
    stage_free = [0.0] * pp
    busy = [0.0] * pp
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for stage, order in enumerate(orders):
            # Run this stage as far as its inputs allow before looking at the next one; the
            # times do not depend on the sweep order, only on each stage's list order.
            while next_index[stage] < len(order):
                action = order[next_index[stage]]
                needed = _input_of(action, stage, pp, virtual)
                ready = 0.0
                if needed is not None:
                    if needed not in finished:
                        break
                    producer_stage = needed[2] % pp
                    ready = finished[needed] + (hop_time if producer_stage != stage else 0.0)
                start = max(stage_free[stage], ready)
                stage_free[stage] = start + duration[action.kind]
                busy[stage] += duration[action.kind]
                finished[(action.kind, action.microbatch,
                          model_chunk(stage, action.chunk, pp))] = stage_free[stage]
                next_index[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [f"stage {stage}: {order[next_index[stage]]} waits for "
                     f"{_input_of(order[next_index[stage]], stage, pp, virtual)}"
                     for stage, order in enumerate(orders) if next_index[stage] < len(order)]
            raise RuntimeError("pipeline orders deadlock; " + "; ".join(stuck))
    makespan = max(stage_free)
    bubble = 1.0 - (sum(busy) / pp) / makespan if makespan > 0 else 0.0
    return Simulation(makespan=makespan, busy=tuple(busy), bubble_fraction=bubble,
                      in_flight=tuple(in_flight(order) for order in orders))


def simulate(schedule: str, pp: int, microbatches: int, virtual: int = 1,
             forward_time: float = 1.0, backward_time: float = 2.0,
             hop_time: float = 0.0) -> Simulation:
    """Simulate one step of `schedule` over all pp stages (see simulate_orders)."""
    _check_arguments(schedule, 0, pp, microbatches, virtual)  # before any stage's list is built
    orders = [stage_actions(schedule, stage, pp, microbatches, virtual) for stage in range(pp)]
    return simulate_orders(orders, pp, virtual, forward_time, backward_time, hop_time)
