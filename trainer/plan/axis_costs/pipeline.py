"""The pipeline's cost entry: the blocks split over stages and the schedule that goes with
virtual chunks; the activations of every (micro-batch, chunk) pair a stage's schedule keeps at
once and the messages it holds (memory), the residual stream sent between stages and the bubble
(time); the search's PP, virtual stages and schedule. The schedules themselves are
parallel.layout.pipeline_schedules'.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from parallel.layout import Layout
from parallel.layout.axes.pipeline import PIPELINE, VIRTUAL
from parallel.layout.pipeline_schedules import (
    BACKWARD,
    FORWARD,
    INPUT,
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPED,
    WEIGHT,
    Action,
    message_counts,
    stage_actions,
)
from parallel.layout.pipeline_simulation import simulate
from trainer.config import ModelConfig
from trainer.parts.tokens import FP32, Tokens
from trainer.plan.axis_costs.entry import AxisCosts, Offer, divisors
from trainer.plan.hardware import Hardware
from trainer.plan.options import EngineOptions

POSITION_BYTES = 8  # int64


def check_model(model: ModelConfig, layout: Layout, options: EngineOptions) -> None:
    """The blocks split over stages and chunks (Layout.pipeline_layers raises naming the keys);
    each schedule with the virtual chunks it runs (Megatron: a virtual size selects
    interleaving; zbv's V is two chunks a stage) and what it cannot be combined with."""
    layout.pipeline_layers(model.num_layers)
    schedule, key = options.pipeline_schedule, "parallel.virtual_pipeline_model_parallel_size"
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pipeline_schedule={schedule!r} selects no pipeline schedule. "
                         f"Fix: choose one of {', '.join(SCHEDULES)}.")
    v = layout.virtual_pipeline_size
    if schedule == "interleaved_1f1b" and v < 2:
        raise ValueError(
            f"parallel.pipeline_schedule=interleaved_1f1b needs {key} >= 2 model chunks per "
            f"stage (it is {layout.virtual_pipeline_model_parallel_size}). Fix: set {key}=2, "
            f"or parallel.pipeline_schedule=1f1b.")
    if schedule == "zbv" and v != 2:
        raise ValueError(
            f"parallel.pipeline_schedule=zbv runs two model chunks per stage (a V), so it needs "
            f"{key}=2 (it is {layout.virtual_pipeline_model_parallel_size}). Fix: set {key}=2, "
            f"or parallel.pipeline_schedule=zb_h1.")
    if schedule not in ("interleaved_1f1b", "zbv") and v > 1:
        raise ValueError(
            f"{key}={v} needs parallel.pipeline_schedule=interleaved_1f1b or zbv (it is "
            f"{schedule}). Fix: set one of those, or {key}=null.")
    if schedule in V_SHAPED:
        for end in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            if getattr(layout, end) is not None:
                raise ValueError(
                    f"parallel.{end}={getattr(layout, end)} with parallel.pipeline_schedule="
                    f"{schedule}: a V's first stage runs both the model's first and last "
                    f"chunks, so the ends are not separate stages. Fix: set parallel.{end}=null.")
    if schedule in SPLIT_BACKWARD and options.compile_blocks:
        raise ValueError(
            f"parallel.pipeline_schedule={schedule} splits each backward into input and weight "
            f"gradients, which compiled blocks cannot (their backward is one graph). Fix: set "
            f"train.compile=none, or parallel.pipeline_schedule=1f1b.")


class Kept(NamedTuple):
    """What a stage keeps at its most: activations (with what W waits for), and the bf16 weight
    copies autocast made for the same pairs' forwards (trainer.plan.moments.autocast_copy_bytes),
    apart so the dry run can show them."""

    activations: int
    copies: int = 0


def stage_activation_bytes(per_chunk: list[int], actions: list[Action],
                           per_chunk_weights: list[int] | None = None,
                           per_chunk_copies: list[int] | None = None) -> Kept:
    """The most a pipeline stage keeps at once: its schedule (`actions`) runs micro-batches
    forward before their backwards, so the activations of every (micro-batch, chunk) in flight
    are alive together (1F1B: up to PP micro-batches on the first stage; without pipeline
    parallelism one). per_chunk: what one micro-batch keeps in each of the stage's chunks
    (trainer.plan.activations.stage_chunk_bytes); per_chunk_weights: what a split backward's
    pair holds from its I to its W (activations.weight_grad_bytes); per_chunk_copies: its
    autocast copies, kept from its forward to its backward (B or I) like its activations.
    Counted where a moment of the step's sits on it: after a forward, and as a backward (B or
    I) starts; after an I the W's pile up, but what follows there (a W: one matmul; a forward)
    forms less than a backward's moment, which the next I's start counts. kept_bytes is the
    same peak without walking a long schedule."""
    copies_of = per_chunk_copies or [0] * len(per_chunk)
    alive, copies, peak = 0, 0, Kept(0)
    for action in actions:
        held, copy = per_chunk[action.chunk], copies_of[action.chunk]
        weights = per_chunk_weights[action.chunk] if per_chunk_weights else 0
        if action.kind in (BACKWARD, INPUT) and alive + copies > sum(peak):
            peak = Kept(alive, copies)
        alive += {FORWARD: held, INPUT: weights - held, WEIGHT: -weights}.get(action.kind,
                                                                              -held)
        copies += {FORWARD: copy, WEIGHT: 0}.get(action.kind, -copy)
        if action.kind == FORWARD and alive + copies > sum(peak):
            peak = Kept(alive, copies)
    return peak


