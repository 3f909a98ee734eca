"""Tensor parallel's terms of time: the collectives of a block's (and the head's) activations
over TP. (Its memory terms are the splits by t in trainer.plan.activations' symbols.)"""
from __future__ import annotations

from parallel.layout import Layout
from trainer.plan.hardware import Hardware


def tp_seconds(layout: Layout, hw: Hardware, activation_bytes: float) -> tuple[float, float]:
    """(a block's, the head's) TP messages, forward and backward, not hidden: a block runs two
    all-gathers and two reduce-scatters of `activation_bytes` (T*h*e) each way with SP (two
    all-reduces without: the same bytes); the head one each way."""
    t = layout.tp_size
    if t == 1:
        return 0.0, 0.0
    one = hw.link(layout, "tp").ring(t, activation_bytes)
    return 8 * one, 2 * one
