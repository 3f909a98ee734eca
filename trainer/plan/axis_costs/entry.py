"""What an entry of the cost registry is made of: AxisCosts, one per parallel.layout.axes entry,
and what its hooks read (Micro: one micro-batch on one rank, for the time terms; Offer: the
layout search's state, for the candidates). No torch: compose time imports it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Optional

from parallel.layout import Layout
from trainer.config import ModelConfig, RecomputeGranularity
from trainer.plan.hardware import Hardware
from trainer.plan.options import EngineOptions

Recompute = Optional[RecomputeGranularity]
Choice = dict[str, Any]  # config key -> value (a candidate's, or the options' field -> value)


@dataclass(frozen=True)
class Micro:
    """One micro-batch on one rank, as trainer.plan.cost sizes it (symbols as there)."""

    model: ModelConfig
    layout: Layout
    hw: Hardware
    options: Optional[EngineOptions]  # None in floor_s: a floor holds under any option
    T: int  # this rank's tokens of the micro-batch
    e: int  # bytes of the compute dtype
    block_weights: int  # W: a block's weight elements (a full weight: W/t of them a TP rank)
    attention_s: float = 0.0  # a block's attention, forward
    head_s: float = 0.0  # the head's forward
    overlaps: bool = False  # ranks have cores of their own: a message can hide behind compute
    # Of W, the elements that form gradients (None: all): under peft=lora the adapters' alone,
    # so only theirs are reduced; the frozen head and embedding send no gradient either.
    trained_weights: float | None = None

    @property
    def grad_weights(self) -> float:
        """A block's weight elements whose gradients are reduced."""
        return self.block_weights if self.trained_weights is None else self.trained_weights


@dataclass(frozen=True)
class Offer:
    """The layout search's state when it asks an axis for its candidates: the choices of the
    axes asked before it (config key -> value), the keys the config fixed, the drops counted."""

    problem: Any  # trainer.auto.search.Problem (read here; the search is the room above)
    fixed: dict[str, Any]
    dropped: Counter
    chosen: Choice

    def choices(self, key: str, options: list) -> list:
        """A fixed key offers its value only."""
        return [self.fixed[key]] if key in self.fixed else options

    def allows(self, key: str, value: Any, null: Any = None) -> bool:
        """Whether a fixed key (null standing for `null`) asks for this value."""
        if key not in self.fixed:
            return True
        return (self.fixed[key] if self.fixed[key] is not None else null) == value


def walk(hooks: list[Callable[[Offer], Iterable[Choice]]], offer: Offer) -> Iterator[Choice]:
    """The product of the hooks' choices in their order, each hook offered the choices before
    it: every combination, as one dict."""
    if not hooks:
        yield dict(offer.chosen)
        return
    for choice in hooks[0](offer):
        yield from walk(hooks[1:], replace(offer, chosen={**offer.chosen, **choice}))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class AxisCosts:
    """An axis's cost side: every field but `axis` is optional (an axis without a term has none
    there). trainer.plan.axis_costs.REGISTRY holds one per parallel.layout.axes entry, in its
    order; the plan, the cost model, the search and the dry run loop over it."""

    axis: str  # the name of its parallel.layout.axes entry
    # What it asks of the model's shapes under a layout: raises a ValueError naming the fix.
    check_model: Optional[Callable[[ModelConfig, Layout, EngineOptions], None]] = None

    # Its time (trainer.plan.cost.estimate): the row of Estimate.seconds its micro-batch terms
    # add to, and those terms: one block's (what it recomputes, the block's forward and
    # backward compute seconds), the head's (last stage), the embedding's (first stage), one
    # stage's (its model chunks). Per step: its row and term (the slowest stage's micro-batch
    # seconds, the weight elements of each stage planned).
    kind: Optional[str] = None
    block_s: Optional[Callable[[Micro, Recompute, float, float], float]] = None
    head_s: Optional[Callable[[Micro], float]] = None
    embedding_s: Optional[Callable[[Micro], float]] = None
    stage_s: Optional[Callable[[Micro, int], float]] = None
    step_kind: Optional[str] = None
    step_s: Optional[Callable[[Micro, float, list[int]], float]] = None
    # Its part of trainer.plan.cost.floor_s, at most its time under any option: per block, per
    # head, the micro-batches of slowest-stage time a step adds (the bubble), per step (given
    # each stage's blocks).
    floor_block_s: Optional[Callable[[Micro], float]] = None
    floor_head_s: Optional[Callable[[Micro], float]] = None
    floor_microbatches: Optional[Callable[[Micro], float]] = None
    floor_step_s: Optional[Callable[[Micro, list[int]], float]] = None

    # parallel=auto (trainer.auto.search): its degrees (each a dict of its keys), given the
    # degrees chosen before it; the reason it refuses a complete set of degrees before the
    # Layout sees it (counted, once per set); its other keys to try with each layout of those
    # degrees (virtual stages, EP); its EngineOptions fields to try with each Layout.
    degrees: Optional[Callable[[Offer], Iterable[Choice]]] = None
    refuses: Optional[Callable[[Offer], Optional[str]]] = None
    variants: Optional[Callable[[Offer], Iterable[Choice]]] = None
    options: Optional[Callable[[Offer, Layout], Iterable[Choice]]] = None
    # The axis whose choices its candidates read where that one comes later in the registry
    # (EP divides a pipeline stage's ranks): the search asks it right after that one.
    chosen_after: Optional[str] = None

    # What a person reads: its labels in a candidate's one-line description, each with its
    # place in the line (the degrees TP to DP first, then the choices that refine them), and
    # its part of the dry run's inputs line.
    labels: Optional[Callable[[Layout, Choice], tuple[tuple[int, str], ...]]] = None
    inputs: Optional[Callable[[Layout], str]] = None