def message_sizes(m: ModelConfig, layout: Layout) -> tuple[int, int]:
    """(bytes of one hidden-state message, of one positions message) between pipeline stages:
    the residual stream of a micro-batch in the masters' fp32 (split over TP with SP), its
    token positions in int64."""
    k = Tokens.of(layout)
    return k.Tr * m.hidden_size * FP32, k.T * POSITION_BYTES


@lru_cache(maxsize=4096)
def _alive(stage: int, pp: int, m: int, v: int) -> tuple[tuple[int, ...], ...]:
    """The interleaved schedule's micro-batches alive after each forward, counted by chunk,
    keeping only counts no other exceeds in every chunk. The order of forwards does not depend
    on m and repeats every pp x v of them, so after the warm-up ((v + 1) x pp forwards at
    most) two periods show every count there is: 4 x pp micro-batches stand for any larger
    m."""
    counts = [0] * v
    seen: set[tuple[int, ...]] = set()
    for action in stage_actions("interleaved_1f1b", stage, pp, min(m, 4 * pp), v):
        step = 1 if action.kind == FORWARD else -1
        counts[action.chunk] += step
        if step == 1:
            seen.add(tuple(counts))
    return tuple(a for a in seen if not any(b != a and all(x >= y for x, y in zip(b, a))
                                            for b in seen))


@lru_cache(maxsize=4096)
def schedule_messages(schedule: str, stage: int, pp: int, m: int, v: int
                      ) -> frozenset[tuple[int, int]]:
    """message_counts of a stage's schedule; as in _alive, 4 x pp micro-batches show every
    count a larger m has (the pattern repeats after the warm-up)."""
    actions = stage_actions(schedule, stage, pp, min(m, 4 * pp), v)
    return frozenset(message_counts(actions, stage, pp, v, schedule in V_SHAPED))


def kept_bytes(per_chunk: list[int], schedule: str, stage: int, layout: Layout,
               per_chunk_weights: list[int] | None = None,
               per_chunk_copies: list[int] | None = None) -> Kept:
    """stage_activation_bytes' peak over the schedule without walking every action, for a
    stage's chunks (what each keeps: equal but for the head on the last, or a hybrid's of
    different blocks): 1f1b keeps min(PP - stage, m) micro-batches at most, gpipe all m; the
    zero-bubble schedules' pattern repeats after the warm-up, so 4 x pp micro-batches show
    their peak (as _alive's)."""
    pp, m, v = layout.pp_size, layout.num_microbatches, layout.virtual_pipeline_size
    copies = per_chunk_copies or [0] * len(per_chunk)
    if schedule in SPLIT_BACKWARD:
        return stage_activation_bytes(
            per_chunk, stage_actions(schedule, stage, pp, min(m, 4 * pp), v), per_chunk_weights,
            copies)
    if schedule in ("gpipe", "1f1b"):
        n = m if schedule == "gpipe" else min(pp - stage, m)
        return Kept(n * per_chunk[0], n * copies[0])
    # each chunk's count times what it keeps (a hybrid's chunks may differ in kind)
    return max((Kept(sum(n * b for n, b in zip(counts, per_chunk)),
                     sum(n * c for n, c in zip(counts, copies)))
                for counts in _alive(stage, pp, m, v)), key=sum)


def send_seconds(m: ModelConfig, layout: Layout, hw: Hardware, chunks: int) -> float:
    """A stage's micro-batch: the residual stream (fp32, split over TP with SP) out of each of
    its chunks and its gradient back."""
    if layout.pp_size == 1:
        return 0.0
    return 2 * chunks * hw.link(layout, "pp").send(message_sizes(m, layout)[0])


@lru_cache(maxsize=4096)
def bubble_microbatches(schedule: str, pp: int, m: int, v: int) -> float:
    """A schedule's bubble in micro-batches of a stage (one F + B of all its chunks), as
    pipeline_simulation.simulate gives it with a backward twice the forward, split evenly
    into I and W: (PP-1)/v for the 1F1B family; about a third of 1F1B's for zb_h1 and
    less for zbv. Idle time does not grow past the warm-up, so 4 x pp micro-batches stand
    for more."""
    result = simulate(schedule, pp, min(m, 4 * pp), v)
    return (result.makespan - sum(result.busy) / pp) / 3.0


