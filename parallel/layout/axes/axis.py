"""What an entry of the axis registry is made of: the layout's inputs (Key), the groups over rank
axes (Group) and the axis itself (Axis), with the error every rule raises. Pure Python (no
torch, no config library): compose time imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional


class LayoutError(ValueError):
    """A parallel layout that breaks a rule of the contract; the message names keys and fix."""


def multiples_near(value: int, base: int) -> str:
    """'4 or 8': the multiples of base on either side of value (the usual fix)."""
    below, above = (value // base) * base, -(-value // base) * base
    if below < base:
        return str(above if above >= base else base)
    return str(below) if below == above else f"{below} or {above}"


@dataclass(frozen=True)
class Key:
    """One input of the layout: a Layout field, set by the config key `section.name`."""

    name: str
    section: str = "parallel"
    flag: bool = False  # true/false; otherwise an integer >= 1
    null: Optional[str] = None  # what null means (None: null is not allowed)
    fix: str = ""  # the fix of a value below 1
    # The Layout property that reads its value with null resolved (None: the field itself).
    effective: Optional[str] = None
    searched: bool = True  # parallel=auto chooses it when the config leaves it to the search

    @property
    def config_key(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    def check(self, value: Any) -> None:
        """The value's type and range; a LayoutError names the key and the fix."""
        if value is None and self.null is not None:
            return
        if self.flag:
            if not isinstance(value, bool):
                raise LayoutError(f"{self.config_key}={value!r} must be true or false.")
            return
        fix = self.fix or (f"set it to 1 or more, or {self.config_key}=null for {self.null}"
                           if self.null else f"set {self.config_key} to 1 or more")
        if not isinstance(value, int) or isinstance(value, bool):
            raise LayoutError(f"{self.config_key}={value!r} must be an integer >= 1. Fix: {fix}.")
        if value < 1:
            raise LayoutError(f"{self.config_key}={value} must be >= 1. Fix: {fix}.")


def off(name: str) -> Key:
    """A degree whose 1 turns its axis off."""
    return Key(name, fix=f"set parallel.{name}=1 (off)")


@dataclass(frozen=True)
class Group:
    name: str
    axes: Optional[tuple[str, ...]]  # None: not a product of rank axes (see Layout.groups)
    purpose: str
    view: str  # "weight" (who holds which weight shard) or "token" (who sees which tokens)
    # The rank order it is a product of: "dense" (parallel.layout.axes.RANK_AXES) or "expert"
    # (EXPERT_RANK_AXES: Megatron-Core's second rank generator, parallel.layout.axes.expert).
    order: str = "dense"


# A rule relating an axis's degrees to the others': it reads the parallel.layout.Layout being
# built (its inputs type-checked, their nulls resolved) and raises LayoutError naming the keys
# and the fix. Rules take the Layout untyped: it imports this package, not the other way.
Rule = Callable[[Any], None]


@dataclass(frozen=True)
class Axis:
    name: str
    keys: tuple[Key, ...]
    rank_axes: dict[str, str]  # fastest first: each rank axis and the Layout size of it
    groups: tuple[Group, ...]
    # How parallelize applies it: phase (parallel.build.PHASES) -> "module:function" of its
    # step, named here and imported only when a rank is built (this package imports no torch).
    steps: dict[str, str] = field(default_factory=dict)
    # Its rules, run by the Layout in the registry's order (an axis's rules may use the sizes
    # of the axes before it, which their rules have checked).
    rules: tuple[Rule, ...] = ()
    # Its rank axes in the expert view (fastest first), where it has any.
    expert_rank_axes: dict[str, str] = field(default_factory=dict)
    # The communication options it owns: parallel.build.CommOptions field -> the config key
    # that sets it (how its layers communicate, never what they compute).
    comm_options: dict[str, str] = field(default_factory=dict)
