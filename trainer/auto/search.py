"""parallel=auto: every layout the trainer can run for a model, a sequence length and a cluster,
sized by the memory plan, timed by the cost model, and the fastest that fits.

The search walks the axes' degrees (TP, SP, weight shards, sequence shards, CP, PP), then their
other keys (virtual stages, EP), then for each layout the Layout accepts the axes' options
(cp_comm_type, the schedule) and recompute: each axis's entry of trainer.plan.axis_costs offers
its own. Any key the user set
stays as set: it constrains the search. A candidate whose planned peak (trainer.plan.fit, the
dry run's plan) exceeds the device less its margin is dropped; recompute is only tried where the
layout does not fit without it (it is never faster). Candidates rank by seconds per sample (the
global batch may follow the layout when train.global_batch_size is null); near ties go to the
simpler layout, then to the smaller peak.
"""
from __future__ import annotations

import functools
import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from parallel.layout import Layout, LayoutError
from parallel.layout.axes import COMM_KEYS, PARALLEL_KEYS
from trainer.checks import check_model
from trainer.config import ModelConfig, PeftConfig, Precision, RecomputeGranularity
from trainer.parts.assembly import parameter_shapes
from trainer.parts.lora import Adapters
from trainer.plan.axis_costs import SEARCH_ORDER, describe_layout
from trainer.plan.axis_costs.entry import Offer, walk
from trainer.plan.cost import Estimate, estimate, floor_s
from trainer.plan.fit import PeakPlanner
from trainer.plan.hardware import Hardware
from trainer.plan.muon import MuonPlan, update_seconds
from trainer.plan.options import EngineOptions
from trainer.units import GiB

# The keys the search sets, by config path: the axes' degrees it chooses
# (parallel.layout.axes), then the options it tries for each layout (the axes' entries in
# trainer.plan.axis_costs offer them); the rest of parallel.* are inputs.
OPTIONS = ("parallel.pipeline_schedule", "parallel.cp_comm_type", "train.recompute_granularity")
SEARCHED = (*(key.config_key for key in PARALLEL_KEYS if key.searched), *OPTIONS)
# Inputs of the search that it does not choose: the axes' other keys and their communication
# options (Axis.comm_options) of parallel.*.
GIVEN = (*(key.config_key for key in PARALLEL_KEYS if not key.searched),
         *(key for key in COMM_KEYS if key.startswith("parallel.") and key not in OPTIONS))
LAYOUT_NAMES = {key.config_key: key.name for key in PARALLEL_KEYS}  # config key -> Layout field
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
    muon: MuonPlan | None = None  # optim=muon: its state, update transient and update time
    # peft=lora: only the adapters hold gradients and state (the memory plan; the cost model
    # still prices full fine-tuning's messages); reference: DPO's frozen copy beside the model
    peft: PeftConfig | None = None
    reference: bool = False


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
        """"TP=2 SP WS=8 SS=4 CP=1 PP=4 DP=2 EP=2 v=4 p2p recompute=off": the axes' labels
        (trainer.plan.axis_costs), then recompute."""
        recompute = self.values["train.recompute_granularity"] or "off"
        return " ".join([*describe_layout(self.layout, self.values), f"recompute={recompute}"])

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


def degrees(p: Problem, fixed: dict[str, Any], dropped: Counter):
    """The axes' degrees to offer the Layout (config key -> value), each axis offering its
    keys' values given the choices of the axes before it (trainer.plan.axis_costs, in the
    search's order); a set of degrees an axis refuses before the Layout sees it (TP that the
    model cannot split, or that leaves the NVLink domain) is counted and skipped. The Layout
    applies every rule of its own."""
    offer = Offer(p, fixed, dropped, {})
    hooks = [costs.degrees for costs in SEARCH_ORDER if costs.degrees]
    for chosen in walk(hooks, offer):
        here = Offer(p, fixed, dropped, chosen)
        fault = next((reason for costs in SEARCH_ORDER if costs.refuses
                      for reason in [costs.refuses(here)] if reason), None)
        if fault:
            dropped[fault] += 1
            continue
        yield chosen


