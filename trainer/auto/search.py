"""parallel=auto: every layout the trainer can run for a model, a sequence length and a cluster,
sized by the memory plan, timed by the cost model, and the fastest that fits.

The search walks the degrees (TP, SP, weight shards, sequence shards, CP, PP), then for each
layout the Layout accepts its virtual stages, cp_comm_type and recompute. Any key the user set
stays as set: it constrains the search. A candidate whose planned peak (trainer.plan.fit, the
dry run's plan) exceeds the device less its margin is dropped; recompute is only tried where the
layout does not fit without it (it is never faster). Candidates rank by seconds per sample (the
global batch may follow the layout when train.global_batch_size is null); near ties go to the
simpler layout, then to the smaller peak.
"""
from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Optional

from parallel.layout import Layout, LayoutError
from parallel.layout.axes import PARALLEL_KEYS
from trainer.checks import check_model
from trainer.config import CPCommType, ModelConfig, Precision, RecomputeGranularity
from trainer.parts.plan import parameter_shapes
from trainer.plan.axis_costs.context import check_comm_type
from trainer.plan.cost import Estimate, estimate, floor_s
from trainer.plan.fit import PeakPlanner
from trainer.plan.hardware import Hardware
from trainer.plan.options import EngineOptions
from trainer.units import GiB

# The keys the search sets, by config path: the axes' degrees it chooses
# (parallel.layout.axes), then
# the options it tries for each layout; the rest of parallel.* are inputs.
OPTIONS = ("parallel.pipeline_schedule", "parallel.cp_comm_type", "train.recompute_granularity")
SEARCHED = (*(key.config_key for key in PARALLEL_KEYS if key.searched), *OPTIONS)
# Inputs of the search that it does not choose: the axes' other keys and the communication's.
GIVEN = (*(key.config_key for key in PARALLEL_KEYS if not key.searched),
         "parallel.grad_reduce_in_bf16", "parallel.overlap_param_gather",
         "parallel.overlap_grad_reduce")
ALTERNATIVES = 5
RECOMPUTES = (None, RecomputeGranularity.selective, RecomputeGranularity.full)


class NoLayoutFits(ValueError):
    """No candidate fits the device: the message names the nearest miss and the fixes."""


@dataclass(frozen=True)
class Problem:
    """What the search reads: the model, the batch, the cluster and the keys already set."""

    model: ModelConfig
    hardware: Hardware
    world_size: int
    micro_batch_size: int
    global_batch_size: Optional[int]
    seq_length: int
    precision: Precision
    recompute_num_layers: Optional[int]
    fixed: tuple[tuple[str, Any], ...] = ()  # SEARCHED keys the config sets, as set
    # parallel.* inputs that are not searched: overlap, bf16 reduction, stage layer counts
    given: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Candidate:
    values: dict[str, Any]  # SEARCHED key -> the config value (enums as their string)
    layout: Layout
    estimate: Estimate
    peak_bytes: int
    peak_stage: int

    @property
    def seconds_per_sample(self) -> float:
        return self.estimate.step_s / self.layout.global_batch_size

    def describe(self) -> str:
        v, lay = self.values, self.layout
        parts = [f"TP={lay.tp_size}" + (" SP" if lay.sequence_parallel and lay.tp_size > 1
                                         else ""),
                 f"WS={lay.tensor_parallel_num_weight_shards}",
                 f"SS={lay.tensor_parallel_num_sequence_shards}",
                 f"CP={lay.context_parallel_size}", f"PP={lay.pp_size}",
                 f"DP={lay.data_parallel_size}"]
        if lay.ep_size > 1:
            parts.append(f"EP={lay.ep_size}")
        if lay.virtual_pipeline_size > 1:
            parts.append(f"v={lay.virtual_pipeline_size}")
        if lay.runtime_context_parallel_size > 1:
            parts.append(v["parallel.cp_comm_type"])
        parts.append(f"recompute={v['train.recompute_granularity'] or 'off'}")
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"layout": self.describe(), "values": self.values,
                "global_batch_size": self.layout.global_batch_size,
                "peak_bytes": self.peak_bytes, "peak_stage": self.peak_stage,
                "seconds_per_sample": self.seconds_per_sample, **self.estimate.as_dict()}


