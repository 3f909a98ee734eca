"""Pipeline schedules: the order in which each stage runs its forwards and backwards.

Pure Python (no torch): the config resolver and the dry run import it at compose time to report
a schedule's bubble and activation memory, and the executor replays the same lists on the pp
group, so the figures printed before a run are the ones the run follows.

A stage runs `virtual` model chunks; its chunk `c` is model chunk `c * pp + stage`, so a
micro-batch walks stage 0..pp-1 once per chunk (Megatron's interleaved placement), except under
a V-shaped schedule (zbv): two chunks a stage, chunk 0 model chunk `stage` and chunk 1 model
chunk `2 * pp - 1 - stage`, so a micro-batch goes down the stages and comes back up, and the
last stage hands its first chunk's output to its second without a message.

The zero-bubble schedules split each backward in two (the actions' kinds, torch.distributed.
pipelining's names): I, the gradient of the chunk's input, which the previous stage waits for,
and W, the gradients of its weights, which nothing waits for, so it can fill a bubble. B is the
whole backward (I then W at once), what 1f1b, interleaved_1f1b and gpipe run.
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe", "zb_h1", "zbv")
SPLIT_BACKWARD = ("zb_h1", "zbv")  # run I and W, not B
V_SHAPED = ("zbv",)
FORWARD, BACKWARD, INPUT, WEIGHT = "F", "B", "I", "W"


@dataclass(frozen=True)
class Action:
    """One forward or backward of one micro-batch through one of this stage's chunks."""

    kind: str  # FORWARD, BACKWARD (whole), INPUT (its input's gradient) or WEIGHT
    microbatch: int  # 0..m-1
    chunk: int  # this stage's virtual chunk, 0..v-1; the model chunk is chunk * pp + stage

    def __str__(self) -> str:
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk})"


def model_chunk(stage: int, chunk: int, pp: int, v_shape: bool = False) -> int:
    """The model chunk (0 = first layers) that `stage` runs as its virtual chunk `chunk`."""
    if v_shape:
        return stage if chunk == 0 else 2 * pp - 1 - stage
    return chunk * pp + stage


def stage_of(model_chunk_index: int, pp: int, v_shape: bool = False) -> int:
    """The stage that runs model chunk `model_chunk_index` (model_chunk's inverse)."""
    if v_shape and model_chunk_index >= pp:
        return 2 * pp - 1 - model_chunk_index
    return model_chunk_index % pp


def last_stage(schedule: str, pp: int, virtual: int = 1) -> int:
    """The stage that runs the model's last chunk (the head and the loss): pp - 1, or under a
    V stage 0."""
    return stage_of(pp * virtual - 1, pp, schedule in V_SHAPED)


def ends_backward(kind: str) -> bool:
    """Whether an action of `kind` ends a pair's activations (B or I: its input's gradient is
    formed, and its graph freed)."""
    return kind in (BACKWARD, INPUT)


# ------------------------------------------------------------------------------ the schedules


def check_schedule(schedule: str, stage: int, pp: int, microbatches: int, virtual: int) -> None:
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
    elif schedule == "zbv":
        if virtual != 2:
            raise ValueError(
                f"schedule 'zbv' runs two model chunks per stage (a V), so virtual must be 2, "
                f"got virtual={virtual}.")
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
    check_schedule(schedule, stage, pp, microbatches, virtual)
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
    if schedule == "zb_h1":
        return _zero_bubble_h1(stage, pp, m)
    if schedule == "zbv":
        return _zero_bubble_v(stage, pp, m)
    total = m * virtual
    forwards = [_interleaved_action(FORWARD, k, pp, virtual) for k in range(total)]
    backwards = [_interleaved_action(BACKWARD, k, pp, virtual) for k in range(total)]
    # Megatron's warmup: the first backward reaches this stage after the first group has gone
    # through every chunk but this stage's last one, (v - 1) * pp forwards, plus two per later
    # stage (the forward there and the backward coming back).
    warmup = min((pp - stage - 1) * 2 + (virtual - 1) * pp, total)
    return _warmup_steady_cooldown(forwards, backwards, warmup)


def _zero_bubble_h1(stage: int, pp: int, m: int) -> list[Action]:
    """ZB-H1 (Qi et al., Zero Bubble Pipeline Parallelism, 2024): 1f1b's forwards and input
    backwards, with each W right after its I except stage s's first s, which wait to the end:
    they fill the time the last I's take to come back to stage 0, so a stage idles about a
    third of 1f1b's bubble when F, I and W cost the same. At most pp micro-batches are alive
    on every stage (their activations until I, W's inputs until W)."""
    warmup = min(pp - stage - 1, m)
    order = [Action(FORWARD, i, 0) for i in range(warmup)]
    weights = iter(range(m))  # W's in the order of their I's
    for k in range(m):
        if warmup + k < m:
            order.append(Action(FORWARD, warmup + k, 0))
        order.append(Action(INPUT, k, 0))
        if k >= stage:
            order.append(Action(WEIGHT, next(weights), 0))
    return order + [Action(WEIGHT, i, 0) for i in weights]