def search(p: Problem) -> Choice:
    """The fastest fitting layout, its best alternatives and what was dropped; NoLayoutFits
    when none fits."""
    started = time.perf_counter()
    check_model(p.model)
    fixed, given = dict(p.fixed), dict(p.given)
    m, planner = p.model, PeakPlanner(parameter_shapes(p.model, p.peft), p.model, p.muon,
                                      p.peft is not None, p.reference,
                                      p.peft is not None and Adapters.of(p.peft).base_bf16)
    budget, dropped = p.hardware.budget_bytes, Counter()
    over = "planned peak over the device memory less its margin"
    fits: list[tuple[float, int, Candidate]] = []
    nearest: tuple[int, Candidate, int] | None = None  # (peak, layout, its stage's state)
    asked = Offer(p, fixed, dropped, {}).choices(
        "train.recompute_granularity", list(RECOMPUTES[p.recompute_num_layers is not None:]))
    recomputes = [RecomputeGranularity(r) if r else None for r in asked]
    layouts = []  # (the least its step could cost per sample, its place, the layout)
    variants = [costs.variants for costs in SEARCH_ORDER if costs.variants]
    stage_layers = {key.name: given[key.config_key] for key in PARALLEL_KEYS
                    if not key.searched and key.config_key in given}
    for degree in degrees(p, fixed, dropped):
        # Each axis's other keys with these degrees (virtual stages, then EP).
        for chosen in walk(variants, Offer(p, fixed, dropped, degree)):
            try:
                layout = Layout(p.world_size, **{LAYOUT_NAMES[k]: v for k, v in chosen.items()},
                                **stage_layers, micro_batch_size=p.micro_batch_size,
                                global_batch_size=p.global_batch_size, seq_length=p.seq_length)
                layout.pipeline_layers(m.num_layers)
            except LayoutError as error:
                dropped[_rule(str(error))] += 1
                continue
            floor = floor_s(m, layout, p.precision, p.hardware, Adapters.of(p.peft))
            floor += p.muon.floor_s(p.world_size, p.hardware) if p.muon else 0.0
            floor /= layout.global_batch_size
            layouts.append((floor, len(layouts), layout))
    layouts.sort(key=lambda item: item[:2])
    kept: list[float] = []  # a max-heap (negated) of the best seconds per sample so far
    for place, (floor, _, layout) in enumerate(layouts):
        if len(kept) > ALTERNATIVES and floor >= -kept[0]:
            dropped["slower than the six best at its compute, TP and optimizer time alone"] += \
                len(layouts) - place
            break
        stages = planner.stages(layout)
        muon_s = None if p.muon is None else max(
            update_seconds(s.muon_buffers, layout, p.hardware, p.muon) for s in stages)
        # The axes' options to try with this layout (cp_comm_type, the schedule), as
        # EngineOptions fields.
        offer = Offer(p, fixed, dropped, {})
        choices = list(walk([functools.partial(costs.options, layout=layout)
                             for costs in SEARCH_ORDER if costs.options], offer))
        floor_only = planner.state_floor(stages) > budget  # over with any option
        if floor_only:
            dropped[over] += len(choices) * len(recomputes) - 1
            if nearest is not None and planner.state_floor(stages) >= nearest[0]:
                continue  # and not nearer than the nearest miss so far
        for choice in choices[:1] if floor_only else choices:
            for index, recompute in enumerate(recomputes[-1:] if floor_only else recomputes):
                options = EngineOptions(
                    p.precision, recompute, p.recompute_num_layers,
                    given.get("parallel.grad_reduce_in_bf16", False),
                    given.get("parallel.overlap_param_gather", True),
                    given.get("parallel.overlap_grad_reduce", True),
                    lora=Adapters.of(p.peft), **choice)
                peak, stage = planner.peak(layout, stages, options)
                values = {**{key.config_key: getattr(layout, key.name)
                             for key in PARALLEL_KEYS if key.searched},
                          **{key: _plain(getattr(options, key.split(".")[1]))
                             for key in OPTIONS}}
                if peak > budget:
                    dropped[over] += 1
                    if nearest is None or peak < nearest[0]:
                        nearest = (peak, Candidate(values, layout, Estimate(0.0), peak,
                                                   stage), stages[stage].memory.total_bytes)
                    continue
                candidate = Candidate(values, layout,
                                      estimate(m, layout, options, p.hardware, muon_s), peak,
                                      stage)
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


def _plain(value: Any) -> Any:
    """A config value as the config spells it (an enum as its string)."""
    return value.value if isinstance(value, Enum) else value


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