@dataclass(frozen=True)
class Choice:
    chosen: Candidate
    alternatives: tuple[Candidate, ...]
    dropped: dict[str, int]  # reason -> layouts
    fitting: int  # candidates that fit
    budget_bytes: int
    search_s: float
    hardware: Hardware = field(repr=False, default=None)

    def as_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen.as_dict(),
                "alternatives": [c.as_dict() for c in self.alternatives],
                "dropped": self.dropped, "fitting": self.fitting,
                "budget_bytes": self.budget_bytes, "search_s": round(self.search_s, 3)}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(fixed: dict[str, Any], key: str, options: list) -> list:
    return [fixed[key]] if key in fixed else options


def degrees(p: Problem, fixed: dict[str, Any], dropped: Counter):
    """(TP, SP, WS, SS, CP, PP) to offer the Layout, which applies every rule of its own; TP
    that the model cannot split, or that leaves the NVLink domain, is counted and skipped."""
    m, world = p.model, p.world_size
    for tp in _choices(fixed, "parallel.tensor_model_parallel_size", divisors(world)):
        sizes = (m.num_heads, m.query_groups, m.ffn_hidden_size, m.padded_vocab_size)
        tp_fault = ("TP does not divide the model's heads, K/V groups, FFN or padded "
                    "vocabulary" if any(n % tp for n in sizes) else
                    "TP spans more than one NVLink domain"
                    if tp > p.hardware.gpus_per_nvlink_domain else
                    "TP (= ETP, parallel.expert_tensor_parallel_size=null) does not divide "
                    "the expert FFN" if m.num_moe_experts is not None and m.expert_ffn_size % tp
                    and dict(p.given).get("parallel.expert_tensor_parallel_size") is None
                    else None)
        if tp > 1 and "parallel.sequence_parallel" not in fixed:
            # SP off moves the same bytes (an all-reduce is a reduce-scatter and an
            # all-gather) and keeps TP x more activations: never better, not enumerated.
            dropped["sequence_parallel=false with TP > 1 (more memory, same traffic)"] += 1
        for sp in _choices(fixed, "parallel.sequence_parallel", [tp > 1]):
            sp_degree = tp if sp else 1
            rest = world // tp
            for g in divisors(rest):
                for ns in divisors(g):
                    for cp in divisors(rest // g):
                        stages = [d for d in divisors(rest // (g * cp)) if d <= m.num_layers]
                        for pp in stages:
                            degree = {"parallel.tensor_model_parallel_size": tp,
                                      "parallel.tensor_parallel_num_weight_shards": tp * g,
                                      "parallel.tensor_parallel_num_sequence_shards":
                                          ns * sp_degree,
                                      "parallel.context_parallel_size": cp,
                                      "parallel.pipeline_model_parallel_size": pp}
                            unset = {"parallel.tensor_parallel_num_weight_shards": tp,
                                     "parallel.tensor_parallel_num_sequence_shards": sp_degree}
                            if any((fixed[k] if fixed[k] is not None else unset[k]) != v
                                   for k, v in degree.items() if k in fixed):
                                continue  # a fixed key asks for another degree
                            if tp_fault:
                                dropped[tp_fault] += 1
                                continue
                            yield tp, sp, tp * g, ns * sp_degree, cp, pp


def search(p: Problem) -> Choice:
    """The fastest fitting layout, its best alternatives and what was dropped; NoLayoutFits
    when none fits."""
    started = time.perf_counter()
    check_model(p.model)
    fixed, given = dict(p.fixed), dict(p.given)
    m, planner = p.model, PeakPlanner(parameter_shapes(p.model), p.model)
    budget, dropped = p.hardware.budget_bytes, Counter()
    over = "planned peak over the device memory less its margin"
    fits: list[tuple[float, int, Candidate]] = []
    nearest: tuple[int, Candidate, int] | None = None  # (peak, layout, its stage's state)
    recomputes = [RecomputeGranularity(r) if r else None for r in _choices(
        fixed, "train.recompute_granularity",
        list(RECOMPUTES[p.recompute_num_layers is not None:]))]
    layouts = []  # (the least its step could cost per sample, its place, the layout)
    for tp, sp, ws, ss, cp, pp in degrees(p, fixed, dropped):
        for v, ep in product(_virtual(p, fixed, pp, dropped), _experts(p, fixed, pp)):
            try:
                stage_layers = {key.name: given[key.config_key] for key in PARALLEL_KEYS
                                if not key.searched and key.config_key in given}
                layout = Layout(p.world_size, tensor_model_parallel_size=tp,
                                sequence_parallel=sp, tensor_parallel_num_weight_shards=ws,
                                tensor_parallel_num_sequence_shards=ss, context_parallel_size=cp,
                                pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=v,
                                expert_model_parallel_size=ep, **stage_layers,
                                micro_batch_size=p.micro_batch_size,
                                global_batch_size=p.global_batch_size, seq_length=p.seq_length)
                layout.pipeline_layers(m.num_layers)
            except LayoutError as error:
                dropped[_rule(str(error))] += 1
                continue
            floor = floor_s(m, layout, p.precision, p.hardware) / layout.global_batch_size
            layouts.append((floor, len(layouts), layout))
    layouts.sort(key=lambda item: item[:2])
    kept: list[float] = []  # a max-heap (negated) of the best seconds per sample so far
    for place, (floor, _, layout) in enumerate(layouts):
        if len(kept) > ALTERNATIVES and floor >= -kept[0]:
            dropped["slower than the six best at its compute, TP and optimizer time alone"] += \
                len(layouts) - place
            break
        v = layout.virtual_pipeline_model_parallel_size
        stages = planner.stages(layout)
        comms = list(_comm_types(p, fixed, layout, dropped))
        schedule = fixed.get("parallel.pipeline_schedule", "interleaved_1f1b" if v else "1f1b")
        floor_only = planner.state_floor(stages) > budget  # over with any option
        if floor_only:
            dropped[over] += len(comms) * len(recomputes) - 1
            if nearest is not None and planner.state_floor(stages) >= nearest[0]:
                continue  # and not nearer than the nearest miss so far
        for comm in comms[:1] if floor_only else comms:
            for index, recompute in enumerate(recomputes[-1:] if floor_only else recomputes):
                options = EngineOptions(
                    p.precision, recompute, p.recompute_num_layers,
                    given.get("parallel.grad_reduce_in_bf16", False),
                    given.get("parallel.overlap_param_gather", True),
                    given.get("parallel.overlap_grad_reduce", True), comm, schedule)
                peak, stage = planner.peak(layout, stages, options)
                values = {**{key.config_key: getattr(layout, key.name)
                             for key in PARALLEL_KEYS if key.searched},
                          "parallel.pipeline_schedule": schedule,
                          "parallel.cp_comm_type": comm.value,
                          "train.recompute_granularity": recompute and recompute.value}
                if peak > budget:
                    dropped[over] += 1
                    if nearest is None or peak < nearest[0]:
                        nearest = (peak, Candidate(values, layout, Estimate(0.0), peak,
                                                   stage), stages[stage].memory.total_bytes)
                    continue
                candidate = Candidate(values, layout,
                                      estimate(m, layout, options, p.hardware), peak, stage)
                fits.append((candidate.seconds_per_sample, peak, candidate))
                heapq.heappush(kept, -candidate.seconds_per_sample)
                if len(kept) > ALTERNATIVES + 1:
                    heapq.heappop(kept)
                if index + 1 < len(recomputes):  # more recompute is only slower
                    dropped["more recompute where the layout fits with less"] += \
                        len(recomputes) - index - 1
                break
    if not fits:
        raise NoLayoutFits(_no_fit_message(p, nearest, fixed))
    # Within 0.1% of each other, the simpler layout first (fewer ranks splitting one model
    # replica: fewer collectives the cost model may have missed), then the smaller peak.
    fits.sort(key=lambda item: (float(f"{item[0]:.3g}"), _split(item[2].layout), item[1]))
    ranked = [c for _, _, c in fits]
    return Choice(ranked[0], tuple(ranked[1:1 + ALTERNATIVES]),
                  {reason: n for reason, n in dropped.most_common() if n},
                  len(ranked), budget, time.perf_counter() - started, p.hardware)


def _split(layout: Layout) -> int:
    """Ranks that split one model replica or one sequence (all but data parallel)."""
    return layout.model_and_context_parallel_size * layout.virtual_pipeline_size


def _virtual(p: Problem, fixed: dict[str, Any], pp: int, dropped: Counter
             ) -> list[Optional[int]]:
    """Model chunks per stage: none (1f1b, or a fixed gpipe) and, with PP, each v >= 2 that
    splits the stage's blocks."""
    key = "parallel.virtual_pipeline_model_parallel_size"
    if key in fixed:
        return [fixed[key]]
    schedule = fixed.get("parallel.pipeline_schedule")
    options = [None] if schedule != "interleaved_1f1b" else []
    if pp > 1 and schedule in (None, "interleaved_1f1b"):
        per_stage = p.model.num_layers // pp
        virtual = [v for v in range(2, per_stage + 1) if per_stage % v == 0]
        if _microbatches(p, pp) % pp == 0:
            options += virtual
        else:
            dropped["interleaving with micro-batches not a multiple of PP"] += len(virtual)
    return options


def _experts(p: Problem, fixed: dict[str, Any], pp: int) -> list[int]:
    """EP degrees: for a mixture of experts each that divides its experts and a stage's ranks
    (the Layout checks ETP's share); 1 for a dense model."""
    key = "parallel.expert_model_parallel_size"
    if key in fixed:
        return [fixed[key]]
    experts = p.model.num_moe_experts
    if experts is None:
        return [1]
    return [d for d in divisors(experts) if (p.world_size // pp) % d == 0]


def _microbatches(p: Problem, pp: int) -> int:
    """A multiple of every layout's micro-batches a step (1 when the global batch follows the
    layout; then the interleaved schedule, which needs a multiple of PP, is out)."""
    if p.global_batch_size is None:
        return 1
    # m = this / BPS: unless this is a multiple of PP, m is not (the Layout checks m itself)
    return p.global_batch_size // p.micro_batch_size


def _comm_types(p: Problem, fixed: dict[str, Any], layout: Layout, dropped: Counter):
    key = "parallel.cp_comm_type"
    if key in fixed:
        yield CPCommType(fixed[key])
        return
    if layout.runtime_context_parallel_size == 1:
        yield CPCommType.p2p  # unused without CP; the default
        return
    for comm in CPCommType:
        try:
            check_comm_type(p.model, layout, comm)
        except ValueError:
            dropped["cp_comm_type=a2a needs the TP-local heads divisible by runtime CP"] += 1
            continue
        yield comm


def _rule(message: str) -> str:
    """A Layout error counted by the key it names first."""
    key = message.split("=", 1)[0].split()[-1].strip("(") if "=" in message else "layout"
    return f"the Layout's rules ({key})"


def _no_fit_message(p: Problem, nearest: tuple[int, Candidate, int] | None,
                    fixed: dict[str, Any]) -> str:
    hw, budget = p.hardware, p.hardware.budget_bytes
    where = (f"parallel=auto: no layout of world_size={p.world_size} fits model "
             f"({p.model.num_layers} layers x hidden {p.model.hidden_size}) at train.seq_length="
             f"{p.seq_length}, train.micro_batch_size={p.micro_batch_size} in "
             f"cluster.device_memory_gib={hw.device_memory_gib:g} less cluster.memory_margin="
             f"{hw.memory_margin:g} ({budget / GiB:.1f} GiB a rank)")
    if nearest is None:
        constraints = ", ".join(f"{k}={v}" for k, v in fixed.items()) or "none"
        return (f"{where}: no layout passes the rules (set keys: {constraints}). Fix: remove "
                f"the parallel.* overrides that constrain the search, or change the world size.")
    peak, best, state = nearest
    # Weights, gradients and optimizer state shrink only with more ranks or a smaller model;
    # the rest (activations, gathered weights) shrinks with the tokens of a micro-batch too.
    fixes = [f"about {math.ceil(peak / budget)}x the ranks (cluster.num_nodes)",
             "a smaller model"]
    if state < budget:
        if "train.recompute_granularity" in fixed and fixed["train.recompute_granularity"] != \
                "full":
            fixes.append("train.recompute_granularity=full")
        if p.micro_batch_size > 1:
            fixes.append("a smaller train.micro_batch_size")
        # Scaled as if all of the rest were activations; a power of two at or below that.
        shorter = p.seq_length * (budget - state) // (peak - state)
        if shorter >= 1 and p.micro_batch_size == 1:
            fixes.append(f"a shorter train.seq_length (about {1 << (shorter.bit_length() - 1)})")
    fixes.append(f"a device with more than {peak / GiB:.0f} GiB (cluster.device_memory_gib)")
    held = (f" ({state / GiB:.1f} GiB of it weights, gradients and optimizer state)"
            if state >= budget else "")
    return (f"{where}: the nearest, {best.describe()}, plans {peak / GiB:.1f} GiB on stage "
            f"{best.peak_stage}{held}. Fix: {', or '.join(fixes)}.")