def _zero_bubble_v(stage: int, pp: int, m: int) -> list[Action]:
    """ZB-V (the same paper, section 6), as torch.distributed.pipelining builds it: two chunks
    in a V, warmed up with 2 (pp - stage) - 1 forwards of chunk 0 and the stage's forwards
    of chunk 1 interleaved; in the steady state F, I and W of each chunk in turn; the
    cool-down's W's fill the time the I's take to come back. It is planned for at least
    2 pp - 1 micro-batches, and the actions of those past m are dropped."""
    n = max(2 * pp - 1, m)
    done = {kind: [0, 0] for kind in (FORWARD, INPUT, WEIGHT)}  # actions run, per chunk
    order: list[Action] = []

    def run(kind: str, chunk: int) -> None:
        order.append(Action(kind, done[kind][chunk], chunk))
        done[kind][chunk] += 1

    forwards = done[FORWARD]
    for _ in range(2 * (pp - stage) - 1):
        run(FORWARD, 0)
    for _ in range(stage):
        run(FORWARD, 1)
        run(FORWARD, 0)
    for _ in range(pp - stage):
        for kind in (FORWARD, INPUT, WEIGHT):
            run(kind, 1)
    while forwards[1] < forwards[0] or forwards[0] < n:
        if forwards[0] < n:
            run(FORWARD, 0)
        for kind, chunk in ((INPUT, 0), (WEIGHT, 0), (FORWARD, 1), (INPUT, 1), (WEIGHT, 1)):
            run(kind, chunk)
    for _ in range(stage):
        run(INPUT, 0)
        run(INPUT, 1)
    for _ in range(pp - stage):
        run(INPUT, 0)
        run(WEIGHT, 0)
    for chunk in (1, 0):
        while done[WEIGHT][chunk] < done[INPUT][chunk]:
            run(WEIGHT, chunk)
    return [a for a in order if a.microbatch < m]


def in_flight(actions: list[Action]) -> int:
    """The most (micro-batch, chunk) activations the stage holds at once: forwarded, their
    input's gradient not yet formed (by B or I). In chunk units: with v chunks, one unit is 1/v
    of a stage's layers."""
    held: set[tuple[int, int]] = set()
    most = 0
    for action in actions:
        key = (action.microbatch, action.chunk)
        if action.kind == FORWARD:
            held.add(key)
            most = max(most, len(held))
        elif ends_backward(action.kind):
            held.discard(key)
    return most


def weights_pending(actions: list[Action]) -> int:
    """The most (micro-batch, chunk) pairs whose I has run and W not yet (each holds what its
    W needs: the linears' inputs and output gradients); 0 without a split backward."""
    pending = most = 0
    for action in actions:
        pending += {INPUT: 1, WEIGHT: -1}.get(action.kind, 0)
        most = max(most, pending)
    return most


# The runner posts an action's receives this many actions before it (each then holds its
# message until it is used), so a message arrives while the rank computes.
RECEIVE_AHEAD = 1


def message_counts(actions: list[Action], stage: int, pp: int, virtual: int = 1,
                   v_shape: bool = False) -> set[tuple[int, int]]:
    """The received messages a stage holds during each of its actions, as (hidden-state
    messages, position messages) pairs, the dominated ones dropped: the receives posted for the
    next RECEIVE_AHEAD actions (a forward of a chunk after the model's first: its hidden states
    and their positions; a backward (B or I) of a chunk before the last: the gradient), and the
    action's own: a backward holds its gradient throughout, a forward its positions (its hidden
    states become the chunk's input, which its activations count). A V's turn is on the stage
    itself: no receive is posted for it; the first chunk's output is held until the second's
    forward takes it, and the gradient the second's I hands the first until the first's I
    uses it."""
    last = pp * virtual - 1

    def source(action: Action) -> int | None:
        """The model chunk whose output (or input's gradient) the action takes; None: none."""
        chunk = model_chunk(stage, action.chunk, pp, v_shape)
        if action.kind == FORWARD:
            return None if chunk == 0 else chunk - 1
        if action.kind == WEIGHT or chunk == last:
            return None
        return chunk + 1

    def received(action: Action, own: bool) -> tuple[int, int]:
        if source(action) is None:
            return (0, 0)
        if action.kind == FORWARD:
            return (0 if own else 1, 1)
        return (1, 0)

    def local(action: Action) -> bool:
        return source(action) is not None and stage_of(source(action), pp, v_shape) == stage

    # handed: outputs and gradients formed on this stage for its own later action
    counts, handed = set(), 0
    for i, action in enumerate(actions):
        if local(action):
            handed -= 1  # now the action's own (a forward's: its chunk's input)
        ahead = [received(a, False) for a in actions[i + 1:i + 1 + RECEIVE_AHEAD]
                 if not local(a)]
        own = received(action, True)
        counts.add((own[0] + handed + sum(a for a, _ in ahead),
                    own[1] + sum(p for _, p in ahead)))
        chunk = model_chunk(stage, action.chunk, pp, v_shape)
        if ends_backward(action.kind) and chunk > 0 and stage_of(chunk - 1, pp, v_shape) == stage:
            handed += 1
        if action.kind == FORWARD and chunk < last and stage_of(chunk + 1, pp, v_shape) == stage:
            handed += 1
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
