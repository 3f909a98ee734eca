"""The one-line refusals of a single config value: at least 1, finite in a range, one of some
names. Each names the key, the value and the fix; the checks (trainer.checks) and the model
parts' rules (trainer.parts) use them.
"""
from __future__ import annotations

import math


def positive_int(key: str, value: int, fix: str = "") -> None:
    if value < 1:
        raise ValueError(f"{key}={value} must be >= 1. Fix: {fix or f'set {key} to 1 or more'}.")


def finite(key: str, value: float, low: float, low_ok: bool, high: float | None = None,
            high_ok: bool = True, fix: str = "") -> None:
    """value finite and in the interval; e.g. low=0, low_ok=False is `> 0`."""
    inside = math.isfinite(value) and (value >= low if low_ok else value > low)
    if inside and high is not None:
        inside = value <= high if high_ok else value < high
    if not inside:
        low_side = f"{'[' if low_ok else '('}{low:g}"
        high_side = f"{high:g}{']' if high_ok else ')'}" if high is not None else "inf)"
        raise ValueError(f"{key}={value} must be a finite number in {low_side}, {high_side}. "
                         f"Fix: {fix or f'set {key} inside that range'}.")


def one_of(key: str, value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise ValueError(f"{key}={value!r} selects no {what}. Fix: choose one of "
                         f"{', '.join(choices)}.")