def bubble_seconds(micro_s: float, layout: Layout, hw: Hardware, schedule: str = "1f1b"
                   ) -> float:
    """The bubble: bubble_microbatches of the slowest stage, of which ranks sharing CPU
    cores lose only Hardware.bubble_share(PP)."""
    pp = layout.pp_size
    if pp == 1:
        return 0.0
    return micro_s * bubble_microbatches(schedule, pp, layout.num_microbatches,
                                         layout.virtual_pipeline_size) * hw.bubble_share(pp)


def floor_bubble(layout: Layout, hw: Hardware) -> float:
    """The least bubble_microbatches any schedule the search offers at this layout gives
    (zb_h1 without virtual chunks, interleaved_1f1b with), times bubble_share."""
    pp, m, v = layout.pp_size, layout.num_microbatches, layout.virtual_pipeline_size
    if pp == 1:
        return 0.0
    schedules = ("zb_h1",) if v == 1 else ("interleaved_1f1b",)
    return min(bubble_microbatches(s, pp, m, v) for s in schedules) * hw.bubble_share(pp)


PP_KEY, SCHEDULE_KEY = "parallel.pipeline_model_parallel_size", "parallel.pipeline_schedule"


def degrees(offer: Offer):
    """Each PP that divides the ranks TP x GTP_remat x CP leave, up to a block a stage."""
    c, p = offer.chosen, offer.problem
    rest = p.world_size // (c["parallel.tensor_parallel_num_weight_shards"]
                            * c["parallel.context_parallel_size"])
    for pp in divisors(rest):
        if pp <= p.model.num_layers and offer.allows(PP_KEY, pp):
            yield {PP_KEY: pp}


def variants(offer: Offer):
    """Model chunks per stage: none (1f1b, or a fixed gpipe) and, with PP, each v >= 2 that
    splits the stage's blocks."""
    key, p, pp = VIRTUAL.config_key, offer.problem, offer.chosen[PP_KEY]
    if key in offer.fixed:
        return [{key: offer.fixed[key]}]
    schedule = offer.fixed.get(SCHEDULE_KEY)
    chunks = [None] if schedule != "interleaved_1f1b" else []
    if pp > 1 and schedule in (None, "interleaved_1f1b"):
        per_stage = p.model.num_layers // pp
        virtual = [v for v in range(2, per_stage + 1) if per_stage % v == 0]
        if _microbatches(p, pp) % pp == 0:
            chunks += virtual
        else:
            offer.dropped["interleaving with micro-batches not a multiple of PP"] += len(virtual)
    return [{key: v} for v in chunks]


def _microbatches(p, pp: int) -> int:
    """A multiple of every layout's micro-batches a step (1 when the global batch follows the
    layout; then the interleaved schedule, which needs a multiple of PP, is out)."""
    if p.global_batch_size is None:
        return 1
    # m = this / BPS: unless this is a multiple of PP, m is not (the Layout checks m itself)
    return p.global_batch_size // p.micro_batch_size


def options(offer: Offer, layout: Layout):
    """The schedule that goes with the layout's virtual stages, unless fixed; without them
    also zb_h1 (less bubble, more memory: the search weighs both), unless blocks compile."""
    if SCHEDULE_KEY in offer.fixed:
        yield {"pipeline_schedule": offer.fixed[SCHEDULE_KEY]}
        return
    interleaved = layout.virtual_pipeline_model_parallel_size
    yield {"pipeline_schedule": "interleaved_1f1b" if interleaved else "1f1b"}
    compiled = dict(offer.problem.given).get("train.compile") == "blocks"
    if layout.pp_size > 1 and not interleaved and not compiled:
        yield {"pipeline_schedule": "zb_h1"}


COSTS = AxisCosts(
    PIPELINE.name, check_model, kind="pipeline sends",
    stage_s=lambda k, chunks: send_seconds(k.model, k.layout, k.hw, chunks),
    step_kind="pipeline bubble", step_s=lambda k, micro_s, _: bubble_seconds(
        micro_s, k.layout, k.hw, k.options.pipeline_schedule if k.options else "1f1b"),
    floor_microbatches=lambda k: floor_bubble(k.layout, k.hw),
    degrees=degrees, variants=variants, options=options,
    labels=lambda lay, values: ((4, f"PP={lay.pp_size}"),) + (
        ((7, f"v={lay.virtual_pipeline_size}"),) if lay.virtual_pipeline_size > 1 else ()),
    inputs=lambda lay: f"PP={lay.pipeline_model_parallel_size}")
